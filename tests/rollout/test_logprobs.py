"""Every engine records the behaviour log-prob of each committed token (rollout/sampling.py:
log p(token) under the warped guided distribution it was committed from; greedy: the same
distribution's log-prob of the argmax), and it equals a teacher-forced recomputation of the
same tokens: exactly with these float64 models (the engines' float32 warp of logits that
agree to ~1e-15), whatever the engine, decoding, execution, slots or CFG."""
import pytest
import torch

from rollout import make_engine
from rollout.sampling import guide, token_logprob, warp

T, P = 16, 3
WARP = dict(temperature=0.9, top_k=8, top_p=0.95)
ENGINES = [("cached_ar", {}), ("sjd_sync", dict(window=4)), ("sjd_independent", dict(window=5)),
           ("hbsjd", dict(window=4, execution="full")), ("hbsjd", dict(window=4, execution="compact")),
           ("hbsjd", dict(window=6, execution="hybrid", gamma=3))]


def teacher_forced(model, labels, tokens, prefix_len, cfg_scale):
    """(B, N) float32 log-probs of tokens[:, prefix_len:] by full (uncached) forwards."""
    cond = model(labels, tokens[:, :-1])[:, prefix_len:]
    logits = cond
    if cfg_scale != 1.0:
        uncond = model(torch.full_like(labels, model.num_classes), tokens[:, :-1])[:, prefix_len:]
        logits = guide(torch.cat([cond, uncond]), cfg_scale)
    return token_logprob(warp(logits, WARP["temperature"], WARP["top_k"], WARP["top_p"]),
                         tokens[:, prefix_len:])


@pytest.mark.parametrize("cfg_scale", [1.0, 2.0])
@pytest.mark.parametrize("slots", [None, 4])
@pytest.mark.parametrize("decoding", ["greedy", "sample", "speculative"])
@pytest.mark.parametrize("name,opts", ENGINES)
def test_recorded_logprobs_equal_a_teacher_forced_recomputation(tiny, batch, name, opts,
                                                                decoding, slots, cfg_scale):
    model = tiny(0)
    labels, prefix = batch(model, 6, P, 1)
    res = make_engine(name, decoding=decoding, **opts).generate(
        model, labels, prefix, T - P, cfg_scale=cfg_scale, seed=3, slots=slots, **WARP)
    assert res.logprobs.shape == (6, T - P) and res.logprobs.dtype == torch.float32
    expected = teacher_forced(model, labels, res.tokens, P, cfg_scale)
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(res.logprobs, expected, rtol=0, atol=1e-6)
    if decoding == "greedy":   # the argmax of a distribution over at most top_k=8 tokens
        assert (res.logprobs >= -torch.log(torch.tensor(8.0)) - 1e-6).all()


@pytest.mark.parametrize("name,opts", ENGINES)
def test_single_new_token_records_its_logprob(tiny, batch, name, opts):
    model = tiny(2)
    labels, prefix = batch(model, 3, T - 1, 0)
    res = make_engine(name, decoding="sample", **opts).generate(
        model, labels, prefix, 1, cfg_scale=2.0, seed=1, **WARP)
    torch.testing.assert_close(res.logprobs, teacher_forced(model, labels, res.tokens, T - 1, 2.0),
                               rtol=0, atol=1e-6)


def test_logprobs_belong_to_their_tokens(tiny, batch):
    """A changed token changes the recomputed log-prob: the comparison is not vacuous."""
    model = tiny(0)
    labels, prefix = batch(model, 4, P, 1)
    res = make_engine("hbsjd", window=4, decoding="sample").generate(
        model, labels, prefix, T - P, cfg_scale=2.0, seed=3, **WARP)
    other = res.tokens.clone()
    other[:, P + 5] = (other[:, P + 5] + 1) % model.vocab_size
    moved = (teacher_forced(model, labels, other, P, 2.0) - res.logprobs).abs()
    assert moved[:, 5].min() > 1e-3
