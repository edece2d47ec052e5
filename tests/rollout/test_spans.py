"""`Engine.stream(..., span=S)`: a call streamed by position span (rollout/spans.py).

A teacher scores each span as it comes (docs/STREAMING.md), so a span must hold exactly the
columns of the whole call's tokens and behaviour log-probs, the cuts must be fixed by (P, N, S)
alone, and a span must go out in the round the call's slowest image committed past its end."""
import pytest
import torch

from rollout import make_engine
from rollout.spans import Span, span_cuts

CASES = [
    ("cached_ar", {}, None),
    ("sjd_sync", {"window": 4}, None),
    ("hbsjd", {"window": 2, "execution": "full"}, None),
    ("hbsjd", {"window": 4, "execution": "hybrid", "gamma": 3}, None),
    ("hbsjd", {"window": 8, "execution": "compact"}, None),
    ("hbsjd", {"window": "auto"}, None),
    ("hbsjd", {"window": 4, "execution": "hybrid", "gamma": 3}, 3),       # slots
    ("hbsjd", {"window": 4, "candidates": 3}, None),
    ("hbsjd", {"window": 4, "execution": "hybrid", "gamma": 3, "compile": "eager"}, None),
]


def split(items):
    spans = [x for x in items if isinstance(x, Span)]
    return spans, [x for x in items if not isinstance(x, Span)]


def test_cuts_are_fixed_by_the_prefix_the_length_and_the_span():
    assert span_cuts(3, 15, 5, 3, 15) == [(3, 8), (8, 13), (13, 15)]
    assert span_cuts(3, 15, 5, 3, 12) == [(3, 8)]             # 13 not committed by all
    assert span_cuts(3, 15, 5, 8, 14) == [(8, 13)]            # from the last handed out
    assert span_cuts(0, 4, 8, 0, 4) == [(0, 4)]               # one span longer than the call
    assert span_cuts(3, 15, 0, 3, 15) == []                   # off


@pytest.mark.parametrize("decoding", ["greedy", "sample"])
@pytest.mark.parametrize("span", [1, 4, 5])
@pytest.mark.parametrize("name,options,slots", CASES)
def test_spans_concatenate_to_the_whole_call(tiny, batch, name, options, slots, span,
                                             decoding):
    model = tiny()
    P, N = 3, 12
    labels, prefix = batch(model, 6, P)
    engine = make_engine(name, decoding=decoding, **options)
    kw = dict(cfg_scale=2.0, seed=11, slots=slots)
    whole = engine.generate(model, labels, prefix, N, **kw)
    stream = engine.stream(model, labels, prefix, N, span=span, **kw)
    spans, groups = split(list(stream))
    assert [(s.start, s.stop) for s in spans] == span_cuts(P, P + N, span, P, P + N)
    assert torch.equal(torch.cat([s.tokens for s in spans], 1), whole.tokens[:, P:])
    assert torch.equal(torch.cat([s.logprobs for s in spans], 1), whole.logprobs)
    images = torch.cat([g.images for g in groups])         # the images as without spans
    assert sorted(images.tolist()) == list(range(6))
    assert torch.equal(stream.result.tokens, whole.tokens)


@pytest.mark.parametrize("P,N", [(0, 6), (2, 1)])
def test_no_prefix_and_one_new_token(tiny, batch, P, N):
    model = tiny()
    labels, prefix = batch(model, 4, P)
    engine = make_engine("hbsjd", window=4, decoding="sample")
    whole = engine.generate(model, labels, prefix, N, seed=5)
    spans, _ = split(engine.stream(model, labels, prefix, N, seed=5, span=4))
    assert torch.equal(torch.cat([s.tokens for s in spans], 1), whole.tokens[:, P:])
    assert torch.equal(torch.cat([s.logprobs for s in spans], 1), whole.logprobs)


@pytest.mark.parametrize("options", [{"window": 4, "execution": "full"},
                                     {"window": 3, "execution": "compact"}])
def test_a_span_goes_out_in_the_round_its_slowest_image_committed_it(tiny, batch, options):
    """Round r (r >= 1) is the call's r-th verifier forward: a span [a, b) must go out after
    the first round after which every image holds b tokens, before the next forward."""
    model = tiny(seed=2)
    P, N, S = 2, 14, 3
    labels, prefix = batch(model, 6, P)
    engine = make_engine("hbsjd", decoding="sample", **options)
    forwards = []
    plain = model.forward_cached

    def counted(*args, **kwargs):
        forwards.append(1)
        return plain(*args, **kwargs)
    model.forward_cached = counted
    try:
        stream = engine.stream(model, labels, prefix, N, seed=7, span=S)
        seen = [(x.stop, len(forwards)) for x in stream if isinstance(x, Span)]
    finally:
        del model.forward_cached
    held = P + stream.result.committed.cumsum(0)               # (rounds, B) tokens after round r
    for stop, round_ in seen:
        first = int(torch.nonzero(held.min(1).values >= stop)[0])
        assert round_ == first, (stop, round_, first)
    assert seen[0][1] < stream.result.committed.shape[0] - 1    # before the call's last round


def test_midway_marks_the_spans_out_before_the_calls_last_round(tiny, batch):
    model = tiny()
    labels, prefix = batch(model, 5, 2)
    for name, midway in (("hbsjd", [True, True, True, False]), ("cached_ar", [False] * 4)):
        engine = make_engine(name, window=4, decoding="sample") if name == "hbsjd" else \
            make_engine(name, decoding="sample")
        spans, _ = split(engine.stream(model, labels, prefix, 14, seed=1, span=4))
        assert [s.midway for s in spans] == midway, name
