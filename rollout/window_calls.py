"""The window a call of W "auto" runs: chosen per call, from what whole calls of each window
took in this process (rollout/window.py's `WindowPolicy` keeps the rounds' rule for a call's
Full / Compact switch).

What a user waits for is a call, and a round's rate is not a call's: a call ends with its
slowest image, a wide window's last rounds are part-empty, and a window first measured in one
phase of a call rates by that phase (docs/WINDOW_POLICY.md).  So the windows are priced by
the seconds of whole calls per token they commit:

    first call   the rounds' rule over every window (`WindowPolicy`): its rounds measure each
                 window's rate, whose best is the first window to run a whole call; where
                 Cached AR is an arm and no window's rounds commit AR_MARGIN times W 1's a
                 second (compute-bound: CFG, 32-64 rows on a CPU), at most the axis's middle
                 (W 4): there a wide window's call loses most to its slowest image, which the
                 rounds do not see (at CFG batch 32 the rounds rated W 16 best, and its calls
                 took 1.6-2.8 times Cached AR's), and a search started at W 16 spent a call on
                 each window down to the cheapest.
    arms         the windows, and Cached AR (`AR`: the call run whole by Cached AR, same
                 tokens with greedy and "sample" decoding, rollout/hbsjd.py `baseline_call`),
                 which replaces W 1: a W-1 round commits a token a row, as Cached AR does, with
                 the Jacobi bookkeeping on top, so W 1's call is never the cheaper of the two
                 (where the rounds rate W 1 best, the first call is Cached AR's; W 1 runs calls
                 only where Cached AR may not, or is the only window); an arm's cost is the
                 discounted mean of its calls' seconds per committed token (CALL_DISCOUNT a
                 call: follows the student as it trains and the machine as its load changes;
                 on the policy's clock, rollout/window.py `policy_clock`).  A call's seconds
                 are its rounds' seconds,
                 each clipped as its round arm's mean clips it (`WindowPolicy.finish`), and a
                 call counts at most CALL_CLIP times the arm's mean: one burst of another
                 process moves a call as much as a choice between windows a few per cent apart
                 does (on this shared VM a call of the same window took 1.4-1.5 times its
                 median now and then, and with a 1.5 clip one such call handed the lead to a
                 window 10 % slower).
                 Compiled, an arm's first call (its compiles) is dropped.
    choice       the cheapest arm, the leader.  UCB over the leader, Cached AR and the
                 windows beside the cheapest window (a call's cost is unimodal in W, as a
                 round's rate is, so the search climbs to the best window; Cached AR is no
                 window: it runs W 1's forward without the Jacobi bookkeeping, so it can beat
                 W 16 and lose to W 4, and the windows' search goes on while it leads): the
                 arm maximising  (1 / cost) (1 + EXPLORE sqrt(ln t / n)),  n its discounted
                 calls, t the calls so far (capped at the discount's horizon); an arm never
                 measured ranks first (Cached AR first of all, then the window the rounds
                 rate higher).  Cached AR is left out where W 1's rounds rate below
                 1 / AR_MARGIN of the cheapest window's calls: its bookkeeping is a small
                 share of a round wherever the forward is dear enough for Cached AR to lead,
                 so it cannot lead there, and its call would cost 1.8-3 times the leader's at
                 batch 1-8 on this CPU; left out until the calls have forgotten the first
                 (CALL_HORIZON calls), then measured: W 1's rounds are measured in the first
                 call only, and one slow W-1 round there would hold the gate for good.  A
                 first measurement is one call, run at once: the search climbs a window a
                 call.  A measured neighbour is run (explored) only while the discounted
                 seconds of exploring calls are at most CALL_BUDGET of all calls' seconds, so
                 what exploring costs is bounded, a few calls of the leader separate two
                 explorations (a noisy call decides less), and a neighbour whose estimate went
                 stale is measured again (at 4 %, about one call in twelve explores: every
                 exploring call is a call slower than the leader's, and a bench's median of 21
                 calls moved by 1-2 % with one in eight).

All of it is a few floats per call on the host, from the rounds' seconds the loop already
reads (rollout/hbsjd.py `run_jacobi`): it adds no device synchronisation.
"""
from __future__ import annotations

import math

CLIP = 1.5              # an observation counts at most 1.5 times its mean so far (`Mean`)
CALL_CLIP = 1.2         # a call: at most 1.2 times (a slow call was mostly a burst elsewhere)
EXPLORE = 0.3           # UCB's width, relative to the arm's rate (rounds and calls)
CALL_DISCOUNT = 0.9     # per call: a call's weight halves in about 6.6 calls
CALL_HORIZON = round(1 / (1 - CALL_DISCOUNT))    # 10 calls (1 / 0.1 is 10.000000000000002)
CALL_BUDGET = 0.04      # most of the calls' seconds (discounted) spent exploring
AR_MARGIN = 1.5         # where Cached AR can lead, its rate is under 1.5 times W 1's rounds' (the
#                         same forward less the Jacobi bookkeeping: 12 % of a round at batch 64)
AR = 0                  # the arm that runs a whole call as Cached AR (rollout/cached_ar.py)


class Mean:
    """A discounted mean: each observation's weight decays by `discount` per tick of its
    owner's clock (a round, or a call).  The first observation is a warm-up: it is dropped
    (warm: there is none).  With `clip`, an observation counts at most `clip` times the mean
    so far: another process's burst on a shared machine slows a round two- or threefold, once,
    and would otherwise weigh on its arm for tens of rounds (a lasting change still moves the
    mean, by up to that factor an observation)."""
    __slots__ = ("weight", "total", "last", "warm", "discount")

    def __init__(self, warm: bool = False, discount: float = 0.98):
        self.weight = self.total = 0.0
        self.last = 0                 # the clock at the last observation
        self.warm = warm              # True: no warm-up to drop
        self.discount = discount

    def add(self, x: float, now: int, clip: float | None = None, weight: float = 1.0) -> float:
        """Count observation x (clipped) at clock `now` -> what was counted (0: a warm-up)."""
        if not self.warm:
            self.warm = True
            return 0.0
        if clip is not None and self.weight:
            x = min(x, clip * self.total / self.weight)
        decay = self.discount ** (now - self.last)
        self.weight = self.weight * decay + weight
        self.total = self.total * decay + weight * x
        self.last = now
        return x

    def count(self, now: int) -> float:
        """Discounted observations at clock `now` (0: none counted yet)."""
        return self.weight * self.discount ** (now - self.last)

    @property
    def mean(self) -> float:
        return self.total / self.weight


class CallWindows:
    """Chooses the window of each call (module docstring).  warm: True where an arm's first
    call has nothing to drop (eager rounds); compiled rounds compile in it.  Per call:
    `choose(windows, rates)`, then `observe(seconds, tokens)` when the call ends."""

    def __init__(self, warm: bool = True):
        self.warm = warm
        self.cost: dict[int, Mean] = {}     # W -> seconds per committed token of its calls
        self.spent = [0.0, 0.0]             # discounted seconds: exploring calls, all calls
        self.calls = 0                      # calls observed
        self.pending: tuple[int, bool] | None = None    # (W, explore) of the running call

    def measured(self, windows: tuple) -> dict[int, float]:
        """{W: seconds per committed token} of the windows whose calls were counted."""
        return {W: m.mean for W in windows if (m := self.cost.get(W)) is not None and m.weight}

    def choose(self, windows: tuple, rates: dict[int, float]) -> int | None:
        """The window of the next call among `windows` (sorted; `AR` first where Cached AR may
        run the call), with `rates` {W: tokens per second} the rounds' estimates -> W, or
        None: run the rounds' rule (nothing measured yet)."""
        self.pending = None
        axis = windows
        if windows[0] == AR:                    # W 1 is Cached AR's forward plus the Jacobi
            axis = windows[1:]                  # bookkeeping: never the cheaper call of the
            if len(axis) > 1 and axis[0] == 1:  # two, so with Cached AR an arm it runs no call
                windows, axis = (AR, *axis[1:]), axis[1:]
        cost = self.measured(windows)
        if not cost:
            if not rates:
                return None
            W = max(rates, key=rates.get)
            if windows[0] == AR and rates[W] <= AR_MARGIN * rates.get(1, 0.0):
                # compute-bound: no window's rounds commit AR_MARGIN times W 1's a second, and
                # a wide window's call loses most to its slowest image, which the rounds do
                # not see; so the search starts at most at the axis's middle (Cached AR
                # where the rounds rate W 1 best)
                W = AR if W == 1 else min(W, axis[(len(axis) - 1) // 2])
            self.pending = (W, False)
            return W
        best = min(cost, key=cost.get)          # the leader: a window or Cached AR
        found = [W for W in axis if W in cost]
        lead = min(found, key=cost.get) if found else best      # the cheapest window
        i = axis.index(lead) if found else 0
        beside = axis[max(0, i - 1):i + 2]      # the windows' search climbs from `lead`
        if windows[0] == AR and (AR in cost or self.calls >= CALL_HORIZON or not (
                1 in rates and 1 / cost[lead] > AR_MARGIN * rates[1])):
            beside = (AR, *beside)          # the baseline, unless out of reach (for a while)
        log_t = math.log(min(self.calls, CALL_HORIZON) + 2)

        def index(W):                       # never measured: first (Cached AR, then the
            if W not in cost:               # one the rounds rate best)
                return math.inf, math.inf if W == AR else rates.get(W, 0.0), -W
            n = self.cost[W].count(self.calls)
            return (1 / cost[W]) * (1 + EXPLORE * math.sqrt(log_t / max(n, 1e-9))), 0.0, 0
        top = max(beside, key=index)
        once = top not in cost                   # an arm's first measurement: one call, not
        explore = top != best and (once or self.spent[0] <= CALL_BUDGET * self.spent[1])
        W = top if explore else best             # held to the exploring budget
        self.pending = (W, explore and not once)
        return W

    def observe(self, seconds: float, tokens: int) -> None:
        """The call `choose` chose took `seconds` to commit `tokens` (the rounds' rule's
        call: not counted)."""
        if self.pending is None or tokens <= 0:
            return
        W, explore = self.pending
        self.pending = None
        self.calls += 1
        mean = self.cost.setdefault(W, Mean(self.warm, CALL_DISCOUNT))
        counted = mean.add(seconds / tokens, self.calls, clip=CALL_CLIP) * tokens
        self.spent = [self.spent[0] * CALL_DISCOUNT + (counted if explore else 0.0),
                      self.spent[1] * CALL_DISCOUNT + counted]
