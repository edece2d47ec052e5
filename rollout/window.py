"""HB-SJD's window policy (W = "auto"): each round's window W, and Full or Compact execution,
chosen from what rounds cost and commit in this process, measured as the rollouts run.

A round of window W is one verifier forward of W tokens per row.  What it costs against a
1-token forward depends on the device, the rows it runs, the threads and the machine's load; what
it commits depends on the student, which changes as it trains.  A table measured once predicts
neither well enough to choose between windows whose rates differ by a few per cent
(docs/WINDOW_POLICY.md), so the policy measures both, round by round, and chooses by a bandit
rule:

    arm      (W, compact): W in `WINDOWS` (clipped to the call's N - 1), compact among the modes
             the execution option allows.  Hybrid: every window, Full, while every row is
             active; once rows finish, Full and Compact at the window Full rates best and the
             windows beside it (each rows band then has a few Compact arms to learn, not one
             per window).
    rate     tokens committed per second of an arm with A active rows, L the tokens left per
             active row (their mean):
                 A * L / (max(1, L / tokens(W) + 1/2) * seconds(W, compact, rows))
             the seconds of the rounds that commit what is left (a row commits at most what
             it has left, so its last round is part-empty, half on average: near a call's
             end that weighs against wide windows; far from it, the rate is about
             A * tokens(W) / seconds).
             tokens(W): tokens committed per row by a round of window W, counted over the rows
             that had a whole window left (a row nearer its end commits at most what it has
             left whatever W is, which would price wide windows by a call's last rounds), in
             rounds whose drafts were steady: not a call's first SETTLE rounds (drafts still
             filling), not a round wider than the one before (its new columns were never
             drafted: history fill); weighted by those rows.  seconds: seconds of a round
             on the policy's clock (`policy_clock`: CPU seconds in a one-thread CPU process,
             else wall; its forward, its verification, the loop's Python, up to the next
             device sync), by rows band: Full runs the call's R rows (one band), Compact
             the active rows (compiled: their bucket), banded by powers of two.  A Full
             arm's seconds, measured while every row was active, serve every active count.
             Both are discounted means: an observation weighs DISCOUNT ** (rounds since), so
             the estimates follow the student as it trains and the machine as its load changes.
    choice   UCB over the best arm and its neighbours (`near`: the rate is unimodal in W): the
             arm maximising  rate * (1 + EXPLORE * sqrt(ln(t) / n)),  n the arm's discounted
             observations (the fewer of its tokens' and its seconds'), t the rounds so far.  An
             arm never measured is tried first (narrowest W first).  Choosing an arm other than
             the best estimate (exploring) is allowed after a call's first SETTLE rounds (whose
             tokens would not count) while the seconds spent exploring are at most BUDGET of
             all rounds' seconds (discounted; a round after a narrower exploring one counts as
             exploring too, its drafts being the exploration's), so what exploration costs is
             bounded.  A Compact arm new to a rows band starts from Full's seconds at its W, a
             prior of weight PRIOR: it rates as Full, ranks above it, and is tried.
    warm-up  an arm is run for two rounds when it is new or wider than the round before: the
             first round of a shape may compile or allocate (its seconds are not counted, in
             its mean or in the budget), and the first round of a wider window checks drafts
             the round before never proposed (its tokens are not counted).

A fixed W runs no policy (its Full / Compact switch is gamma's, rollout/hbsjd.py).  The policy
lives in the engine, one per (model, physical rows, call length N, CFG, decoding), and
learns across calls: its first call runs the rules above over every window; each later call
runs the one window that whole calls price best (`CallWindows`, rollout/window_calls.py),
the rules above then choosing only Full or Compact.  Its bookkeeping is a few floats a round
on the host; a round's committed count, its rows with a whole window left (only while a call
chooses among windows) and the tokens left ride the device sync the round loop already makes
(rollout/hbsjd.py `run_jacobi`), so it adds no synchronisation on a GPU.

The windows change time only: with greedy or "sample" decoding every window commits the same
tokens (docs/ROLLOUTS.md, one seed one sample), so a measured choice keeps a run reproducible and
a Ray run equal to the reference loop.  "speculative" tokens depend on the windows run, so with
W "auto" they depend on this machine's timing too: distributed exactly as the model's samples,
not the same draws from run to run (and W 1 is left out: `HBSJD.policy`, rollout/hbsjd.py).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

from rollout.window_calls import AR, CLIP, EXPLORE, CallWindows, Mean

WINDOWS = (1, 2, 4, 8, 16)
"""The windows the policy chooses from."""
DISCOUNT = 0.98         # per round: an observation's weight halves in about 34 rounds
HORIZON = 1 / (1 - DISCOUNT)    # the discounted rounds an arm played every round reaches
PRIOR = 0.5             # the weight, in rounds, of a Compact arm's prior (Full's seconds)
BUDGET = 0.02           # most of the seconds (discounted) spent exploring measured arms: in a
#                         call of one window only Full against Compact, where 5 % cost about 0.7 %
#                         of a call at batch 8-32 (docs/WINDOW_POLICY.md)
SETTLE = 2              # a call's first rounds, whose drafts are still filling: tokens not counted


def policy_clock(device_type: str, threads: int) -> Callable[[], float]:
    """The clock the policy prices arms by.  On a CPU computing on one thread (a Ray rollout
    worker), that thread's CPU seconds: what the rollout pays.  The time it waits while other
    processes hold the cores (the teacher and the learner share them in the default run) falls
    alike on whichever arm runs, and it decided more than the arms did: beside a process
    running matmuls in bursts, a call's wall seconds spread by 27-31 % (coefficient of
    variation, Cached AR and W 8, batch 32), its CPU seconds by 10 % (docs/WINDOW_POLICY.md).
    Elsewhere wall seconds: on a GPU the host waits for the device at the round's sync, and
    with several threads a thread's CPU seconds are not the process's."""
    return time.thread_time if device_type == "cpu" and threads == 1 else time.perf_counter


def near(rated: list, best: tuple, windows: tuple) -> list:
    """The arms of `rated` ((rate, index, (W, compact))) that the rule may explore next to the
    best arm: its own W and the windows beside it (a round's rate is unimodal in W: its tokens
    grow ever more slowly with W, its seconds ever faster), so exploration probes the next window
    up and down instead of windows far from the best (OSUB, Combes and Proutiere, ICML 2014)."""
    i = windows.index(best[0])
    return [x for x in rated if abs(windows.index(x[2][0]) - i) <= 1]


class WindowPolicy:
    """Chooses each round's (W, compact) from measured rates (module docstring).

    modes: of ("full", "compact"), what the execution option allows; rows: the call's physical
    rows R; bucket: active rows -> the rows a compiled Compact round runs (None: the active
    rows); clock: the seconds its rounds and calls are measured in (`policy_clock`).  Per
    call: `start(windows)`, then per round `choose(active, left)` and, after the round's sync,
    `observe(tokens, seconds)`."""

    def __init__(self, modes: tuple = ("full", "compact"), rows: int = 1, bucket=None,
                 clock: Callable[[], float] = time.perf_counter):
        self.modes, self.rows, self.bucket = modes, rows, bucket
        self.now = clock                                    # seconds (`policy_clock`)
        self.tokens: dict[int, Mean] = {}                   # W -> tokens per active row
        self.seconds: dict[tuple[int, bool, int], Mean] = {}  # (W, compact, band) -> seconds
        self.spent = [0.0, 0.0]              # discounted seconds: exploring rounds, all rounds
        self.clock = 0                                      # rounds observed
        self.windows: tuple = (1,)
        self.whole = [(1, modes == ("compact",))]
        self.fixed = None                                   # the one arm of a call (`start`)
        self.previous = 0                                   # this call's last W (0: none)
        self.round = 0                                      # this call's rounds so far
        self.pending = None                                 # the chosen round, until observed
        self.hold = None                                    # (arm, explore) to repeat once
        self.explored = False                               # the last round explored
        self.calls = CallWindows(warm=bucket is None)       # the window of each call
        self.call_seconds = self.call_raw = 0.0             # this call's rounds: as counted,
        #                                                     as measured

    @property
    def largest(self) -> int:
        return max(self.windows)

    @property
    def counting(self) -> bool:
        """Whether this call's rounds' tokens are counted: only while it chooses among
        windows.  A call of one window chooses Full or Compact, which commit alike, by seconds
        alone, so it leaves the device sums out of its rounds' sync."""
        return len(self.windows) > 1

    @property
    def cached_ar(self) -> bool:
        """This call runs as Cached AR (the `AR` arm), not in rounds of this policy's."""
        return self.windows == (AR,)

    def start(self, windows: tuple, baseline: bool = False) -> None:
        """A new call that may use `windows` (sorted, already clipped to N - 1), and with
        `baseline` run as Cached AR: its rounds run the window `CallWindows` chooses for it
        (rollout/window_calls.py; `cached_ar`: none), or, while no call has been measured,
        choose among all of them (the rounds' rule)."""
        windows = tuple(windows)
        compact = self.modes == ("compact",)
        rates = {W: e[0] for W in windows
                 if (e := self.estimate(W, compact, self.rows)) is not None}
        W = self.calls.choose((AR, *windows) if baseline else windows, rates)
        self.windows = windows if W is None else (W,)
        self.whole = [(W, compact) for W in self.windows]   # the arms while every row runs
        # one window: while every row runs (Full only: always) a round has nothing to choose,
        # so its choice is made once here, the round's pending observation with it
        W = self.windows[0]
        self.fixed = (None if len(self.windows) > 1 else
                      (W, (W, compact, self._band(compact, self.rows)), self.rows, False, False))
        self.previous, self.round, self.call_seconds, self.call_raw = 0, 0, 0.0, 0.0
        self.pending = self.hold = None
        self.explored = False

    def finish(self, tokens: int, seconds: float) -> None:
        """The call ended, its images' `tokens` committed in `seconds` (the engine's, not its
        consumer's): they price the call's window (`CallWindows.observe`), with its rounds'
        seconds each clipped as its arm's mean clips it (a burst of another process moves a
        call's sum as much as the choice between windows does).  What is not a round (the
        prefill, the call's setup) counts as it was, as in a Cached AR call (the `AR` arm)."""
        self.calls.observe(seconds - self.call_raw + self.call_seconds, tokens)

    def _band(self, compact: bool, active: int) -> int:
        if not compact:
            return 0
        return (self.bucket(active) if self.bucket else active).bit_length()

    def _arms(self, active: int, left: float) -> list[tuple[int, bool]]:
        """Full only: every window.  Compact only: every window, per band.  Both (hybrid):
        every window while all rows are active; once rows finish, Full and Compact at the
        window Full rounds rate best and those beside it (`near`; the ranking of Full arms
        does not depend on the active count), so a rows band has a few Compact arms to learn,
        not one per window."""
        if active == self.rows or len(self.modes) == 1:
            return self.whole
        rated = [(e[0], 0.0, (W, False)) for W in self.windows
                 if (e := self.estimate(W, False, active, left)) is not None]
        Ws = ([x[2][0] for x in near(rated, max(rated)[2], self.windows)]
              if len(rated) == len(self.windows) else self.windows)
        return [(W, c) for W in Ws for c in (False, True)]

    def estimate(self, W: int, compact: bool, active: int,
                 left: float = math.inf) -> tuple[float, float] | None:
        """(estimated tokens per second of arm (W, compact) at `active` rows with `left` tokens
        left per row: those tokens over the seconds of the whole rounds that commit them (a
        row commits at most what it has left, so near a call's end a wide window's last round
        is part-empty), its discounted observations), None while unmeasured.  A Compact arm not yet measured in this rows band
        takes Full's seconds at W as a prior of weight PRIOR (a round of fewer rows costs at
        most about what one of all rows does): it rates as Full does, its index higher, so it
        is the band's best and tried, and its first measurement decides."""
        tok = self.tokens.get(W)
        if tok is None or not tok.weight:
            return None
        sec = self.seconds.get((W, compact, self._band(compact, active)))
        if sec is not None and sec.weight:
            seconds, n = sec.mean, sec.count(self.clock)
            if self.counting:
                n = min(n, tok.count(self.clock))
        else:
            full = self.seconds.get((W, False, 0)) if compact and "full" in self.modes else None
            if full is None or not full.weight:
                return None
            seconds, n = full.mean, PRIOR
        if left == math.inf:
            return active * tok.mean / seconds, n
        rounds = max(1.0, left / tok.mean + 0.5)     # to commit what is left, the last
        return active * left / (rounds * seconds), n   # part-empty: half a round on average

    def choose(self, active: int, left: float) -> tuple[int, bool]:
        """-> (W, compact) for the next round with `active` rows, `left` tokens left to commit
        per active row (module docstring, choice)."""
        self.round += 1
        if self.fixed is not None and (active == self.rows or self.modes == ("full",)):
            self.pending, self.previous, self.hold = self.fixed, self.fixed[0], None
            return self.whole[0]
        arms = self._arms(active, left)
        explore = False                                     # exploring a measured arm
        if self.hold is not None and self.hold[0] in arms:
            arm, explore = self.hold
        elif len(arms) == 1:                                # nothing to choose
            arm = arms[0]
        else:
            rated, top = [], None
            log_t = math.log(min(self.clock, HORIZON) + 2)
            for W, c in arms:
                e = self.estimate(W, c, active, left)
                if e is None:                       # never measured: try it first
                    top = (W, c)
                    break
                r, n = e
                rated.append((r, r * (1.0 + EXPLORE * math.sqrt(log_t / max(n, 1e-9))), (W, c)))
            best = None
            if top is None:
                best = max(rated)[2]
                top = max(near(rated, best, self.windows), key=lambda x: x[1])[2]
            arm = top
            if best is not None and top != best:     # explore: not while drafts fill
                if self.round > SETTLE and self.spent[0] <= BUDGET * self.spent[1]:
                    explore = True
                else:
                    arm = best
        W, compact = arm
        if W > self.previous and self.explored:  # a round after a narrower exploring one:
            explore = True                       # its drafts are the exploration's too
        self.explored = explore
        key = (W, compact, self._band(compact, active))
        fresh = key not in self.seconds or not self.seconds[key].weight
        held = self.hold is not None and self.hold[0] == arm
        self.hold = (arm, explore) if (W > self.previous or fresh) and not held else None
        self.pending = (W, key, active, 0 < W <= self.previous and self.round > SETTLE, explore)
        self.previous = W
        return W, compact

    def observe(self, tokens: int, rows: int, seconds: float) -> None:
        """The last chosen round took `seconds`; its `rows` active rows that had a whole window
        of tokens left committed `tokens` (a row nearer its end commits at most what it has
        left, whatever the window: it would price wide windows by a call's last rounds).  The
        tokens count where the drafts were steady: not in a call's first SETTLE rounds, nor in
        a round wider than the one before (module docstring, warm-up)."""
        if self.pending is None:
            return
        W, key, active, steady, explore = self.pending
        self.pending = None
        self.clock += 1
        if steady and rows:
            tok = self.tokens.get(W)
            if tok is None:
                tok = self.tokens[W] = Mean(warm=True, discount=DISCOUNT)
            tok.add(tokens / rows, self.clock, weight=rows / self.rows)
        raw, mean = seconds, self.seconds.get(key)
        if mean is None:
            mean = self.seconds[key] = Mean(discount=DISCOUNT)
        seconds = mean.add(seconds, self.clock, clip=CLIP)
        self.call_seconds += seconds or raw                 # a warm-up: as it was
        self.call_raw += raw
        self.spent = [self.spent[0] * DISCOUNT + (seconds if explore else 0.0),  # as counted
                      self.spent[1] * DISCOUNT + seconds]
