"""The window policy's estimate of a round's tokens (rollout/window.py `Acceptance`,
`AcceptanceCounts`): the depth model, the factors per window and kind of round (drafts
proposed by the round before, or widened), and what the counts hold, in exact numbers from
hand-made counts."""
import pytest
import torch

from rollout.window import (PRIOR, STRENGTH, WINDOW_STRENGTH, Acceptance, AcceptanceCounts,
                            WindowPolicy)
from tests.rollout.tables import cost_table

CPU = torch.device("cpu")


def test_the_model_is_the_chain_of_the_depth_rates():
    a = Acceptance(3)
    a.add([10, 5, 0], [5, 4, 0])
    p1 = (5 + STRENGTH * PRIOR) / (10 + STRENGTH)                    # 0.5
    p2 = (4 + STRENGTH * p1) / (5 + STRENGTH)                        # 2 / 3
    assert a.rates() == pytest.approx([p1, p2, p2])                  # untried depth: the last
    assert a.model_expected() == pytest.approx([1, 1.5, 1.5 + 1 / 3, 1.5 + 1 / 3 + 2 / 9])
    assert a.expected() == a.model_expected()                        # no tallies: factors 1


def test_window_factors_by_kind_of_round():
    """Tallies: W 4 after a window >= 4 (its drafts proposed) 2 rounds, realised 3.0 of
    modelled 4.0 accepted drafts; W 4 widened from a narrower window 1 round, 0.5 of 2.0; W 2
    proposed 3 rounds, 3.3 of 3.0."""
    a = Acceptance(15, previous=4)
    a.windows({(4, True): (2, 3.0, 4.0), (4, False): (1, 0.5, 2.0), (2, True): (3, 3.3, 3.0)})
    c4 = (2 * 0.75 + WINDOW_STRENGTH) / (2 + WINDOW_STRENGTH)                   # 0.875
    c2 = (3 * 1.1 + WINDOW_STRENGTH) / (3 + WINDOW_STRENGTH)                    # 1.06
    c = a.window_factors()
    assert c[:4] == pytest.approx([1.0, c2, 1.0, c4])   # W 1: W 2's, W 3: W 2's, at most 1
    assert c[4:] == pytest.approx([c4] * 12)            # widened: no rounds, W 4's (proposed)
    a.previous = 2
    c4w = (1 * 0.25 + WINDOW_STRENGTH) / (1 + WINDOW_STRENGTH)                  # 0.75
    c = a.window_factors()
    assert c[:4] == pytest.approx([1.0, c2, 1.0, c4w])  # W 3, 4 widened from W 2
    assert c[4:] == pytest.approx([c4w] * 12)
    model = a.model_expected()                          # prior chain 1, 1.5, 1.75, 1.875, ...
    assert a.expected()[3] == pytest.approx(1 + c4w * (model[3] - 1))
    assert a.expected_tokens(4) == pytest.approx(1 + 0.75 * 0.875)
    a.previous = 0                                      # after the prefill: every W widens
    assert a.window_factors()[1] == pytest.approx(c4w)  # W 2: the nearest wider, W 4's


def test_a_window_that_commits_less_than_modelled_loses_the_choice():
    """A round costs 1 + W / 8 (W 1: 1.125, 2: 1.25, 4: 1.5, 8: 2, 16: 3); the prior chain
    gives 1, 1.5, 1.875, 1.99, 2.0 tokens: W 4 wins (1.25 a unit of cost).  After W 4's
    rounds after W 4 realised a quarter of the model's drafts, c_4 = (40 / 4 + 2) / 42 = 2 / 7:
    W 4 gives 1.25 / 1.5, W 8 (W 4's factor) 1.28 / 2, W 2 (W 4's factor, its nearest)
    1.14 / 1.25 = 0.914 and wins over W 1's 0.889.  Before a round that would widen to W 4,
    the widened rounds count (none): W 4 again."""
    table = cost_table(8, lambda c, rows, W: 1.0 + W / 8)
    policy = WindowPolicy(table, (1, 2, 4, 8, 16), modes=("full",))
    a = Acceptance(15, rounds=2, previous=4)
    assert policy.choose(8, a) == (4, False)
    a.windows({(4, True): (40, 10 * 0.875 / 4, 10 * 0.875)})
    assert a.window_factors()[3] == pytest.approx(2 / 7)
    assert a.expected_tokens(8) == pytest.approx(1 + 2 / 7 * (a.model_expected()[7] - 1))
    assert a.expected_tokens(2) == pytest.approx(1 + 2 / 7 * 0.5)
    assert policy.choose(8, a) == (2, False)
    a.previous = 2
    assert policy.choose(8, a) == (4, False)


def test_counts_by_depth_and_the_windows_tallies():
    """Three rows: committed / accepted / rejected."""
    counts = torch.tensor([[3, 1, 2], [2, 0, 1], [0, 1, 1]])   # accepted 2, 0, 1; rej 0, 1, 1
    seen = AcceptanceCounts(3, CPU)
    live = torch.ones(3, dtype=torch.bool)
    first = Acceptance(3)                                # chose the rounds: prior model
    seen.add(counts, 4, first)                           # after the prefill: nothing proposed
    A, a = seen.read(live)
    assert (A, a.reached, a.rounds, a.previous) == (3, [0, 0, 0], 1, 4)
    assert a.window_tallies == {(4, False): (1, pytest.approx(1.0), pytest.approx(0.875))}
    seen.add(counts, 2, a)       # after W 4: depth 1 counted
    seen.add(counts, 4, a)       # widened from W 2: depth 1 only
    seen.add(counts, 4, a)       # after W 4: depths 1-3; depth 2: rows 0 (took) and 2
    A, a = seen.read(torch.tensor([True, False, True]))
    assert (A, a.reached, a.accepted, a.rounds) == (2, [9, 2, 0], [6, 1, 0], 4)
    t = a.window_tallies
    assert set(t) == {(4, False), (2, True), (4, True)}
    m2, m4 = 0.5, 0.875                  # what the prior chain (`first`'s read) predicted
    assert t[2, True] == (1, pytest.approx(1.0), pytest.approx(m2))      # 3 drafts / 3 rows
    assert t[4, True] == (1, pytest.approx(1.0), pytest.approx(m4))
    assert t[4, False] == (2, pytest.approx(2.0), pytest.approx(0.875 + m4))
    finished = torch.tensor([[0, 2, 0], [0, 1, 0], [0, 0, 0]])          # row 0, 2 finished
    seen.add(finished, 4, a)
    _, a = seen.read(live)
    assert a.window_tallies[4, True][:2] == (2, pytest.approx(2.0))      # 1 draft / 1 row


def test_only_drafts_a_previous_round_proposed_are_counted():
    """A round's depth k counts only when the round before had k drafts (W - 1) or more: the
    first round after W 1 (drafts from history, no proposal) teaches nothing."""
    counts = torch.tensor([[3, 1, 2], [2, 0, 1], [0, 1, 1]])
    seen = AcceptanceCounts(3, CPU)
    live = torch.ones(3, dtype=torch.bool)
    seen.add(counts, 1)
    seen.add(counts, 4)          # after W 1: nothing
    assert seen.read(live)[1].reached == [0, 0, 0]
    seen.add(counts, 2)          # after W 4: depth 1
    a = seen.read(live)[1]
    assert (a.reached, a.accepted, a.rounds) == ([3, 0, 0], [2, 0, 0], 3)
    assert a.window_tallies == {}                        # no acceptance given: no tallies
