"""The driver's typed records of work in flight: the kinds of task, one task, and a step's
stage timer.  A step itself, with everything known of it, is a `Step` (actors/driver/step.py).
"""
from __future__ import annotations

import enum
import time
from collections import Counter
from dataclasses import dataclass, field


class TaskKind(enum.Enum):
    ROLLOUT = "rollout"                  # a student rollout call, streaming its pieces (rollout worker)
    TEACHER_ROLLOUT = "teacher-rollout"  # a teacher rollout call (SeqKD; teacher worker)
    SCORE = "score"                      # teacher scores of one piece (teacher worker)
    SCORE_SPAN = "score-span"            # teacher scores of a span of a running call (rollout.span)
    LOAD = "load"                        # a rollout worker loads the published weights
    PROBE = "probe"                      # is a failed worker back?
    TRAIN = "train"                      # one learner rank's piece of a step
    PLACE = "place"                      # an elastic rollout worker's placement group is ready

    @property
    def generates(self) -> bool:
        """A rollout call: a stream of piece reports, then the call's report."""
        return self in (TaskKind.ROLLOUT, TaskKind.TEACHER_ROLLOUT)


ROLE_OF = {TaskKind.ROLLOUT: "rollout"}
"""The pool of a task kind; a teacher's tasks name their teacher's pool, `teacher/<name>`."""


@dataclass
class Task:
    """One task in flight.  A rollout call names its `part` (and the part's `issue`); a scoring
    or a learner rank's training names its `piece` (a scoring also the issue of the part that
    made the piece's payload; a training its hand-out in `issue`)."""
    kind: TaskKind
    role: str = ""   # the pool of the worker (rollout | teacher/<name> | learner)
    step: int = -1
    part: int | None = None
    piece: int | None = None
    worker: int = -1
    issue: int = -1
    gen: int = -1       # the step's plan generation when it was submitted
    teacher: int = 0    # a scoring: the teacher whose share it scores (its pool: `role`)
    span: int = -1      # a span's scoring: the span of its call (`part`)
    submitted: float = field(default_factory=time.perf_counter)


@dataclass
class StageTimer:
    """When each stage of a step began and ended (`time.perf_counter()` seconds) and the seconds
    each role's workers were busy on it.  Stages: "rollout" (from the plan to its last call's
    end) and "teacher" (from its first scoring submitted to its last piece delivered)."""
    began: dict[str, float] = field(default_factory=dict)
    ended: dict[str, float] = field(default_factory=dict)
    busy: Counter[str] = field(default_factory=Counter)

    def begin(self, stage: str, now: float) -> None:
        """The stage begins at `now`, unless it began before (a re-issued call)."""
        self.began.setdefault(stage, now)

    def end(self, stage: str, now: float) -> None:
        self.ended[stage] = now

    def seconds(self, stage: str) -> float:
        """How long the stage ran; 0 if it has not begun and ended."""
        if stage not in self.began or stage not in self.ended:
            return 0.0
        return max(0.0, self.ended[stage] - self.began[stage])
