"""The driver's typed records: the kinds of task it has in flight, one task, and one step's plan.

A `StepPlan` is one prefix batch cut into pieces, generated in parts (rollout calls, each a run
of pieces: opd/distill/pieces.py).  Each part
is generated (a rollout worker, or a teacher worker for SeqKD's teacher rollouts, or the data
itself), scored when the objective needs teacher scores, and delivered by the worker into the
trajectory queue, cut into one piece per learner rank (actors/transport/delivery.py).  The
driver only sees each part's `PartReport` (a few numbers, defined there).  `gen` numbers the
plan's generations: a plan re-planned at a newer policy version gets a new one, and answers of
an older generation are dropped (by the driver and by the queue).  `StageTimer` times a step's
stages.
"""
from __future__ import annotations

import enum
import time
from collections import Counter
from dataclasses import dataclass, field

from actors.transport.delivery import PartReport
from opd.distill.results import LearnerResult, PieceAnswer
from opd.distill.steps import RolloutJob


class TaskKind(enum.Enum):
    ROLLOUT = "rollout"                  # a student rollout part (rollout worker)
    TEACHER_ROLLOUT = "teacher-rollout"  # a teacher rollout part (SeqKD; teacher worker)
    SCORE = "score"                      # teacher scores of a generated part (teacher worker)
    LOAD = "load"                        # a rollout worker loads the published weights
    PROBE = "probe"                      # is a failed worker back?
    TRAIN = "train"                      # one learner rank's piece of a step
    PLACE = "place"                      # an elastic rollout worker's placement group is ready

    @property
    def makes_part(self) -> bool:
        """Its answer is a step part's report (rollout, teacher rollout, scoring)."""
        return self in (TaskKind.ROLLOUT, TaskKind.TEACHER_ROLLOUT, TaskKind.SCORE)


ROLE_OF = {TaskKind.ROLLOUT: "rollout", TaskKind.TEACHER_ROLLOUT: "teacher",
           TaskKind.SCORE: "teacher"}


@dataclass
class Task:
    kind: TaskKind
    role: str = ""   # the pool of the worker (rollout | teacher | learner)
    step: int = -1
    part: int = -1
    worker: int = -1
    version: int = -1   # the plan's policy version when it was submitted (parts)
    gen: int = -1       # the plan's generation when it was submitted (parts)
    submitted: float = field(default_factory=time.perf_counter)


@dataclass
class Training:
    """The learner step in flight (docs/STREAMING.md): its step and plan generation, how many
    of its pieces were handed to the learner ranks (in piece order), each rank's answers to
    each piece as they arrive, each rank's result of the step's last piece, when it began, and
    whether the ranks fetch every piece at once (`prefetch`: a plan whose parts could not be
    made again at its version, so it trains only once complete)."""
    step: int
    gen: int = 0
    submitted: int = 0
    handed: dict[int, int] = field(default_factory=dict)   # piece -> times handed to the ranks
    answers: dict[int, dict[int, PieceAnswer]] = field(default_factory=dict)   # piece -> rank ->
    results: dict[int, LearnerResult] = field(default_factory=dict)            # answer
    start: float = field(default_factory=time.perf_counter)
    prefetch: bool = False


@dataclass
class StageTimer:
    """When each stage of a step began and ended (`time.perf_counter()` seconds) and the seconds
    each role's workers were busy on it.  Stages: "rollout" (from the plan to its last part
    generated) and "teacher" (from its first scoring submitted to its last part delivered)."""
    began: dict[str, float] = field(default_factory=dict)
    ended: dict[str, float] = field(default_factory=dict)
    busy: Counter[str] = field(default_factory=Counter)

    def begin(self, stage: str, now: float) -> None:
        """The stage begins at `now`, unless it began before (a re-issued part)."""
        self.began.setdefault(stage, now)

    def end(self, stage: str, now: float) -> None:
        self.ended[stage] = now

    def seconds(self, stage: str) -> float:
        """How long the stage ran; 0 if it has not begun and ended."""
        if stage not in self.began or stage not in self.ended:
            return 0.0
        return max(0.0, self.ended[stage] - self.began[stage])


def rollout_started() -> StageTimer:
    timer = StageTimer()
    timer.begin("rollout", time.perf_counter())
    return timer


@dataclass
class StepPlan:
    """One step's prefix batch, cut into parts, and what is known of each part."""
    step: int
    batch_id: int
    source: str
    version: int                       # policy version of its trajectories
    jobs: list[RolloutJob]                 # its rollout calls ("parts"), one job each
    gen: int = 0
    pieces_of: list[list[int]] = field(default_factory=list)  # part -> its pieces, in order
    ranges: list[tuple[int, int]] = field(default_factory=list)  # piece -> its rows in its part
    cuts: list[tuple[tuple[int, int], ...]] = field(default_factory=list)  # piece -> ranks' rows
    generated: dict[int, PartReport] = field(default_factory=dict)  # part -> report (to score)
    delivered: dict[int, PartReport] = field(default_factory=dict)  # piece -> report, in the queue
    scoring: set[int] = field(default_factory=set)                   # pieces being scored
    times: StageTimer = field(default_factory=rollout_started)   # rollout and teacher stages
    sealed: bool = False               # the queue holds it as one item
    scored: bool = True                # its objective needs teacher scores (else no scoring)
    phase: str = ""                    # the name of its distill.phases entry

    @property
    def parts(self) -> int:
        return len(self.jobs)

    @property
    def pieces(self) -> int:
        return len(self.cuts)

    def part_of(self, piece: int) -> int:
        return next(c for c, ps in enumerate(self.pieces_of) if piece in ps)

    @property
    def samples(self) -> int:
        return sum(int(j.labels.shape[0]) for j in self.jobs)

    @property
    def complete(self) -> bool:
        return len(self.delivered) == self.pieces

    def reset(self, version: int, gen: int) -> None:
        """Re-plan at `version` as generation `gen`: every part goes again."""
        self.generated.clear()
        self.delivered.clear()
        self.scoring.clear()
        self.version, self.gen, self.sealed = version, gen, False
