"""The one update both learners run (opd/distill/steps.py `optimizer_step`): the pre-clip global
gradient norm, clipping, the learning rate, and the DeepSpeed engine's path (a stand-in engine:
no DeepSpeed here)."""
import math

import pytest
import torch

from opd.distill.steps import grad_norm, optimizer_step, plain_model


def model_with_grads(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    m.train()
    (m(torch.randn(5, 3)) ** 2).sum().backward()
    return m


def norm64(m: torch.nn.Module) -> float:
    return math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in m.parameters()))


@pytest.mark.parametrize("clip", [0.0, 0.5, 1e6])
def test_torch_step_returns_the_pre_clip_norm_and_clips(clip):
    m, ref = model_with_grads(), model_with_grads()
    expected = norm64(m)
    opt = torch.optim.SGD(m.parameters(), lr=99.0)
    norm = optimizer_step(m, opt, grad_clip=clip, lr=0.1)
    assert norm == pytest.approx(expected, rel=1e-6)
    assert opt.param_groups[0]["lr"] == 0.1 and not m.training
    assert all(p.grad is None for p in m.parameters())
    scale = min(1.0, clip / (expected + 1e-6)) if clip > 0 else 1.0
    for p, q in zip(m.parameters(), ref.parameters()):          # SGD: p - lr · scale · g
        torch.testing.assert_close(p, q - 0.1 * scale * q.grad, rtol=1e-5, atol=1e-6)


class FakeEngine(torch.nn.Module):
    """What optimizer_step uses of a DeepSpeed engine."""

    def __init__(self, module, stage: int, norm: float | None):
        super().__init__()
        self.module, self.stage, self.norm, self.stepped = module, stage, norm, 0
        self.optimizer = torch.optim.SGD(module.parameters(), lr=1.0)

    def zero_optimization_stage(self) -> int:
        return self.stage

    def step(self):
        self.stepped += 1
        for p in self.module.parameters():
            p.grad = None

    def get_global_grad_norm(self):
        return self.norm


def test_engine_step_zero0_measures_the_norm_before_its_step():
    m = model_with_grads()
    expected = norm64(m)
    e = FakeEngine(m, stage=0, norm=None)
    assert optimizer_step(e, e.optimizer, grad_clip=1.0, lr=0.25) == pytest.approx(expected, rel=1e-6)
    assert (e.stepped, e.optimizer.param_groups[0]["lr"], m.training) == (1, 0.25, False)
    assert plain_model(e) is m and plain_model(m) is m


@pytest.mark.parametrize("reported, expected", [(2.5, 2.5), (None, math.nan)])
def test_engine_step_zero_2_reads_deepspeeds_norm(reported, expected):
    e = FakeEngine(model_with_grads(), stage=2, norm=reported)
    norm = optimizer_step(e, e.optimizer, grad_clip=1.0)
    assert e.stepped == 1
    assert norm == expected or (math.isnan(expected) and math.isnan(norm))


def test_grad_norm_without_gradients_is_none():
    assert grad_norm(torch.nn.Linear(2, 2)) is None
