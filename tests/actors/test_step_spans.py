"""A step that scores its rollout calls by span (rollout.span; actors/driver/step.py with
actors/driver/spans.py) on made-up events: no Ray.  2 parts of 2 pieces, 3 new tokens a call,
spans of 1 token: 3 spans a call."""
import torch

from actors.driver.commands import Generate, Score, ScoreSpan
from actors.driver.step import Step
from actors.transport.delivery import SpanReport
from opd.distill.steps import RolloutJob
from tests.actors.test_step import LAYOUT, piece


def spanned_step() -> Step:
    job = RolloutJob(7, torch.arange(4), torch.zeros(4, 6, dtype=torch.int64), 3, "student", 0)
    return Step(3, 7, "student", 3, [job, job], LAYOUT, gen=0, scored=True, schedule="p", span=1)


def span(k: int, midway=True) -> SpanReport:
    return SpanReport(k, 3 + k, 4 + k, midway, payload=f"span{k}")


def test_a_calls_pieces_are_scored_once_its_spans_are_all_in():
    s = spanned_step()
    assert s.start() == [Generate(0, 1), Generate(1, 1)]
    assert s.spans.count == [3, 3]
    assert s.span_made(0, 1, span(0)) == [ScoreSpan(0, 1, 0, 0)]
    assert s.span_made(0, 1, span(0)) == []                       # once
    assert s.span_made(0, 1, span(2)) == []                       # not the next one
    assert s.piece_made(0, 1, piece(1)) == []                     # waits for the last span
    assert s.span_made(0, 1, span(1)) == [ScoreSpan(0, 1, 0, 1)]
    assert s.span_made(0, 1, span(2, midway=False)) == [ScoreSpan(0, 1, 0, 2), Score(1, 1)]
    assert s.piece_made(0, 1, piece(0)) == [Score(0, 1)]          # after the spans: at once
    assert s.spans.refs(0, 1) == [(3, "span0"), (4, "span1"), (5, "span2")]
    for k, seconds in enumerate((0.5, 0.25, 2.0)):
        s.span_scored(0, 1, k, seconds)
    assert s.spans.in_rollout == 0.75 and s.times.busy["teacher"] == 2.75   # midway: 0 and 1
    assert "teacher" in s.times.began


def test_a_call_issued_again_starts_its_spans_over():
    s = spanned_step()
    s.start()
    for k in range(2):
        s.span_made(1, 1, span(k))
    s.piece_made(1, 1, piece(2))
    assert s.part_failed(1, 1, published=3) == [Generate(1, 2)]
    assert s.span_made(1, 1, span(2)) == []                       # the dead call's
    s.span_scored(1, 1, 0, 1.0)                                   # counted: it ran
    assert s.spans.in_rollout == 1.0
    assert s.piece_made(1, 2, piece(2)) == []
    for k in range(3):
        out = s.span_made(1, 2, span(k))
    assert out == [ScoreSpan(1, 2, 0, 2), Score(2, 2)]
    assert s.spans.refs(1, 2)[0] == (3, "span0") and len(s.spans.made[1, 1]) == 2


def test_a_payload_lost_while_the_new_call_streams_waits_for_its_spans():
    s = spanned_step()
    s.start()
    for k in range(3):
        s.span_made(0, 1, span(k))
    assert s.piece_made(0, 1, piece(0)) == [Score(0, 1)]
    assert s.score_lost(0, 1) == [Generate(0, 2)]                 # its rollout worker died
    assert s.piece_made(0, 2, piece(0)) == []                     # the new call's spans: not yet
    assert s.score_lost(0, 1) == []
    out = [c for k in range(3) for c in s.span_made(0, 2, span(k))]
    assert out[-1] == Score(0, 2) and out.count(Score(0, 2)) == 1
