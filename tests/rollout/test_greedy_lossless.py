"""Invariant 1: greedy SJD is lossless — every engine, execution mode, gamma, W and H returns
exactly Cached AR's greedy tokens, for any batch size, prefix length and CFG scale."""
from contextlib import nullcontext

import pytest
import torch

from rollout import make_engine

T = 16  # GPT-tiny: grid 4


def engines(B: int):
    yield "sjd_sync", {}
    yield "sjd_independent", {}
    yield "hbsjd", dict(execution="full")
    yield "hbsjd", dict(execution="compact")
    yield "hbsjd", dict(execution="hybrid", gamma=2)
    yield "hbsjd", dict(execution="hybrid", gamma=B)


@pytest.mark.parametrize("cfg", [None, 2.0])
@pytest.mark.parametrize("P", [0, 5, T - 1])
@pytest.mark.parametrize("B", [1, 3, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_engine_returns_cached_ar_tokens(tiny, batch, seed, B, P, cfg):
    model = tiny(seed)
    labels, prefix = batch(model, B, P, seed)
    ref = make_engine("cached_ar").generate(model, labels, prefix, T - P, cfg_scale=cfg)
    assert ref.tokens.shape == (B, T) and torch.equal(ref.tokens[:, :P], prefix)
    for W in (1, 4, 16):
        for name, opts in engines(B):
            res = make_engine(name, window=W, **opts).generate(model, labels, prefix, T - P,
                                                          cfg_scale=cfg)
            assert torch.equal(res.tokens, ref.tokens), (name, opts, W)
            assert res.committed.sum(0).tolist() == [T - P] * B
            if W == 1 or P == T - 1:
                assert res.rounds == T - P          # a window of one token is plain AR


@pytest.mark.parametrize("cfg", [None, 2.0])
def test_drafts_are_accepted_and_still_lossless(tiny, batch, cfg):
    """A case where Jacobi decoding really skips forwards, so equality is not trivial."""
    model = tiny(2)
    labels, prefix = batch(model, 8, 0)
    ref = make_engine("cached_ar").generate(model, labels, prefix, T, cfg_scale=cfg)
    for name, opts in engines(8):
        res = make_engine(name, window=8, **opts).generate(model, labels, prefix, T, cfg_scale=cfg)
        assert torch.equal(res.tokens, ref.tokens), (name, opts)
        assert res.rounds < T and int(res.accepted.sum()) > 0, (name, opts)
        if name != "sjd_sync":
            assert res.mean_committed > 1.5, (name, opts)


@pytest.mark.parametrize("H", [1, 2, 4, 7, 15])
def test_any_history_offset_is_lossless(tiny, batch, H):
    model = tiny(2)
    labels, prefix = batch(model, 4, 3, 2)
    ref = make_engine("cached_ar").generate(model, labels, prefix, T - 3, cfg_scale=1.5)
    for name in ("sjd_sync", "sjd_independent", "hbsjd"):
        res = make_engine(name, window=6, history_offset=H).generate(model, labels, prefix, T - 3, cfg_scale=1.5)
        assert torch.equal(res.tokens, ref.tokens), (name, H)


def test_partial_generation_and_larger_grid(tiny, batch):
    """N smaller than the rest of the sequence, a 36-token grid and a 5-token vocabulary."""
    model = tiny(3, grid_size=6, vocab_size=5)
    labels, prefix = batch(model, 5, 7, 3)
    ref = make_engine("cached_ar").generate(model, labels, prefix, 20, cfg_scale=3.0)
    assert ref.tokens.shape == (5, 27)
    for W in (2, 5, 19, 30):
        for name, opts in engines(5):
            res = make_engine(name, window=W, **opts).generate(model, labels, prefix, 20,
                                                          cfg_scale=3.0)
            assert torch.equal(res.tokens, ref.tokens), (name, opts, W)


def test_model_in_train_mode_is_rolled_out_without_label_dropout(tiny, batch):
    model = tiny(0, class_dropout_prob=1.0)
    labels, prefix = batch(model, 3, 4)
    ref = make_engine("cached_ar").generate(model, labels, prefix, 12)
    model.train()
    try:
        res = make_engine("hbsjd", window=4).generate(model, labels, prefix, 12)
        assert model.training
    finally:
        model.eval()
    assert torch.equal(res.tokens, ref.tokens)


@pytest.mark.parametrize("cfg", [None, 2.0])
@pytest.mark.parametrize("P", [0, 5, T - 1])
@pytest.mark.parametrize("B", [1, 3, 8])
def test_the_window_policy_returns_cached_ar_tokens(tiny, batch, B, P, cfg):
    """W="auto" (rollout/window.py): the measured policy, and two schedules under which W and
    Full / Compact change between rounds (tests/rollout/schedules.py; tests/rollout/
    test_window.py has the policy's own tests)."""
    from tests.rollout.schedules import graded, steer, switching
    model = tiny(2)
    labels, prefix = batch(model, B, P, 1)
    ref = make_engine("cached_ar").generate(model, labels, prefix, T - P, cfg_scale=cfg)
    for schedule in (None, switching, graded):
        for execution in ("full", "compact", "hybrid"):
            with steer(schedule) if schedule else nullcontext():
                res = make_engine("hbsjd", window="auto", execution=execution).generate(
                    model, labels, prefix, T - P, cfg_scale=cfg)
            assert torch.equal(res.tokens, ref.tokens), (schedule, execution)
            assert res.committed.sum(0).tolist() == [T - P] * B
