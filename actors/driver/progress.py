"""What a step (actors/driver/step.py) knows of each of its pieces and of the learner group's
work on it: records that only `Step` changes."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from actors.transport.delivery import PieceReport
from opd.distill.results import PieceAnswer


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
