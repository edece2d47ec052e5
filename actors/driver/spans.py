"""What a step knows of its rollout calls' position spans (`rollout.span` S > 0,
docs/STREAMING.md): each call's spans as they are handed out, where each teacher scores them,
and the teacher seconds spent while the calls still ran.  No Ray here.

A call's spans go to one worker per teacher (its `pins`), in order, so that worker's KV caches
grow span by span; the call's pieces are scored on that worker once every span of the call is
in (`complete`), from the spans' refs for any it lacks (actors/workers/teacher.py).  A worker
that failed loses nothing: the next one scores the spans again from their refs.
"""
from __future__ import annotations

from actors.transport.delivery import SpanReport
from opd.distill.steps import RolloutJob
from rollout.spans import span_cuts


class CallSpans:
    """The spans of a step's rollout calls (`jobs`, one per part) cut every `span` positions."""

    def __init__(self, jobs: list[RolloutJob], span: int):
        self.count = [len(span_cuts(j.prefix_len, int(j.tokens.shape[1]), span, j.prefix_len,
                                    int(j.tokens.shape[1]))) for j in jobs]
        self.made: dict[tuple[int, int], list[SpanReport]] = {}  # (part, issue) -> its spans
        self.pins: dict[tuple[int, int], int] = {}      # (part, teacher) -> its worker
        self.in_rollout = 0.0      # teacher seconds on spans that went out while a call ran

    def add(self, part: int, issue: int, report: SpanReport) -> bool:
        """Issue `issue` of `part` handed out its next span (False: not the next one)."""
        made = self.made.setdefault((part, issue), [])
        if report.index != len(made):
            return False
        made.append(report)
        return True

    def complete(self, part: int, issue: int) -> bool:
        return len(self.made.get((part, issue), ())) == self.count[part]

    def refs(self, part: int, issue: int) -> list[tuple[int, object]]:
        """(start, payload ref) of every span of the call, in order."""
        return [(r.start, r.payload) for r in self.made[part, issue]]

    def report(self, part: int, issue: int, span: int) -> SpanReport:
        return self.made[part, issue][span]

    def scored(self, part: int, issue: int, span: int, seconds: float) -> None:
        """A teacher scored span `span` of the call in `seconds`."""
        if self.made[part, issue][span].midway:
            self.in_rollout += seconds
