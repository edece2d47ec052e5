"""The learner's learning-rate schedule: linear warm-up, then constant or linear decay."""
import pytest
import torch

from opd.config.schema import load_config
from opd.distill.steps import set_learning_rate
from opd.distill.phases import learning_rate


def test_warmup_then_linear_decay_to_ten_percent():
    cfg = load_config(None, ["distill.phases=[]", "learner.lr=0.01", "learner.warmup_steps=4",
                             "distill.steps=100", "learner.lr_decay=linear"])
    lrs = [learning_rate(cfg, s) for s in range(100)]
    assert lrs[:4] == pytest.approx([0.01 * (0.25 * k) * (0.1 + 0.9 * (1 - (k - 1) / 100))
                                     for k in (1, 2, 3, 4)], rel=1e-12)
    assert lrs[50] == pytest.approx(0.01 * (0.1 + 0.9 * 0.5), rel=1e-12)
    assert lrs[99] == pytest.approx(0.01 * (0.1 + 0.9 * 0.01), rel=1e-12)
    assert learning_rate(cfg, 500) == pytest.approx(0.001, rel=1e-12)   # past the end: 10 %


def test_constant_without_warmup_and_decay():
    cfg = load_config(None, ["distill.phases=[]", "learner.lr=0.02", "learner.warmup_steps=0",
                             "learner.lr_decay=none"])
    assert {learning_rate(cfg, s) for s in (0, 1, 10, 10_000)} == {0.02}
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    set_learning_rate(opt, learning_rate(cfg, 3))
    assert [g["lr"] for g in opt.param_groups] == [0.02]
