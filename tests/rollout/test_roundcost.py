"""rollout.roundcost: one round's verifier forward and verification step, timed side by side,
and the aten operators of the verification step counted with torch.profiler."""
import torch

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
    engine = make_engine("hbsjd", W=4, decoding="sample", execution="full")
    res = engine.generate(model, labels, prefix, 13, seed=2)
    costs = round_costs(model, engine, labels, prefix, 13, seed=2, profiled=2)
    assert costs["rounds"] == res.rounds - 1                     # the prefill is no round
    assert costs["forward_ms"] > 0 and costs["verify_ms"] > 0
    assert 0 < costs["verify_ops"] < costs["verify_ops_nested"]
    other = round_costs(tiny(1), engine, labels, prefix, 13, seed=5, profiled=2)
    assert other["verify_ops"] == costs["verify_ops"]           # counts do not depend on weights
