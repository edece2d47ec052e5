"""Greedy and probabilistic verification of one window, row by row."""
import torch

from rollout.sampling import keyed_uniform, sample_from
from rollout.verify import leading_true, residual, verify_greedy, verify_sample


def test_leading_true():
    ok = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert leading_true(ok).tolist() == [2, 0, 4]


def test_greedy_accepts_until_the_first_mismatch():
    argmax = torch.tensor([[4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7]])
    drafts = torch.tensor([[5, 6, 7], [5, 0, 7], [1, 6, 7], [5, 6, 7]])
    n_drafts = torch.tensor([3, 3, 3, 1])                  # last row: clipped window
    assert verify_greedy(argmax, drafts, n_drafts).tolist() == [0, 0, 0, 0]
    drafts = argmax[:, :3].clone()                         # draft i checked against pred i
    drafts[1, 1] = 0
    drafts[2, 0] = 1
    assert verify_greedy(argmax, drafts, n_drafts).tolist() == [3, 1, 0, 1]
    assert verify_greedy(argmax[:, :1], drafts[:, :0], n_drafts * 0).tolist() == [0] * 4


def uniforms(n, S, stream, seed=0):
    return keyed_uniform(torch.tensor(seed), torch.arange(n)[:, None], torch.arange(S)[None],
                         torch.tensor(0), stream)


def one_position(p0, q0, n=200_000):
    """Draft x ~ q0 at index 0, verified against p0; returns the token at index 0
    (accepted draft or resampled replacement) and the accept flags."""
    V = p0.shape[0]
    drafts = sample_from(q0.expand(n, V), uniforms(n, 1, 2)[:, 0])[:, None]
    p = torch.stack([p0, torch.full((V,), 1.0 / V)]).expand(n, 2, V)
    q = q0.expand(n, 1, V)
    acc, tok = verify_sample(p, drafts, q, torch.ones(n, dtype=torch.long), uniforms(n, 1, 1),
                             uniforms(n, 2, 0))
    out = torch.where(acc == 1, drafts[:, 0], tok)
    return out, acc


def test_speculative_sampling_reproduces_p_for_a_soft_proposal():
    p0 = torch.tensor([0.5, 0.1, 0.3, 0.1])
    q0 = torch.tensor([0.1, 0.6, 0.1, 0.2])
    out, acc = one_position(p0, q0)
    freq = torch.bincount(out, minlength=4).double() / out.numel()
    assert torch.allclose(freq, p0.double(), atol=4e-3)
    assert abs(float(acc.double().mean()) - float(torch.minimum(p0, q0).sum())) < 4e-3


def test_one_hot_draft_is_accepted_with_probability_p():
    p0 = torch.tensor([0.2, 0.7, 0.1])
    q0 = torch.tensor([0.0, 1.0, 0.0])                   # freshly initialised draft: token 1
    out, acc = one_position(p0, q0)
    assert abs(float(acc.double().mean()) - 0.7) < 4e-3
    freq = torch.bincount(out, minlength=3).double() / out.numel()
    assert torch.allclose(freq, p0.double(), atol=4e-3)
    assert (out[acc == 0] != 1).all()                    # the residual excludes the draft


def test_resampling_from_p_instead_of_the_residual_is_biased(monkeypatch):
    p0, q0 = torch.tensor([0.2, 0.7, 0.1]), torch.tensor([0.0, 1.0, 0.0])
    monkeypatch.setattr("rollout.verify.residual", lambda p, q: p)
    out, _ = one_position(p0, q0)
    freq = torch.bincount(out, minlength=3).double() / out.numel()
    assert abs(float(freq[1]) - (0.7 + 0.3 * 0.7)) < 5e-3    # 0.91, not 0.7


def test_bonus_token_comes_from_the_next_prediction():
    n, V = 50_000, 3
    p = torch.tensor([[0.3, 0.3, 0.4], [0.0, 0.25, 0.75]]).expand(n, 2, V)
    drafts = torch.full((n, 1), 2)
    q = p[:, :1]                                          # q = p: always accepted
    acc, tok = verify_sample(p, drafts, q, torch.ones(n, dtype=torch.long), uniforms(n, 1, 1),
                             uniforms(n, 2, 0))
    assert (acc == 1).all()
    freq = torch.bincount(tok, minlength=V).double() / n
    assert freq[0] == 0 and torch.allclose(freq, torch.tensor([0.0, 0.25, 0.75],
                                                              dtype=torch.float64), atol=0.01)


def test_rows_without_drafts_sample_from_p():
    n = 4
    p = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]).expand(n, 2, 3)
    acc, tok = verify_sample(p, torch.zeros(n, 1, dtype=torch.long), p[:, :1],
                             torch.zeros(n, dtype=torch.long), uniforms(n, 1, 1),
                             uniforms(n, 2, 0))
    assert acc.tolist() == [0] * n and tok.tolist() == [1] * n
    acc, tok = verify_sample(p[:, :1], torch.zeros(n, 0, dtype=torch.long), p[:, :0],
                             torch.zeros(n, dtype=torch.long), uniforms(n, 0, 1),
                             uniforms(n, 1, 0))                  # W = 1
    assert acc.tolist() == [0] * n and tok.tolist() == [1] * n


def test_residual_is_the_positive_part():
    p, q = torch.tensor([0.5, 0.2, 0.3]), torch.tensor([0.1, 0.6, 0.3])
    assert torch.allclose(residual(p, q), torch.tensor([0.4, 0.0, 0.0]))
