"""Rollout stats (opd/distill/rollout_stats.py): every field has a merge rule, the rules put
side-by-side rollout calls together as the whole batch's stats, and the wire forms are exact."""
import dataclasses

import pytest
import torch

from opd.distill.rollout_stats import (RULES, SUM, RolloutStats, check_rules, stat)
from rollout.stats import RolloutResult


def test_every_field_declares_a_merge_rule():
    for f in dataclasses.fields(RolloutStats):
        assert f.metadata.get("merge") in RULES, f.name


def test_a_field_without_a_rule_is_refused():
    @dataclasses.dataclass
    class Stats:
        counted: int = stat(0, SUM)
        forgotten: int = 0

    with pytest.raises(TypeError, match=r"Stats.forgotten has no merge rule"):
        check_rules(Stats)


def test_merge_adds_counts_takes_the_slowest_and_reweights_mean_committed():
    a = RolloutStats(generated_tokens=30, mean_committed=3.0, rounds=12, accepted=5,
                     engine="hbsjd", commit_hist=[1, 2], image_rounds=[4, 6], images=2,
                     image_rounds_sum=10, image_rounds_max=6, rollout_seconds=0.5)
    b = RolloutStats(generated_tokens=10, mean_committed=1.0, rounds=11, accepted=1,
                     engine="hbsjd", commit_hist=[3, 0], image_rounds=[10], images=1,
                     image_rounds_sum=10, image_rounds_max=10, rollout_seconds=0.75)
    m = RolloutStats.merge([a, b])
    assert m == RolloutStats(generated_tokens=40, mean_committed=40 / (10 + 10), rounds=12,
                             accepted=6, engine="hbsjd", commit_hist=[4, 2],
                             image_rounds=[4, 6, 10], images=3, image_rounds_sum=20,
                             image_rounds_max=10, rollout_seconds=0.75)
    assert m.row()["image_rounds_mean"] == 20 / 3
    assert RolloutStats.merge([RolloutStats(), RolloutStats()]) == RolloutStats()  # data steps
    one = RolloutStats.merge([a])
    one.image_rounds.append(1)
    assert a.image_rounds == [4, 6]                                     # a copy


def test_stats_of_a_rollout_result():
    committed = torch.tensor([[1, 1], [3, 1], [0, 2]])                  # (R, B)
    result = RolloutResult(tokens=torch.zeros(2, 2 + 6, dtype=torch.long), prefix_len=2,
                           committed=committed, accepted=torch.tensor([2, 1]),
                           rejected=torch.tensor([0, 1]), active=[2, 2, 1], modes=["full"] * 3,
                           wall_time=0.25, windows=[0, 4, 4], engine="hbsjd")
    s = RolloutStats.of(result, ar_rounds=6)
    assert (s.rounds, s.ar_rounds, s.generated_tokens, s.accepted, s.rejected) == (3, 6, 12, 3, 1)
    assert (s.image_rounds, s.image_rounds_max, s.image_rounds_sum, s.images) == ([2, 3], 3, 5, 2)
    assert s.mean_committed == 8 / 5 and s.rollout_seconds == 0.25
    assert s.commit_hist[:4] == [3, 1, 1, 0] and s.window_hist[3] == 2
    assert s.longest_single_run == 1


def test_dict_round_trip_and_unknown_keys():
    s = RolloutStats(rounds=3, commit_hist=[1, 0], engine="cached_ar")
    assert "window_hist" not in s.to_dict()                             # None is left out
    assert RolloutStats.from_dict(s.to_dict()) == s
    with pytest.raises(ValueError, match=r"unknown keys \['seconds'\]"):
        RolloutStats.from_dict({"seconds": 1.0})
