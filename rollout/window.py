"""HB-SJD's window policy (W = "auto"): each round's window W, and Full or Compact execution,
chosen from this machine's measured verifier costs and the acceptance seen so far.

Why per machine: a round of window W costs one verifier forward of W tokens per row, and what
that costs against a 1-token forward depends on the device and on how many rows run (a CPU is
compute-bound, so a (32, 4) forward costs several (32, 1) ones; a GPU at small batch is
memory-bound, so a (16, 16) forward costs about a (16, 1) one).  One fixed W cannot be right
everywhere (docs/WINDOW_POLICY.md).

The rule, before each verification round with A active rows out of R physical ones:

    choose (W, mode) maximising  E[tokens committed per active row | W] / cost(mode, rows, W)

over W in `WINDOWS` (clipped to N - 1) and the modes the execution option allows (hybrid: Full
and Compact).  rows = R for Full, A for Compact (compiled: A's bucket, rollout/hbsjd.py).

    cost       `CostTable`: seconds of one round = the verifier forward, measured by `opd
               calibrate` in the calibration file (rollout/calibrate.py; the same entries gamma
               is chosen from, one per W), interpolated linearly over rows and over width,
               plus the round's fixed part at that W (the verification step, the loop's Python,
               the round's sync: a measured Full round of the engine minus its forward,
               `overhead_s` per decoding), which W = 1 pays too per committed token; each
               made non-decreasing in W (`monotone`: a shared machine's load spikes).
    E[tokens]  the depth model's, times the window's factor (`Acceptance.expected`):
               model: 1 + sum_{j=1}^{W-1} prod_{k<=j} alpha_k, alpha_k the chance that draft
               k of a window is accepted given drafts 1..k-1 were, from this rollout's counts
               (rows that reached draft k, rows that accepted it), each shrunk towards
               alpha_{k-1} (alpha_0 = PRIOR) with weight STRENGTH rows, so the first rounds and
               depths never tried yet follow the shallower ones.
               factor c_W: realised over modelled accepted drafts per active row of this
               rollout's earlier rounds at W, kept apart for rounds whose drafts the round
               before proposed (W <= its window) and widened ones (W > its window: the new
               depths are history fill), the kind the coming round would be; shrunk towards 1
               with weight WINDOW_STRENGTH rounds; a window without such rounds takes the
               factor of the nearest narrower window that has them, else of the nearest wider
               one, at most 1.  E = 1 + c_W * (model - 1).

Per window, because what the depth model predicts from counts taken at other windows is
biased, in both directions: a wider window spends fewer rounds inside the runs that made the
deep counts (greedy, pretrained digits, batch 16: W 16 rounds committed 2.4 tokens a row where
the model said 4.9), coupled sampled drafts grow better with the rounds they are refined, and
the first round after a wider window checks drafts the round before did not propose (history
fill).  The factor measures what rounds at W commit against what the model said, in the same
rollout, and the kind keeps a window's first round from judging its steady ones.  The counts
stay pooled over the images: an estimate per image (each active row's own chain, averaged)
chose the same windows in most rollouts measured and cost more per round than it saved
(docs/WINDOW_POLICY.md).

W = 1 is Cached AR's round (no draft; rollout/jacobi.py `ar_round` runs it as Cached AR's step,
without the verification step): the policy picks a longer window only where the table says
its expected tokens pay for its round.

Not the images furthest behind either (which images lag is largely the luck of their
acceptance, so their counts underestimate every image's; docs/WINDOW_POLICY.md).

Exploration: a W = 1 round checks no draft, so its acceptance counts never grow and a choice
of W = 1 made on the prior would never be revisited; likewise a window of W never measures
depths >= W, which the estimate extrapolates from the shallower ones (acceptance often grows
with depth: conditionally on the earlier drafts).  So on verification rounds r with
r % PROBE in (0, 1), r > 1, the policy takes the next wider window than the rule's choice
(a probe of two rounds, in the better mode): at most two rounds in PROBE pay the difference,
and a probe that pays moves the rule itself one window wider.  Two, because
only drafts a previous round proposed are counted (`AcceptanceCounts` counts depth k of a
round only when the round before had k drafts or more): the drafts
of the first round after a narrower one are history fill or left-overs (sampled: proposal
one-hot at the token), accepted far less often than the round's steady drafts, and would
teach the estimate that speculation does not pay.

The choice is a pure function of the rollout state (active count, physical rows, acceptance
counts, N) and the table -- never of time measured during the rollout -- so a rollout is
reproducible and a Ray run equals the reference loop for the same piece jobs.  It depends on
the number of active rows of the call: the same images rolled out in a call of a different
size may take other windows, as may a machine with another calibration file (the tokens of
greedy and "sample" decoding do not change; "speculative" tokens are distributed exactly as the
target either way, but are not the same draws).
"""
from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass

import torch
from torch import Tensor

WINDOWS = (1, 2, 4, 8, 16)
"""The windows the policy chooses from (and `opd calibrate` measures)."""
PRIOR = 0.5                 # acceptance of draft 1 before any round
STRENGTH = 4.0              # pseudo-rows of the prior / of the shallower depth's estimate
WINDOW_STRENGTH = 2.0       # pseudo-rounds of factor 1 in a window's factor c_W
PROBE = 8                   # every PROBE rounds, 2 rounds at the next wider window


def _interp(xs: list, ys: list, x: float) -> float:
    """Piecewise-linear y(x) through sorted points xs, extrapolated along the end segments."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 1e-12)


def monotone(ys: list) -> list:
    """The non-decreasing sequence nearest ys in least squares (pool adjacent violators): a
    wider round never costs less, so a measurement a shared machine's load made cheap or dear
    is averaged with its neighbours instead of steering the choice."""
    blocks = []                                   # [sum, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    return [s / n for s, n in blocks for _ in range(n)]


@dataclass(frozen=True)
class CostTable:
    """Seconds of one round of `rows` rows (without the CFG copies) and width W.
    full: {W: seconds of a Full forward at the table's R rows}; compact: {W: (active counts,
    seconds)} (Compact forwards of that many rows); fixed: {W: seconds of the rest of a round
    at R rows (verification step, Python, sync)}, the same for Full and Compact (None: 0)."""
    rows: int
    full: dict
    compact: dict
    fixed: dict | None = None

    @classmethod
    def from_entries(cls, entries: dict, decoding: str = "greedy") -> CostTable:
        """{W: calibration entry of (model, R, W, cfg)} (rollout/calibrate.py) -> the table of
        a rollout with `decoding` (the entries' `overhead_s[decoding]`)."""
        rows = {int(e["batch"]) for e in entries.values()}
        if len(rows) != 1:
            raise ValueError(f"a cost table needs entries of one batch size, got {sorted(rows)}")
        Ws = sorted(entries, key=int)
        active = list(entries[Ws[0]]["active"])
        if any(list(entries[W]["active"]) != active for W in Ws):
            raise ValueError("a cost table needs entries measured at the same active counts")
        # each made non-decreasing in W (`monotone`): Full, Compact at each active count, fixed
        full = monotone([statistics.median(entries[W]["full_s"]) for W in Ws])
        compact = list(zip(*[monotone([entries[W]["compact_s"][i] for W in Ws])
                             for i in range(len(active))]))
        fixed = monotone([float(entries[W]["overhead_s"][decoding]) for W in Ws])
        return cls(rows.pop(), {int(W): f for W, f in zip(Ws, full)},
                   {int(W): (active, list(c)) for W, c in zip(Ws, compact)},
                   {int(W): f for W, f in zip(Ws, fixed)})

    def cost(self, compact: bool, rows: int, width: int) -> float:
        """Seconds of a round over `rows` rows (Compact; Full: the table's R) of `width`
        tokens each: the forward, interpolated over rows, then over the measured windows,
        plus the round's fixed part, interpolated over the windows."""
        Ws = sorted(self.full)
        if compact:
            ys = [_interp(*self.compact[W], rows) for W in Ws]
        else:
            ys = [self.full[W] for W in Ws]
        fixed = _interp(Ws, [self.fixed[W] for W in Ws], width) if self.fixed else 0.0
        return _interp(Ws, ys, width) + fixed


class Acceptance:
    """What the policy knows of a rollout so far, on the host (module docstring, E[tokens]).

    reached[k - 1] / accepted[k - 1]: rows whose draft k was checked / accepted (k =
    1..depth); window_tallies: {(W, proposed): (rounds, sum of realised, sum of modelled
    accepted drafts per active row)} (`windows`); previous: the last round's window (0: none
    yet); rounds: the verification rounds so far."""

    def __init__(self, depth: int, rounds: int = 0, previous: int = 0):
        self.reached = [0] * depth
        self.accepted = [0] * depth
        self.window_tallies: dict[tuple[int, bool], tuple[int, float, float]] = {}
        self.previous = previous
        self.rounds = rounds

    def add(self, reached: list[int], accepted: list[int]) -> None:
        self.reached = [a + b for a, b in zip(self.reached, reached)]
        self.accepted = [a + b for a, b in zip(self.accepted, accepted)]

    def windows(self, tallies: dict[tuple[int, bool], tuple[int, float, float]]) -> None:
        """{(W, proposed): (rounds at W after a round of window >= W (proposed) or < W, sum
        of their realised accepted drafts per active row, sum of what `model_expected`
        predicted for them)}."""
        self.window_tallies = tallies

    def rates(self) -> list[float]:
        """The pooled alpha_k for k = 1..depth (module docstring)."""
        out, prev = [], PRIOR
        for n, a in zip(self.reached, self.accepted):
            prev = (a + STRENGTH * prev) / (n + STRENGTH)
            out.append(prev)
        return out

    def model_expected(self) -> list[float]:
        """The depth model's E[tokens committed per active row | W] for W = 1..depth + 1:
        1 + sum_{j<W} prod_{k<=j} alpha_k."""
        out, run = [1.0], 1.0
        for alpha in self.rates():
            run *= alpha
            out.append(out[-1] + run)
        return out

    def window_factors(self) -> list[float]:
        """c_W for W = 1..depth + 1 in a round after one of window `previous`: realised over
        modelled accepted drafts of the earlier rounds at W of the same kind (proposed: W <=
        previous, every draft proposed by the round before; widened: W > previous), shrunk
        towards 1 with weight WINDOW_STRENGTH rounds.  A window without such rounds takes the
        factor of the nearest narrower window that has them, else of the nearest wider one,
        at most 1 (1 if none)."""
        Ws = range(1, len(self.reached) + 2)
        own = {}
        for W in Ws:
            n, realised, modelled = self.window_tallies.get((W, W <= self.previous),
                                                            (0, 0.0, 0.0))
            if n:
                ratio = realised / modelled if modelled > 0 else 1.0
                own[W] = (n * ratio + WINDOW_STRENGTH) / (n + WINDOW_STRENGTH)
        out = []
        for W in Ws:
            if W in own:
                out.append(own[W])
                continue
            near = [v for v in own if v < W][-1:] or [v for v in own if v > W][:1]
            out.append(min(own[near[0]], 1.0) if near else 1.0)
        return out

    def expected(self) -> list[float]:
        """E[tokens committed per active row | W] for W = 1..depth + 1: 1 + c_W (model - 1),
        the depth model's accepted drafts times the window's factor, and one."""
        return [1.0 + c * (e - 1.0)
                for c, e in zip(self.window_factors(), self.model_expected())]

    def expected_tokens(self, W: int) -> float:
        """E[tokens committed per active row in a round of window W]."""
        expected = self.expected()
        return expected[min(W, len(expected)) - 1]


@dataclass(frozen=True)
class WindowPolicy:
    """Chooses each round's (W, compact) (module docstring).  windows: the candidates (already
    clipped to the call's N - 1); modes: of ("full", "compact"); extra: columns each window
    carries besides W (candidate drafting's branches); bucket: rows -> the rows a compiled
    Compact round runs (None: exactly the active rows)."""
    table: CostTable
    windows: tuple
    modes: tuple = ("full", "compact")
    extra: int = 0
    bucket: object = None

    def __post_init__(self):
        object.__setattr__(self, "_costs", {})    # (compact, rows, width) -> table seconds

    @property
    def largest(self) -> int:
        return max(self.windows)

    def _cost(self, compact: bool, rows: int, width: int) -> float:
        """`table.cost`, remembered: a rollout asks the same few points every round (the
        interpolation in Python cost ~0.3 ms a round on this CPU)."""
        key = (compact, rows, width)
        if key not in self._costs:
            self._costs[key] = self.table.cost(compact, rows, width)
        return self._costs[key]

    def choose(self, active: int, acceptance: Acceptance) -> tuple[int, bool]:
        """-> (W, compact) for the next verification round (r = acceptance.rounds + 1) with
        `active` rows; ties go to the smaller W, then to Full.  A W = 1 choice on a round
        with r % PROBE in (0, 1), r > 1, becomes the next wider window (a probe, module
        docstring)."""
        expected = acceptance.expected()                        # E[tokens] for W = 1, 2, ...
        W, compact = self._best(active, expected, self.windows)
        wider = tuple(w for w in sorted(self.windows) if w > W)[:1]
        r = acceptance.rounds + 1
        if wider and r > 1 and r % PROBE in (0, 1):
            return self._best(active, expected, wider)
        return W, compact

    def _best(self, active: int, expected: list[float], windows) -> tuple[int, bool]:
        best, choice = -1.0, (min(windows), self.modes[0] == "compact")
        for W in sorted(windows):
            tokens = expected[min(W, len(expected)) - 1]
            for mode in self.modes:
                compact = mode == "compact"
                rows = (self.bucket(active) if self.bucket else active) if compact else None
                rate = tokens / self._cost(compact, rows or self.table.rows,
                                           W + (self.extra if W > 1 else 0))
                if rate > best * (1 + 1e-9):
                    best, choice = rate, (W, compact)
        return choice


class AcceptanceCounts:
    """A rollout's acceptance counts (rollout/window.py `Acceptance`), kept on the host: per
    depth, and per (window, proposed) the realised and modelled accepted drafts per active
    row of its rounds.  A round's counts stay on the device until the next `read`, whose one
    sync brings them with the active count."""

    def __init__(self, depth: int, device: torch.device):
        self.counts = [[0] * depth, [0] * depth]                            # reached, took
        self.tallies: dict[tuple[int, bool], tuple[int, float, float]] = {}
        self.pending = []                 # [(counts (3, k) on the device, W, proposed, model,
        #                                    kind)] of the rounds since the last `read`
        self.previous = 0
        self.rounds = 0

    def add(self, counts: Tensor, W: int, acceptance: Acceptance | None = None) -> None:
        """A round of window W.  counts: its (3, k) committed / accepted / rejected of the
        rows it ran (0 for a finished row).  Depth k counts only when the round before
        proposed k drafts or more (k < min(previous W, W); rollout/window.py, Exploration).
        With `acceptance` (what the round was chosen with) and W >= 2, the round's mean
        accepted drafts per active row and the depth model's prediction for it go to the
        tally of (W, proposed: W <= the previous window)."""
        previous, self.previous = self.previous, W
        self.rounds += 1
        model = None
        if W >= 2 and acceptance is not None:
            expected = acceptance.model_expected()
            model = expected[min(W, len(expected)) - 1] - 1.0
        proposed = min(previous, W) - 1
        if proposed > 0 or model is not None:
            self.pending.append((counts, W, proposed, model, W <= previous))

    def _tally(self, counts: list, W: int, proposed: int, model, kind: bool) -> None:
        """A pending round's counts, on the host: [committed, accepted, rejected] lists of its
        rows (plain Python: a few dozen ints cost less so than in numpy or torch operators,
        which a round pays on a CPU)."""
        committed, accepted, rejected = counts
        if proposed > 0:
            last = [0] * (proposed + 1)          # rows whose last counted draft was depth j
            stop = [0] * proposed                # rows that checked draft j + 1 and rejected it
            for a, r in zip(accepted, rejected):
                if a >= proposed:
                    last[proposed] += 1
                else:
                    last[a] += 1
                    stop[a] += r > 0
            took = 0
            for k in range(proposed, 0, -1):     # took draft k: rows with a >= k
                took += last[k]
                self.counts[0][k - 1] += took + stop[k - 1]
                self.counts[1][k - 1] += took
        if model is not None:
            n, realised, modelled = self.tallies.get((W, kind), (0, 0.0, 0.0))
            rows = max(sum(c > 0 for c in committed), 1)
            self.tallies[W, kind] = (n + 1, realised + sum(accepted) / rows, modelled + model)

    def read(self, live: Tensor) -> tuple[int, Acceptance]:
        """live: (R,) bool the active rows -> (the active count, the counts so far as an
        `Acceptance`), one device sync."""
        host = torch.cat([live.sum().view(1), *(p[0].reshape(-1) for p in self.pending)])
        host = host.tolist()
        start = 1
        for counts, *round_ in self.pending:
            k = counts.shape[1]
            self._tally([host[start + i * k: start + (i + 1) * k] for i in range(3)], *round_)
            start += 3 * k
        self.pending = []
        acceptance = Acceptance(len(self.counts[0]), self.rounds, self.previous)
        acceptance.add(*self.counts)
        acceptance.windows(dict(self.tallies))
        return int(host[0]), acceptance
