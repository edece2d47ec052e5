"""Greedy and probabilistic verification of windows, in window columns (rollout/verify.py)."""
import torch

from rollout.sampling import image_key, sample_from, uniform
from rollout.verify import leading_true, residual, verify_greedy, verify_sample

COL = torch.arange(4)[:, None]                              # (W, 1) window columns, W = 4


def keyed(seed, image, position, attempt, stream):
    """The uniforms of (seed, image id, position, attempt, stream), as the engines draw them."""
    return uniform(image_key(seed, image), position, attempt, stream)


def test_leading_true():
    ok = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert leading_true(ok).tolist() == [[2], [0], [4]]
    assert leading_true(ok[..., None]).shape == (3, 1, 1)


def test_greedy_accepts_until_the_first_mismatch():
    pred = torch.tensor([4, 5, 6, 7]).expand(5, 4)[..., None]        # (B, W, 1)
    offset = torch.tensor([0, 0, 0, 2, 4]).view(5, 1, 1)    # row 3: clipped, row 4: finished
    done, checked = COL < offset, COL < 3
    drafts = torch.tensor([[5, 6, 7, 0], [5, 0, 7, 0], [1, 6, 7, 0], [5, 6, 7, 0],
                           [5, 6, 7, 0]])[..., None]
    assert verify_greedy(pred, drafts, done, checked).view(5).tolist() == [0, 0, 0, 2, 4]
    drafts = pred.clone()                                  # column c checks pred c
    drafts[1, 1] = 0
    drafts[2, 0] = 1
    drafts[:, 3] = 9                                       # the last column is no draft
    a = verify_greedy(pred, drafts, done, checked)
    assert (a - offset).view(5).tolist() == [3, 1, 0, 1, 0]           # accepted drafts
    one = verify_greedy(pred[:, :1], drafts[:, :1], COL[:1] < 0, COL[:1] < 0)    # W = 1
    assert one.view(5).tolist() == [0] * 5


def uniforms(n, S, stream, seed=0):
    return keyed(torch.tensor(seed), torch.arange(n)[:, None], torch.arange(S)[None],
                         torch.tensor(0), stream)


def stream_uniforms(n, W, seed=0):
    """(4, n, W, 1): acceptance test, coupling test, token at a, drafts after it."""
    return torch.stack([uniforms(n, W, s, seed) for s in (1, 3, 0, 2)])[..., None]


def verify(p, drafts, q, checked, coupled=True, u=None):
    n, W = drafts.shape[:2]
    u = stream_uniforms(n, W) if u is None else u
    return verify_sample(p, drafts, q, torch.zeros(n, W, 1, dtype=torch.bool), checked, u,
                         COL[:W], coupled)


def one_position(p0, q0, n=200_000):
    """Draft x ~ q0 in column 0 of a W = 2 window, verified against p0; returns the token
    of column 0 (accepted draft or resampled replacement) and the accept flags."""
    V = p0.shape[0]
    x = sample_from(q0.expand(n, V), uniforms(n, 1, 2, seed=1)[:, 0])
    drafts = torch.stack([x, torch.zeros_like(x)], 1)[..., None]
    p = torch.stack([p0, torch.full((V,), 1.0 / V)]).expand(n, 2, V)
    q = q0.expand(n, 2, V)
    a, tokens = verify(p, drafts, q, COL[:2] < 1)
    return tokens[:, 0, 0], a.view(n) == 1


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
    assert (out[~acc] != 1).all()                        # the residual excludes the draft


def test_resampling_from_p_instead_of_the_residual_is_biased(monkeypatch):
    p0, q0 = torch.tensor([0.2, 0.7, 0.1]), torch.tensor([0.0, 1.0, 0.0])
    monkeypatch.setattr("rollout.verify.residual", lambda p, q: p)
    out, _ = one_position(p0, q0)
    freq = torch.bincount(out, minlength=3).double() / out.numel()
    assert abs(float(freq[1]) - (0.7 + 0.3 * 0.7)) < 5e-3    # 0.91, not 0.7


def test_bonus_token_comes_from_the_next_prediction():
    n, V = 50_000, 3
    p = torch.tensor([[0.3, 0.3, 0.4], [0.0, 0.25, 0.75]]).expand(n, 2, V)
    drafts = torch.full((n, 2, 1), 2)
    a, tokens = verify(p, drafts, p, COL[:2] < 1)                 # q = p: always accepted
    assert (a == 1).all() and (tokens[:, 0] == 2).all()
    freq = torch.bincount(tokens[:, 1, 0], minlength=V).double() / n
    assert freq[0] == 0 and torch.allclose(freq, torch.tensor([0.0, 0.25, 0.75],
                                                              dtype=torch.float64), atol=0.01)


def test_rows_without_drafts_sample_from_p():
    n = 4
    p = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]).expand(n, 2, 3)
    drafts = torch.zeros(n, 2, 1, dtype=torch.long)
    a, tokens = verify(p, drafts, p, COL[:2] < 0)                 # nothing checked
    assert a.view(n).tolist() == [0] * n and tokens[:, 0, 0].tolist() == [1] * n
    a, tokens = verify(p[:, :1], drafts[:, :1], p[:, :1], COL[:1] < 0)          # W = 1
    assert a.view(n).tolist() == [0] * n and tokens[:, 0, 0].tolist() == [1] * n


def test_columns_committed_before_stay():
    """A clipped window's first columns hold committed tokens: kept, never checked."""
    p = torch.tensor([0.5, 0.5]).expand(1, 4, 2)
    drafts = torch.tensor([1, 1, 0, 0]).view(1, 4, 1)
    done = (COL < 2)[None]
    a, tokens = verify_sample(p, drafts, p, done, COL < 3, stream_uniforms(1, 4), COL, True)
    assert int(a) == 3 and tokens[0, :3, 0].tolist() == [1, 1, 0]     # q = p: accepted


def test_residual_is_the_positive_part():
    p, q = torch.tensor([0.5, 0.2, 0.3]), torch.tensor([0.1, 0.6, 0.3])
    assert torch.allclose(residual(p, q), torch.tensor([0.4, 0.0, 0.0]))


def reference_row(p, drafts, q, off, last, u, coupled):
    """The rules of rollout/verify.py for one window, column by column: p, q (W, V), drafts
    (W,), u (4, W) -> a, tokens (W,)."""
    W = p.shape[0]
    u_accept, u_couple, u_token, u_draft = u
    a = off
    while a < last and u_accept[a] * q[a, drafts[a]] < p[a, drafts[a]]:
        a += 1
    tokens = drafts.clone()
    for c in range(a, W):
        stale = coupled and c > a and c < last
        if stale and u_couple[c] * q[c, drafts[c]] < p[c, drafts[c]]:
            continue                                             # the stale draft is kept
        dist = p[c]
        if (c == a or stale) and c < last and residual(p[c], q[c]).sum() > 0:
            dist = residual(p[c], q[c])
        tokens[c] = sample_from(dist, u_token[c] if c == a else u_draft[c])
    return a, tokens


def test_fused_verification_equals_the_rules_row_by_row():
    """Random windows, clipped and finished rows, q equal to p in places (empty residuals)."""
    g = torch.Generator().manual_seed(0)
    B, W, V = 64, 5, 4
    p = torch.rand(B, W, V, generator=g) ** 3
    p /= p.sum(-1, keepdim=True)
    q = torch.rand(B, W, V, generator=g) ** 3
    q /= q.sum(-1, keepdim=True)
    q[::3] = p[::3]                                              # always accepted / kept
    drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, W, 1)
    off = torch.randint(0, W + 1, (B,), generator=g)            # W: a finished row
    off[:B // 2] = 0
    u = torch.rand(4, B, W, 1, generator=g, dtype=torch.float64)
    col = torch.arange(W)[:, None]
    for coupled in (True, False):
        a, tokens = verify_sample(p, drafts, q, col < off.view(B, 1, 1), col < W - 1, u, col,
                                  coupled)
        for b in range(B):
            ref_a, ref = reference_row(p[b], drafts[b, :, 0], q[b], int(off[b]), W - 1,
                                       u[:, b, :, 0], coupled)
            assert int(a[b]) == ref_a and torch.equal(tokens[b, :, 0], ref), (b, coupled)
