"""Objectives against float64 numpy references written here from their documented definitions."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from opd.distill.batch import TrajectoryBatch
from opd.distill.objectives import OBJECTIVES, GKD, VarKD, get_objective

B, L, P, V = 2, 6, 2, 5


def np_softmax(x: np.ndarray, tau: float = 1.0) -> np.ndarray:
    e = np.exp((x - x.max(-1, keepdims=True)) / tau)
    return e / e.sum(-1, keepdims=True)


def np_kl(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    return np.sum(p * np.log(p / q), axis=-1)


def np_jsd(p: np.ndarray, q: np.ndarray, beta: float) -> np.ndarray:
    if beta == 0.0:
        return np_kl(p, q)
    if beta == 1.0:
        return np_kl(q, p)
    m = beta * p + (1 - beta) * q
    return beta * np_kl(p, m) + (1 - beta) * np_kl(q, m)


def make(source="student", seed=0, topk=None, V=V):
    """A batch and student logits (B, L, V) float64 with a full (or top-k) teacher."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, L), generator=g)
    t = torch.log_softmax(torch.randn(B, L, V, generator=g, dtype=torch.float64) * 2, -1)
    z = torch.randn(B, L, V, generator=g, dtype=torch.float64) * 2
    batch = TrajectoryBatch(batch_id=7, labels=torch.tensor([3, 1]), prefix_len=P, tokens=tokens,
                            source=source)
    if topk is None:
        batch = batch.with_teacher(logprobs=t)
    else:
        vals, idx = t.topk(topk, -1)
        batch = batch.with_teacher(topk_values=vals, topk_indices=idx)
    return z, batch, t


def suffix(x: torch.Tensor) -> np.ndarray:
    """(B, L, ...) -> (B·(L−P), ...) numpy at the generated positions."""
    return x[:, P:].reshape(B * (L - P), *x.shape[2:]).numpy()


def np_varkd(z, t, cfg: VarKD) -> float:
    """The VarKD docstring, step by step, in float64 numpy."""
    p1 = np.exp(suffix(t))                                          # teacher at τ = 1
    h = -np.sum(p1 * np.log(p1), -1)
    if cfg.weighting == "gate":
        w = (h <= cfg.entropy_gate).astype(float)
    elif cfg.weighting == "exp":
        w = np.exp(-h / cfg.weight_temperature)
    else:
        w = np.ones_like(h)
    pt = np_softmax(np.log(p1), cfg.teacher_temperature)
    k = min(cfg.smoothing_topk, pt.shape[-1])
    u = np.zeros_like(pt)
    for i, row in enumerate(pt):
        u[i, np.argsort(-row)[:k]] = 1.0 / k
    target = (1 - cfg.smoothing) * pt + cfg.smoothing * u
    q = np_softmax(suffix(z), cfg.temperature)
    d = np_jsd(target, q, cfg.beta)
    return float(np.sum(w * d) / np.sum(w)) if w.sum() > 0 else 0.0


# -- values -------------------------------------------------------------------------------------


def test_kd_hand_computed():
    # one suffix position: teacher (1/2, 1/2), student (1/4, 3/4) -> KL = ln(4/3)/2
    z = torch.log(torch.tensor([[[0.5, 0.5], [0.25, 0.75]]], dtype=torch.float64))
    t = torch.log(torch.tensor([[[0.9, 0.1], [0.5, 0.5]]], dtype=torch.float64))
    batch = TrajectoryBatch(0, torch.tensor([0]), 1, torch.tensor([[0, 1]]), source="data", teacher_logprobs=t)
    loss, metrics = get_objective("kd").loss(z, batch)
    assert loss.item() == pytest.approx(0.5 * math.log(4 / 3), abs=1e-12)
    assert metrics["tokens"] == 1.0 and metrics["on_policy"] == 0.0


@pytest.mark.parametrize("tau", [1.0, 0.5])
def test_kd_matches_reference(tau):
    z, batch, t = make("data")
    loss, metrics = get_objective("kd", temperature=tau).loss(z, batch)
    ref = np_kl(np_softmax(suffix(t), tau), np_softmax(suffix(z), tau)).mean()
    assert loss.item() == pytest.approx(ref, rel=1e-10)
    assert metrics["loss"] == pytest.approx(ref, rel=1e-10)
    assert metrics["tokens"] == B * (L - P)


def test_seqkd_hand_computed_and_reference():
    z = torch.log(torch.tensor([[[0.5, 0.5], [0.25, 0.75], [0.4, 0.6]]], dtype=torch.float64))
    batch = TrajectoryBatch(0, torch.tensor([0]), 1, torch.tensor([[0, 1, 0]]), source="teacher")
    loss, _ = get_objective("seqkd").loss(z, batch)
    assert loss.item() == pytest.approx(-(math.log(0.75) + math.log(0.4)) / 2, abs=1e-12)

    z, batch, _ = make("teacher")
    loss, _ = get_objective("seqkd").loss(z, batch)
    q = np_softmax(suffix(z))
    ref = -np.log(q[np.arange(len(q)), suffix(batch.tokens)]).mean()
    assert loss.item() == pytest.approx(ref, rel=1e-10)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("source", ["student", "data"])
def test_gkd_matches_reference(beta, source):
    z, batch, t = make(source)
    loss, metrics = get_objective("gkd", beta=beta, temperature=0.9).loss(z, batch)
    ref = np_jsd(np_softmax(suffix(t), 0.9), np_softmax(suffix(z), 0.9), beta).mean()
    assert loss.item() == pytest.approx(ref, rel=1e-10)
    assert metrics["on_policy"] == float(source == "student")


@pytest.mark.parametrize("cfg", [
    dict(),
    dict(weighting="none", smoothing=0.0),
    dict(weighting="gate", entropy_gate=0.8, smoothing=0.2, smoothing_topk=2),
    dict(weighting="exp", weight_temperature=0.5, teacher_temperature=1.7, temperature=0.8, beta=0.3),
    dict(weighting="none", beta=1.0, smoothing=0.5, smoothing_topk=100),
])
def test_varkd_matches_reference(cfg):
    z, batch, t = make("student", seed=1)
    obj = get_objective("varkd", **cfg)
    loss, metrics = obj.loss(z, batch)
    assert loss.item() == pytest.approx(np_varkd(z, t, obj), rel=1e-10)
    p1 = np.exp(suffix(t))
    assert metrics["teacher_entropy"] == pytest.approx(np.mean(-np.sum(p1 * np.log(p1), -1)), rel=1e-10)


def test_varkd_gate_keeps_only_confident_positions():
    z, batch, t = make("student", seed=1)
    p1 = np.exp(suffix(t))
    h = -np.sum(p1 * np.log(p1), -1)
    gate = float(np.median(h))
    obj = get_objective("varkd", weighting="gate", entropy_gate=gate)
    loss, metrics = obj.loss(z, batch)
    assert metrics["kept_fraction"] == pytest.approx(np.mean(h <= gate))
    assert 0 < metrics["kept_fraction"] < 1
    # changing the student only at gated-out positions leaves the loss unchanged
    gated = torch.zeros(B, L, dtype=torch.bool)
    gated[:, P:] = torch.from_numpy(h > gate).view(B, L - P)
    z2 = z.clone()
    z2[gated] += 5.0 * torch.randn(int(gated.sum()), V, dtype=z.dtype)
    assert obj.loss(z2, batch)[0].item() == loss.item()
    # everything gated out: zero loss, zero gradient
    none = get_objective("varkd", weighting="gate", entropy_gate=-1.0)
    zg = z.clone().requires_grad_()
    zero, metrics = none.loss(zg, batch)
    zero.backward()
    assert zero.item() == 0.0 and metrics["kept_fraction"] == 0.0
    assert torch.equal(zg.grad, torch.zeros_like(zg))


@pytest.mark.parametrize("name,cfg,source", [
    ("kd", {"temperature": 0.7}, "data"),
    ("gkd", {"beta": 0.4}, "student"),
    ("varkd", {"weighting": "exp", "smoothing": 0.2, "smoothing_topk": 3}, "student"),
])
def test_topk_with_k_equal_vocab_equals_full(name, cfg, source):
    z, full, t = make(source, seed=2)
    _, topk, _ = make(source, seed=2, topk=V)
    obj = get_objective(name, **cfg)
    torch.testing.assert_close(obj.loss(z, topk)[0], obj.loss(z, full)[0], rtol=1e-12, atol=1e-12)


def test_topk_transport_runs_below_vocab():
    z, batch, _ = make("student", seed=3, topk=2)
    for name in ("gkd", "varkd"):
        loss, _ = get_objective(name).loss(z, batch)
        assert torch.isfinite(loss) and loss.item() > 0


# -- masking and gradients ----------------------------------------------------------------------


@pytest.mark.parametrize("name,source", [("kd", "data"), ("seqkd", "teacher"), ("gkd", "student"),
                                         ("varkd", "student")])
def test_prefix_positions_do_not_matter(name, source):
    z, batch, _ = make(source, seed=4)
    obj = get_objective(name)
    z2 = z.clone()
    z2[:, :P] = torch.randn(B, P, V, dtype=z.dtype) * 10
    assert obj.loss(z2, batch)[0].item() == obj.loss(z, batch)[0].item()
    z3 = z.clone()
    z3[:, P:] += torch.randn(B, L - P, V, dtype=z.dtype)
    assert obj.loss(z3, batch)[0].item() != obj.loss(z, batch)[0].item()


@pytest.mark.parametrize("name,cfg,source,topk", [
    ("kd", {"temperature": 0.8}, "data", None),
    ("kd", {}, "data", 3),
    ("seqkd", {}, "teacher", None),
    ("gkd", {"beta": 0.5, "temperature": 0.8}, "student", None),
    ("gkd", {"beta": 0.2}, "data", 3),
    ("varkd", {}, "student", None),
    ("varkd", {"weighting": "gate", "entropy_gate": 1.0, "teacher_temperature": 1.3}, "student", 3),
])
def test_gradcheck(name, cfg, source, topk):
    z, batch, _ = make(source, seed=5, topk=topk)
    obj = get_objective(name, **cfg)
    z = z.requires_grad_()
    assert torch.autograd.gradcheck(lambda x: obj.loss(x, batch)[0], (z,))


# -- sources, registry, config ------------------------------------------------------------------


def test_declared_needs_and_sources():
    assert set(OBJECTIVES) >= {"kd", "seqkd", "gkd", "varkd"}
    kd, seqkd, gkd, varkd = (get_objective(n) for n in ("kd", "seqkd", "gkd", "varkd"))
    assert kd.needs == gkd.needs == varkd.needs == ("full", "topk") and seqkd.needs == ("tokens",)
    # GKD's default λ is distill.lam's (opd/config/objective_settings.py): all on-policy
    assert (kd.source, seqkd.source, gkd.source, varkd.source) == ("data", "teacher", "student", "student")
    assert get_objective("gkd", lam=0.5).source == "mixed"
    assert get_objective("gkd", lam=0.0).source == "data"
    assert kd.supports("topk") and not seqkd.supports("full")
    assert [kd.choose_source(s, 0) for s in range(3)] == ["data"] * 3
    assert varkd.choose_source(5, 1) == "student" and seqkd.choose_source(5, 1) == "teacher"


def test_gkd_choose_source_is_seeded_and_follows_lambda():
    gkd = GKD(lam=0.3)
    a = [gkd.choose_source(s, seed=11) for s in range(2000)]
    assert a == [gkd.choose_source(s, seed=11) for s in range(2000)]
    assert a != [gkd.choose_source(s, seed=12) for s in range(2000)]
    assert set(a) == {"student", "data"}
    assert 0.27 < a.count("student") / len(a) < 0.33
    assert all(GKD(lam=1.0).choose_source(s, 3) == "student" for s in range(200))
    assert all(GKD(lam=0.0).choose_source(s, 3) == "data" for s in range(200))


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown objective 'gdk'"):
        get_objective("gdk")
    with pytest.raises(ValueError, match="no config key 'lambda'"):
        get_objective("gkd", **{"lambda": 0.5})
    with pytest.raises(ValueError, match="gkd.beta"):
        get_objective("gkd", beta=1.5)
    with pytest.raises(ValueError, match="varkd.weighting"):
        get_objective("varkd", weighting="softmax")
    with pytest.raises(ValueError, match="kd.temperature"):
        get_objective("kd", temperature=0.0)
    z, batch, _ = make("student")
    with pytest.raises(ValueError, match="takes batches from \\('data',\\)"):
        get_objective("kd").loss(z, batch)
    with pytest.raises(ValueError, match="needs teacher transport"):
        get_objective("gkd").loss(z, batch.with_teacher())
    with pytest.raises(ValueError, match="student_logits must be"):
        get_objective("gkd").loss(z[:, 1:], batch)
