"""Divergences against float64 numpy references written here from the definitions."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from opd.distill.divergences import (
    DIVERGENCES,
    TeacherDist,
    get_divergence,
    masked_divergence,
)

# -- independent float64 references (probability space, no logsumexp tricks) -------------------


def np_softmax(x: np.ndarray, tau: float = 1.0) -> np.ndarray:
    e = np.exp((x - x.max(-1, keepdims=True)) / tau)
    return e / e.sum(-1, keepdims=True)


def np_kl(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    return np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0) / q), 0.0), axis=-1)


def np_div(name: str, p: np.ndarray, q: np.ndarray, beta: float = 0.5) -> np.ndarray:
    """p teacher, q student, both (..., A) probabilities."""
    if name == "forward_kl" or (name == "jsd" and beta == 0.0):
        return np_kl(p, q)
    if name == "reverse_kl" or (name == "jsd" and beta == 1.0):
        return np_kl(q, p)
    m = beta * p + (1 - beta) * q
    return beta * np_kl(p, m) + (1 - beta) * np_kl(q, m)


def np_lumped(probs: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """(…, V) probs -> (…, k+1) masses on idx and the rest (no rest atom when k = V)."""
    top = np.take_along_axis(probs, idx, -1)
    if idx.shape[-1] == probs.shape[-1]:
        return top
    return np.concatenate([top, 1.0 - top.sum(-1, keepdims=True)], -1)


CASES = [("forward_kl", {}), ("reverse_kl", {}), ("jsd", {"beta": 0.1}), ("jsd", {"beta": 0.5}),
         ("jsd", {"beta": 0.9}), ("jsd", {"beta": 0.0}), ("jsd", {"beta": 1.0})]


def random_inputs(B=2, T=5, V=7, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=g, dtype=dtype) * 2
    t = torch.log_softmax(torch.randn(B, T, V, generator=g, dtype=dtype) * 2, -1)
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[0, 0] = True
    mask[-1, -1] = False
    return z, t, mask


# -- values -------------------------------------------------------------------------------------


def test_hand_computed_values():
    # teacher P = (1/2, 1/2), student Q = (1/4, 3/4), M = (3/8, 5/8) at β = 1/2
    z = torch.tensor([[[math.log(0.25), math.log(0.75)]]], dtype=torch.float64)
    t = torch.tensor([[[math.log(0.5), math.log(0.5)]]], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    teacher = TeacherDist(t)
    fwd = 0.5 * math.log(4 / 3)
    rev = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    js = 0.5 * (0.5 * math.log(0.5 / 0.375) + 0.5 * math.log(0.5 / 0.625)) \
        + 0.5 * (0.25 * math.log(0.25 / 0.375) + 0.75 * math.log(0.75 / 0.625))
    assert masked_divergence(z, teacher, mask, "forward_kl").item() == pytest.approx(fwd, abs=1e-12)
    assert masked_divergence(z, teacher, mask, "reverse_kl").item() == pytest.approx(rev, abs=1e-12)
    assert masked_divergence(z, teacher, mask, "jsd", beta=0.5).item() == pytest.approx(js, abs=1e-12)


@pytest.mark.parametrize("name,params", CASES)
@pytest.mark.parametrize("tau", [1.0, 0.7, 2.0])
def test_full_matches_reference(name, params, tau):
    z, t, mask = random_inputs()
    loss, per = masked_divergence(z, TeacherDist(t), mask, name, temperature=tau,
                                  return_per_position=True, **params)
    ref = np_div(name, np_softmax(t.numpy(), tau), np_softmax(z.numpy(), tau), **params)   # (B, T)
    m = mask.numpy()
    np.testing.assert_allclose(per.numpy(), np.where(m, ref, 0.0), rtol=1e-10, atol=1e-12)
    assert loss.item() == pytest.approx(ref[m].mean(), rel=1e-10)


def test_teacher_temperature_overrides_teacher_side_only():
    z, t, mask = random_inputs(seed=3)
    loss = masked_divergence(z, TeacherDist(t), mask, "reverse_kl", temperature=0.8, teacher_temperature=1.5)
    ref = np_div("reverse_kl", np_softmax(t.numpy(), 1.5), np_softmax(z.numpy(), 0.8))
    assert loss.item() == pytest.approx(ref[mask.numpy()].mean(), rel=1e-10)


@pytest.mark.parametrize("name,params", CASES)
def test_topk_lumped_matches_reference(name, params):
    z, t, mask = random_inputs(V=9, seed=1)
    k, tau = 4, 0.8
    vals, idx = t.topk(k, dim=-1)
    loss = masked_divergence(z, TeacherDist(vals, idx), mask, name, temperature=tau, **params)
    i = idx.numpy()
    p = np_softmax(np.log(np_lumped(np.exp(t.numpy()), i)), tau)          # lump, then temper
    q = np_softmax(np.log(np_lumped(np_softmax(z.numpy()), i)), tau)
    ref = np_div(name, p, q, **params)
    assert loss.item() == pytest.approx(ref[mask.numpy()].mean(), rel=1e-9)


@pytest.mark.parametrize("name,params", CASES)
@pytest.mark.parametrize("tau", [1.0, 0.6])
def test_topk_with_k_equal_vocab_equals_full(name, params, tau):
    z, t, mask = random_inputs(seed=2)
    V = z.shape[-1]
    perm = torch.stack([torch.randperm(V, generator=torch.Generator().manual_seed(s)) for s in range(10)])
    idx = perm.view(2, 5, V)                                        # any order, all V tokens
    vals = t.gather(-1, idx)
    full = masked_divergence(z, TeacherDist(t), mask, name, temperature=tau, **params)
    topk = masked_divergence(z, TeacherDist(vals, idx), mask, name, temperature=tau, **params)
    torch.testing.assert_close(topk, full, rtol=1e-12, atol=1e-12)


def test_topk_charges_student_mass_outside_teacher_topk():
    # student matches the teacher on the top-k up to scale but puts extra mass elsewhere
    V, k = 6, 2
    t = torch.log(torch.tensor([0.5, 0.3, 0.05, 0.05, 0.05, 0.05], dtype=torch.float64)).view(1, 1, V)
    z = torch.log(torch.tensor([0.25, 0.15, 0.15, 0.15, 0.15, 0.15], dtype=torch.float64)).view(1, 1, V)
    vals, idx = t.topk(k, -1)
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss = masked_divergence(z, TeacherDist(vals, idx), mask, "forward_kl")
    expected = 0.5 * math.log(0.5 / 0.25) + 0.3 * math.log(0.3 / 0.15) + 0.2 * math.log(0.2 / 0.6)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert loss.item() > 0.1


# -- JSD identities -------------------------------------------------------------------------------


def test_jsd_endpoints_are_forward_and_reverse_kl():
    z, t, mask = random_inputs(seed=4)
    teacher = TeacherDist(t)
    for tau in (1.0, 0.5):
        fwd = masked_divergence(z, teacher, mask, "forward_kl", temperature=tau)
        rev = masked_divergence(z, teacher, mask, "reverse_kl", temperature=tau)
        assert masked_divergence(z, teacher, mask, "jsd", beta=0.0, temperature=tau).item() == fwd.item()
        assert masked_divergence(z, teacher, mask, "jsd", beta=1.0, temperature=tau).item() == rev.item()
    # the endpoints are a convention: the formula itself vanishes as beta -> 0
    near0 = masked_divergence(z, teacher, mask, "jsd", beta=1e-6)
    assert near0.item() < 1e-4 * fwd.item()


def test_jsd_swap_symmetry_bounds_and_zero():
    z, t, mask = random_inputs(seed=5)
    s_logp = torch.log_softmax(z, -1)
    for beta in (0.2, 0.5, 0.7):
        a = masked_divergence(z, TeacherDist(t), mask, "jsd", beta=beta, return_per_position=True)[1]
        b = masked_divergence(t, TeacherDist(s_logp), mask, "jsd", beta=1 - beta, return_per_position=True)[1]
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    per = masked_divergence(z, TeacherDist(t), mask, "jsd", beta=0.5, return_per_position=True)[1]
    assert (per >= 0).all() and (per <= math.log(2)).all()
    same = masked_divergence(z, TeacherDist(s_logp), mask, "jsd", beta=0.5)
    assert abs(same.item()) < 1e-12


# -- masking, reduction, registry ---------------------------------------------------------------


@pytest.mark.parametrize("name,params", CASES[:3])
@pytest.mark.parametrize("topk", [False, True])
def test_masked_positions_do_not_matter(name, params, topk):
    z, t, mask = random_inputs(seed=6)
    teacher = TeacherDist(*t.topk(3, -1)) if topk else TeacherDist(t)
    z2 = z.clone()
    z2[~mask] = torch.randn(int((~mask).sum()), z.shape[-1], dtype=z.dtype) * 10
    a, per_a = masked_divergence(z, teacher, mask, name, return_per_position=True, **params)
    b, per_b = masked_divergence(z2, teacher, mask, name, return_per_position=True, **params)
    assert a.item() == b.item()
    assert (per_a[~mask] == 0).all() and torch.equal(per_a, per_b)
    # and valid positions do matter
    z3 = z.clone()
    z3[mask] += torch.randn(int(mask.sum()), z.shape[-1], dtype=z.dtype)
    assert masked_divergence(z3, teacher, mask, name, **params).item() != a.item()


def test_token_average_and_empty_mask():
    z, t, mask = random_inputs(seed=7)
    loss, per = masked_divergence(z, TeacherDist(t), mask, "forward_kl", return_per_position=True)
    assert loss.item() == pytest.approx(per.sum().item() / mask.sum().item(), rel=1e-12)
    empty = torch.zeros_like(mask)
    zero = masked_divergence(z.requires_grad_(), TeacherDist(t), empty, "forward_kl")
    assert zero.item() == 0.0
    zero.backward()
    assert torch.equal(z.grad, torch.zeros_like(z))


def test_low_precision_logits_computed_in_float32():
    z, t, mask = random_inputs(seed=8)
    ref = masked_divergence(z, TeacherDist(t), mask, "jsd", beta=0.5)
    half = masked_divergence(z.to(torch.bfloat16), TeacherDist(t.float()), mask, "jsd", beta=0.5)
    assert half.dtype == torch.float32
    assert half.item() == pytest.approx(ref.item(), rel=3e-2)


def test_registry_and_errors():
    assert {"forward_kl", "reverse_kl", "jsd"} <= set(DIVERGENCES)
    z, t, mask = random_inputs()
    fn = get_divergence("jsd", beta=0.3)
    s, p = torch.log_softmax(z, -1), t
    ref = np_div("jsd", np.exp(p.numpy()), np.exp(s.numpy()), beta=0.3)
    np.testing.assert_allclose(fn(s, p).numpy(), ref, rtol=1e-10)
    with pytest.raises(ValueError, match="unknown divergence 'kl'"):
        get_divergence("kl")
    with pytest.raises(ValueError, match="no parameter 'beta'"):
        get_divergence("forward_kl", beta=0.5)
    with pytest.raises(ValueError, match=r"beta must lie in \[0, 1\]"):
        masked_divergence(z, TeacherDist(t), mask, "jsd", beta=1.5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        masked_divergence(z, TeacherDist(t), mask, temperature=0.0)
    with pytest.raises(ValueError, match="mask must be"):
        masked_divergence(z, TeacherDist(t), mask.long())
    with pytest.raises(ValueError, match="full teacher log-probs must be"):
        masked_divergence(z, TeacherDist(t[..., :3]), mask)
    vals, idx = t.topk(3, -1)
    with pytest.raises(ValueError, match="indices must be int64"):
        masked_divergence(z, TeacherDist(vals, idx.int()), mask)


# -- gradients ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name,params", CASES)
@pytest.mark.parametrize("k", [None, 2, 4])
def test_gradcheck(name, params, k):
    z, t, mask = random_inputs(B=1, T=3, V=4, seed=9)
    teacher = TeacherDist(t) if k is None else TeacherDist(*t.topk(k, -1))
    z = z.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: masked_divergence(x, teacher, mask, name, temperature=0.9, **params), (z,))
