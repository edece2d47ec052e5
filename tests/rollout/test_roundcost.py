"""rollout.roundcost: one round's verifier forward and verification step, timed side by side,
and the aten operators of the verification step counted with torch.profiler."""
import pytest
import torch

from opd.models import create_model
from rollout import make_engine
from rollout.roundcost import count_ops, round_costs


def test_count_ops_separates_called_and_nested_operators():
    x = torch.ones(4)
    assert count_ops(lambda: (x + x).mul_(x)) == (2, 2)
    top, nested = count_ops(lambda: x.to(torch.float64))       # to -> _to_copy -> ...
    assert top == 1 and nested > 1


def test_round_costs_follow_the_rollout(tiny, batch):
    model = tiny(0)
    labels, prefix = batch(model, 5, 3, 0)
    engine = make_engine("hbsjd", window=4, decoding="sample", execution="full")
    res = engine.generate(model, labels, prefix, 13, seed=2)
    costs = round_costs(model, engine, labels, prefix, 13, seed=2, profiled=2)
    assert costs["rounds"] == res.rounds - 1                     # the prefill is no round
    assert costs["forward_ms"] > 0 and costs["verify_ms"] > 0
    assert 0 < costs["verify_ops"] < costs["verify_ops_nested"]
    other = round_costs(tiny(1), engine, labels, prefix, 13, seed=5, profiled=2)
    assert other["verify_ops"] == costs["verify_ops"]           # counts do not depend on weights


@pytest.fixture(scope="module")
def digits_student():
    """A digits-shaped student (V 17, 8x8 grid) with random weights: operator counts depend on
    shapes and options, not on values (no branch in a round reads a tensor)."""
    torch.manual_seed(0)
    return create_model("GPT-digits-S").eval()


def verify_ops(model, B, P, W, cfg=None, **opts):
    labels = torch.arange(B) % model.num_classes
    prefix = torch.randint(0, model.vocab_size, (B, P), generator=torch.Generator().manual_seed(0))
    engine = make_engine("hbsjd", window=W, execution="full", **opts)
    return round_costs(model, engine, labels, prefix, model.block_size - P, cfg_scale=cfg,
                       profiled=2)["verify_ops"]


# The verification step at batch 32, W 4 (before it was fused, speculative decoding called 190
# operators per round, 194 with CFG, greedy 61; docs/RESULTS.md, "The verification step").
# Decoding "sample" is greedy's step plus the keyed noise (rollout/sampling.py `perturb`: at
# the digits vocabulary one `gumbel` draw of some 24 operators).
BOUNDS = [(dict(decoding="speculative"), None, 96), (dict(decoding="speculative"), 2.0, 100),
          (dict(decoding="speculative", refresh="resample"), None, 89),
          (dict(decoding="sample"), None, 69), (dict(decoding="sample"), 2.0, 73),
          (dict(decoding="greedy"), None, 39)]


@pytest.mark.parametrize("opts,cfg,bound", BOUNDS)
def test_verification_step_operator_bound(digits_student, opts, cfg, bound):
    assert verify_ops(digits_student, 32, 40, 4, cfg, **opts) <= bound


@pytest.mark.parametrize("opts", [dict(decoding="sample"), dict(decoding="speculative"),
                                  dict(decoding="greedy"),
                                  dict(decoding="greedy", candidates=3)])
def test_operators_do_not_grow_with_rows_or_window(digits_student, opts):
    """No Python loop over rows or columns: the same operators at any batch and window."""
    counts = {verify_ops(digits_student, B, 40, W, **opts) for B, W in [(4, 4), (32, 4), (32, 16)]}
    assert len(counts) == 1, counts
