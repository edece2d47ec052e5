"""The driver's typed records of work in flight: one type per kind of task, and a step's
stage timer.  A step itself, with everything known of it, is a `Step` (actors/driver/step.py).
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(kw_only=True)
class Task:
    """One task in flight: the pool of its worker (`role`: rollout | teacher/<name> | learner),
    the worker's index in it, and when it was submitted.  Each kind of task is its own type
    below, with the keys of what it works on; `kind` names it in hooks and metrics."""
    kind: ClassVar[str] = ""
    streams: ClassVar[bool] = False   # a Ray streaming generator: answers per item it hands out
    counted: ClassVar[bool] = True    # counts against its worker's load (dispatch.py)
    role: str = ""
    worker: int = -1
    submitted: float = field(default_factory=time.perf_counter)


@dataclass(kw_only=True)
class RolloutCall(Task):
    """Rollout call `part` of step `step` (plan generation `gen`), its `issue`-th issue: a
    stream of span and piece reports, then the call's report (rollout worker)."""
    kind: ClassVar[str] = "rollout"
    streams: ClassVar[bool] = True
    step: int
    gen: int
    part: int
    issue: int

    def order(self) -> tuple[int, int]:
        """Where it goes among the commands waiting for a worker (dispatch.py)."""
        return self.step, -1


@dataclass(kw_only=True)
class TeacherRolloutCall(RolloutCall):
    """A teacher rollout call (SeqKD), on a worker of the teacher's pool."""
    kind: ClassVar[str] = "teacher-rollout"


@dataclass(kw_only=True)
class PieceScoring(Task):
    """Teacher `teacher` scores its share of piece `piece` of step `step` from the payload of
    issue `issue` of the piece's part (teacher worker)."""
    kind: ClassVar[str] = "score"
    step: int
    gen: int
    piece: int
    issue: int
    teacher: int = 0

    def order(self) -> tuple[int, int]:
        return self.step, self.piece


@dataclass(kw_only=True)
class SpanScoring(Task):
    """Teacher `teacher` scores span `span` of issue `issue` of rollout call `part` of step
    `step` while the call runs (rollout.span; teacher worker)."""
    kind: ClassVar[str] = "score-span"
    step: int
    gen: int
    part: int
    issue: int
    teacher: int
    span: int

    def order(self) -> tuple[int, int]:
        return self.step, -1


@dataclass(kw_only=True)
class PieceTraining(Task):
    """Learner rank `worker` trains the `handing`-th hand-out of piece `piece` of step `step`."""
    kind: ClassVar[str] = "train"
    step: int
    piece: int
    handing: int


@dataclass(kw_only=True)
class WeightsLoad(Task):
    """A rollout worker loads the published weights of `version`."""
    kind: ClassVar[str] = "load"
    version: int


@dataclass(kw_only=True)
class Probe(Task):
    """Is a failed worker back?"""
    kind: ClassVar[str] = "probe"
    counted: ClassVar[bool] = False


@dataclass(kw_only=True)
class Placement(Task):
    """An elastic rollout worker's placement group is ready."""
    kind: ClassVar[str] = "place"


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
