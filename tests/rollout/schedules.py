"""Window schedules for tests of W "auto" (rollout/window.py): `steer(schedule)` puts a function
of the call's round and active rows in place of the measured policy's choice, so a test's
windows and modes are the same on every machine (what the policy itself chooses depends on
this machine's timing; its rule is tested on given seconds in tests/rollout/test_window.py).
A schedule sees the policy (its `round` in this call, `rows`, `windows`) and the active count,
and returns (W, compact); W is clipped to the call's largest window and compact to the
execution option's modes."""
from contextlib import contextmanager
from unittest import mock

from rollout.window import WindowPolicy


def switching(policy, active):
    """All rows active: Full at the largest window; once rows finish, Compact, the windows in
    turn."""
    if active == policy.rows:
        return policy.largest, False
    return policy.windows[policy.round % len(policy.windows)], True


def graded(policy, active):
    """The windows in turn, widest first, every third round Compact."""
    Ws = policy.windows[::-1]
    return Ws[(policy.round // 2) % len(Ws)], policy.round % 3 == 2


def widest(policy, active):
    return policy.largest, False


@contextmanager
def steer(schedule, also=()):
    """Within the block, every `WindowPolicy` chooses by `schedule`, among the call's windows
    (`HBSJD.policy`) and those of `also` (W 1 with speculative decoding, which the call's leave
    out)."""
    def choose(self, active, left):
        self.round += 1
        self.windows = tuple(sorted(set(self.windows) | set(also)))
        W, compact = schedule(self, active)
        W = min(W, self.largest)
        if "compact" not in self.modes:
            compact = False
        elif "full" not in self.modes:
            compact = True
        return W, compact
    with mock.patch.object(WindowPolicy, "choose", choose):
        yield
