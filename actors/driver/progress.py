"""What a step (actors/driver/step.py) knows of its place in its life, of each of its pieces and
of the learner group's work on it: records that only `Step` changes."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum

from actors.transport.delivery import PieceReport
from opd.distill.results import LearnerResult, PieceAnswer


class StepPhase(IntEnum):
    """A step's place in its life, in order (docs/ARCHITECTURE.md, "A step's life on Ray").
    STREAMING: the learner group trains it piece by piece while its pieces are still made (a
    `streamable` step); TRAINING: it trains and is sealed."""
    PLANNED = 0
    GENERATING = 1       # its pieces are made and scored (a step on data: scored only)
    STREAMING = 2
    SEALED = 3           # every piece delivered, the queue holds them as one item
    TRAINING = 4
    DONE = 5             # its last piece trained, every call's report in (`Trained`)


# phase -> the phases it may go to.  Back to GENERATING is a re-plan (`Step.replanned`: from
# scratch, a new generation); a step that streams is never re-planned (it can be made again).
NEXT = {
    StepPhase.PLANNED: {StepPhase.GENERATING, StepPhase.SEALED},   # a reused rollout: sealed
    StepPhase.GENERATING: {StepPhase.GENERATING, StepPhase.STREAMING, StepPhase.SEALED},
    StepPhase.STREAMING: {StepPhase.TRAINING},
    StepPhase.SEALED: {StepPhase.GENERATING, StepPhase.TRAINING},
    StepPhase.TRAINING: {StepPhase.GENERATING, StepPhase.DONE},
    StepPhase.DONE: set(),
}


class IllegalTransition(RuntimeError):
    """A step was asked to go to a phase its own cannot lead to (a bug in the driver)."""


def check_transition(step: int, now: StepPhase, to: StepPhase) -> StepPhase:
    """`to`, if step `step` may go there from `now` (`NEXT`); else raises."""
    if to not in NEXT[now]:
        raise IllegalTransition(f"step {step} cannot go from {now.name} to {to.name}")
    return to


@dataclass
class PieceState:
    """What is known of one piece: the teachers that score it (`scorers`), its latest payload
    from its rollout call (`made`, by issue `issue` of its part), per teacher the issue whose
    payload it is scoring and its share's delivery, and the piece's delivery (every share)."""
    scorers: tuple[int, ...] = (0,)
    made: PieceReport | None = None
    issue: int = -1
    scoring: dict[int, int] = field(default_factory=dict)          # teacher -> issue
    scored: dict[int, PieceReport] = field(default_factory=dict)   # teacher -> its share's
    delivered: PieceReport | None = None

    def merged(self, piece: int, rows: int, tokens: int) -> PieceReport:
        """The piece's delivery from its shares' reports: its `rows` of `tokens` suffix tokens
        (from the layout: `made` may be gone, its part issued again), the shares' bytes and
        seconds summed."""
        shares = self.scored.values()
        return PieceReport(piece, rows, rows * tokens, sum(r.nbytes for r in shares),
                           sum(r.seconds for r in shares))


@dataclass
class Training:
    """The learner group's work on the step (docs/STREAMING.md): how many pieces were handed
    out (in piece order), each piece's hand-outs, each rank's answers as they arrive, and
    whether the ranks fetch every piece at once (`prefetch`: a step that could not be made
    again at its version trains only once it is sealed)."""
    gen: int
    prefetch: bool
    submitted: int = 0
    handed: dict[int, int] = field(default_factory=dict)                       # piece -> times
    answers: dict[int, dict[int, PieceAnswer]] = field(default_factory=dict)   # piece -> rank ->
    start: float = field(default_factory=time.perf_counter)
    results: list[LearnerResult] | None = None     # the last piece's, held for a call's report
