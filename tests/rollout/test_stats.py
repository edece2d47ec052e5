"""RolloutResult statistics: the committed-tokens histogram and the longest one-token run."""
import torch

from rollout import make_engine
from rollout.stats import RolloutResult


def result(committed, first_round=None) -> RolloutResult:
    c = torch.tensor(committed)
    zeros = torch.zeros(c.shape[1], dtype=torch.long)
    return RolloutResult(tokens=torch.zeros(c.shape[1], 1, dtype=torch.long), prefix_len=0,
                         committed=c, accepted=zeros, rejected=zeros, active=[], modes=[],
                         wall_time=0.0, first_round=first_round)


def test_histogram_and_stalls_of_a_known_schedule():
    # rounds x images; image 1 joins in round 2 (slots); image 2 stalls for three of its
    # rounds (an inactive round neither extends nor breaks a run)
    r = result([[1, 0, 1],
                [3, 0, 1],
                [1, 1, 1],
                [0, 4, 0],
                [2, 1, 1],
                [0, 1, 5]], first_round=torch.tensor([0, 2, 0]))
    assert r.commit_histogram(4) == [9, 1, 1, 2]          # 5 clamps into the last entry
    assert r.longest_single_run.tolist() == [1, 2, 3]     # a prefill round is not a stall
    assert r.mean_committed == 23 / 13


def test_engine_results_count_every_token_once(tiny, batch):
    model = tiny(2, vocab_size=5, grid_size=4)
    labels, prefix = batch(model, 6, 2, seed=4)
    res = make_engine("hbsjd", window=4, decoding="sample").generate(model, labels, prefix, 14,
                                                                slots=4)
    hist = res.commit_histogram(4)
    assert sum((k + 1) * n for k, n in enumerate(hist)) == 6 * 14
    assert sum(hist) == int(res.image_rounds.sum())
    ar = make_engine("cached_ar").generate(model, labels, prefix, 14, slots=4)
    assert ar.commit_histogram(4) == [6 * 14, 0, 0, 0]
    assert ar.longest_single_run.tolist() == [13] * 6    # every round after the prefill
