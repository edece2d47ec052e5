"""Option compile: a round (verifier forward and token choice / verification) is one compiled
function with static shapes; Compact rounds run in power-of-two buckets of rows padded with
finished rows.  Tokens, log-probs and round statistics equal eager execution's, for every
decoding, Full, Compact and Hybrid, with CFG, prefixes and slots.  Backend "eager" traces the
whole round through dynamo without code generation (quick); "aot_eager" also functionalizes
it, as inductor does (the in-place state updates become the graph's input mutations).
"""
import pytest
import torch
from torch._dynamo.utils import counters

from rollout import make_engine
from rollout.rounds import bucket, bucket_rows

JACOBI = [  # name, options
    ("hbsjd", dict(window=4, execution="full")),
    ("hbsjd", dict(window=3, execution="compact")),
    ("hbsjd", dict(window=4, execution="hybrid", gamma=5)),
    ("hbsjd", dict(window=4, execution="hybrid", gamma=5, refresh="resample")),
    ("sjd_independent", dict(window=5)),
    ("sjd_sync", dict(window=4)),
]


def _same(compiled, eager):
    assert torch.equal(compiled.tokens, eager.tokens)
    assert torch.allclose(compiled.logprobs, eager.logprobs, rtol=0, atol=1e-9)
    assert torch.equal(compiled.committed, eager.committed)
    assert torch.equal(compiled.accepted, eager.accepted)
    assert torch.equal(compiled.rejected, eager.rejected)
    assert compiled.modes == eager.modes and compiled.active == eager.active


@pytest.mark.parametrize("name,opts", JACOBI)
@pytest.mark.parametrize("decoding", ["greedy", "sample", "speculative"])
@pytest.mark.parametrize("slots,cfg", [(None, 2.0), (3, None)])
def test_compiled_rounds_give_the_eager_tokens(tiny, batch, name, opts, decoding, slots, cfg):
    model = tiny(4, vocab_size=5, grid_size=4)
    labels, prefix = batch(model, 7, 2, seed=5)
    kw = dict(cfg_scale=cfg, seed=3, slots=slots)
    eager = make_engine(name, decoding=decoding, **opts).generate(model, labels, prefix, 14, **kw)
    engine = make_engine(name, decoding=decoding, compile="eager", **opts)
    for _ in range(2):            # the second call reuses the graphs and the state buffers
        _same(engine.generate(model, labels, prefix, 14, **kw), eager)
    if decoding != "speculative":            # one token per key: Cached AR's
        ar = make_engine("cached_ar", decoding=decoding).generate(model, labels, prefix, 14, **kw)
        assert torch.equal(eager.tokens, ar.tokens)
    assert not any(layer.attention.static for layer in model.layers)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("decoding", ["greedy", "sample", "speculative"])
def test_compiled_window_policy_gives_the_eager_tokens(tiny, batch, decoding, backend):
    """W "auto" compiled (dynamo alone, and functionalized as inductor gets it), 7 images
    through 4 slots with CFG: the window changes between rounds and each window's state lives
    in its own held buffers (re-windowing leaves the old window's as they were,
    `jacobi.rewindow`); tokens, log-probs, round statistics and windows equal the eager
    W "auto" run's under the same schedule (tests/rollout/schedules.py), in two calls; greedy
    and sample: Cached AR's."""
    from tests.rollout.schedules import graded, steer
    model = tiny(4, vocab_size=5, grid_size=4)
    labels, prefix = batch(model, 7, 2, seed=5)
    kw = dict(cfg_scale=2.0, seed=3, slots=4)
    opts = dict(window="auto", decoding=decoding)
    with steer(graded):
        eager = make_engine("hbsjd", **opts).generate(model, labels, prefix, 14, **kw)
        assert len(set(eager.windows[1:])) >= 2 and set(eager.modes[1:]) == {"full", "compact"}
        engine = make_engine("hbsjd", compile=backend, **opts)
        for _ in range(2):        # the second call reuses the graphs and the state buffers
            res = engine.generate(model, labels, prefix, 14, **kw)
            _same(res, eager)
            assert res.windows == eager.windows
    if decoding != "speculative":            # one token per key: Cached AR's
        ar = make_engine("cached_ar", decoding=decoding).generate(model, labels, prefix, 14, **kw)
        assert torch.equal(eager.tokens, ar.tokens)


@pytest.mark.parametrize("decoding", ["greedy", "sample", "speculative"])
def test_compiled_cached_ar_gives_the_eager_tokens(tiny, batch, decoding):
    model = tiny(4, vocab_size=5, grid_size=4)
    labels, prefix = batch(model, 5, 3, seed=2)
    kw = dict(cfg_scale=2.0, seed=0, temperature=0.8, top_k=4)
    eager = make_engine("cached_ar", decoding=decoding).generate(model, labels, prefix, 13, **kw)
    compiled = make_engine("cached_ar", decoding=decoding, compile="eager").generate(
        model, labels, prefix, 13, **kw)
    _same(compiled, eager)


@pytest.mark.parametrize("decoding", ["greedy", "sample", "speculative"])
def test_functionalized_rounds_give_the_eager_tokens(tiny, batch, decoding):
    """aot_eager: the round as inductor receives it (state updates as input mutations)."""
    model = tiny(6, vocab_size=5, grid_size=4)
    labels, prefix = batch(model, 6, 2, seed=7)
    kw = dict(cfg_scale=2.0, seed=1, slots=4)
    opts = dict(window=4, decoding=decoding, execution="hybrid", gamma=3)
    eager = make_engine("hbsjd", **opts).generate(model, labels, prefix, 14, **kw)
    compiled = make_engine("hbsjd", compile="aot_eager", **opts).generate(model, labels, prefix,
                                                                          14, **kw)
    _same(compiled, eager)
    ar = make_engine("cached_ar", decoding=decoding, compile="aot_eager").generate(
        model, labels, prefix, 14, **kw)
    _same(ar, make_engine("cached_ar", decoding=decoding).generate(model, labels, prefix, 14,
                                                                   **kw))


def test_compact_rounds_compile_one_graph_per_bucket(tiny, batch):
    """8 rows, always Compact: the active counts 8..1 run as buckets 8, 4, 2, 1, one graph
    each, however many distinct counts the rollout goes through."""
    model = tiny(2, vocab_size=5, grid_size=4)
    labels, prefix = batch(model, 8, 1, seed=3)
    torch._dynamo.reset()
    counters.clear()
    res = make_engine("hbsjd", window=4, execution="compact", compile="eager").generate(
        model, labels, prefix, 15)
    buckets = {bucket(a, 8) for a in res.active[1:]}
    assert len(set(res.active[1:])) > len(buckets)       # the buckets saved graphs
    assert counters["stats"]["unique_graphs"] == len(buckets)


def test_buckets_are_powers_of_two_between_an_eighth_of_the_rows_and_the_rows():
    assert [bucket(a, 12) for a in range(1, 13)] == [1, 2, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12]
    assert sorted({bucket(a, 32) for a in range(1, 33)}) == [4, 8, 16, 32]
    live = torch.tensor([False, True, False, True, True, False])
    assert bucket_rows(live, 4).tolist() == [1, 3, 4, 0]
    assert bucket_rows(live, 3).tolist() == [1, 3, 4]
