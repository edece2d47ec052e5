"""The commands a step returns to the pipeline (actors/driver/step.py returns them,
actors/driver/pipeline.py carries them out): no Ray here."""
from __future__ import annotations

from dataclasses import dataclass

from opd.distill.results import LearnerResult


@dataclass(frozen=True)
class Generate:
    """Run rollout call `part` (its `issue`-th issue)."""
    part: int
    issue: int


@dataclass(frozen=True)
class Score:
    """Teacher `teacher` scores its share of `piece` from the piece's latest payload (made by
    issue `issue` of its part)."""
    piece: int
    issue: int
    teacher: int = 0


@dataclass(frozen=True)
class ScoreSpan:
    """Teacher `teacher` scores span `span` of rollout call `part` (issue `issue`) while the
    call runs (`rollout.span`, actors/driver/spans.py)."""
    part: int
    issue: int
    teacher: int
    span: int


@dataclass(frozen=True)
class HandOut:
    """Hand `piece` to every learner rank (its `handing`-th hand-out)."""
    piece: int
    handing: int
    prefetch: bool


@dataclass(frozen=True)
class Seal:
    """Every piece is delivered: the queue makes them one item."""


@dataclass(frozen=True)
class Trainable:
    """The step may begin training (its first piece is delivered, or it is sealed): the
    learner group takes it if it is free and the step is the current version's."""


@dataclass(frozen=True)
class Replan:
    """Generate the whole step again at the published version (a new generation)."""


@dataclass(frozen=True)
class Trained:
    """Every rank answered the step's last piece: their results, in rank order."""
    results: list[LearnerResult]


Command = Generate | Score | ScoreSpan | Seal | Trainable | HandOut | Replan | Trained
