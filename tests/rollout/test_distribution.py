"""Invariant 2: probabilistic verification preserves the sampling distribution.

Vocabulary 3, grid 2 (4 image tokens): the exact joint distribution of the generated tokens is
enumerated with teacher-forced forwards (guided, warped), and the empirical distribution of
thousands of rollouts (one batch of images with distinct ids) is compared by a chi-square test.
The same test rejects a subtly wrong rule: resampling from p instead of norm(max(0, p - q))
after a rejection, ignoring q in the acceptance test, or a coupled refresh whose drafts are not
distributed as the q it records.

Every case here runs decoding "speculative" (speculative sampling); decoding "sample" (the
keyed Gumbel-max rule) has its cases in tests/rollout/test_keyed_sampling.py.  Every Jacobi
engine refreshes speculative drafts by maximal coupling by default (refresh="coupled"); the
cases cover both refresh rules.  A second, longer model (vocabulary 2, grid 3: 9 tokens,
512 sequences) gives coupling room to act: stale drafts several tokens past a rejection.
Sampled candidate drafting (recursive rejection over K candidates at the correction point,
rollout/candidates.py) runs on models with vocabularies of 3 to 5 (up to 625 sequences), with
a count of the branches that won, and a candidate accepted without the residual draw is
rejected by the same statistics.
"""
import itertools

import pytest
import torch
from scipy.stats import chi2

import rollout.verify
from rollout import make_engine
from rollout.sampling import guide, warp

V, GRID = 3, 2
SAMPLES = 4000


def peaked_model(seed: int, vocab: int, grid: int, std: float):
    torch.manual_seed(seed)
    from opd.models import create_model
    m = create_model("GPT-tiny", vocab_size=vocab, grid_size=grid).double().eval()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=std)
    return m


@pytest.fixture(scope="module")
def model():
    return peaked_model(7, V, GRID, 0.6)


def exact_distribution(model, label, prefix, N, cfg, temperature=1.0, top_k=None, top_p=None):
    """-> (V**N,) float64 probability of each generated sequence (lexicographic order)."""
    V = model.vocab_size
    seqs = torch.tensor(list(itertools.product(range(V), repeat=N)))
    M = seqs.shape[0]
    tokens = torch.cat([prefix.expand(M, -1), seqs], 1)
    labels = torch.full((M,), label)
    with torch.no_grad():
        logits = model(labels, tokens[:, :-1])
        if cfg is not None and cfg != 1.0:
            null = torch.full((M,), model.num_classes)
            logits = torch.cat([logits, model(null, tokens[:, :-1])])
    P = prefix.shape[1]
    probs = warp(guide(logits, cfg)[:, P:], temperature, top_k, top_p).double()   # (M, N, V)
    return probs.gather(2, seqs[..., None]).squeeze(2).prod(1)


def sample_counts(model, engine, label, prefix, N, cfg, seed, **warps):
    labels = torch.full((SAMPLES,), label)
    res = engine.generate(model, labels, prefix.expand(SAMPLES, -1), N, cfg_scale=cfg,
                          seed=seed, **warps)
    gen = res.tokens[:, prefix.shape[1]:]
    code = (gen * V ** torch.arange(N - 1, -1, -1)).sum(1)
    return torch.bincount(code, minlength=V ** N).double(), res


def chi2_pvalue(counts, probs) -> float:
    expected = probs / probs.sum() * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return float(chi2.sf(stat, int(keep.sum()) - 1))


CASES = [  # engine, options, P, cfg, warps
    ("cached_ar", {}, 0, None, {}),
    ("sjd_independent", dict(window=4), 0, None, {}),
    ("sjd_independent", dict(window=4, refresh="resample"), 0, None, {}),
    ("hbsjd", dict(window=4, execution="compact"), 0, 2.0, {}),
    ("hbsjd", dict(window=3, execution="hybrid", gamma=SAMPLES // 2), 1, None, {}),
    ("hbsjd", dict(window=3, execution="hybrid", gamma=SAMPLES // 2, refresh="resample"), 1, None,
     {}),
    ("hbsjd", dict(window=4, history_offset=1), 0, 1.5, dict(temperature=0.7, top_k=2)),
    ("hbsjd", dict(window=4), 0, None, dict(temperature=1.3, top_p=0.8)),
]


@pytest.mark.parametrize("name,opts,P,cfg,warps", CASES)
def test_samples_follow_the_exact_ar_distribution(model, name, opts, P, cfg, warps):
    prefix = torch.tensor([[2]])[:, :P]
    N = GRID * GRID - P
    engine = make_engine(name, decoding="speculative", **opts)
    counts, res = sample_counts(model, engine, 1, prefix, N, cfg, seed=11, **warps)
    probs = exact_distribution(model, 1, prefix, N, cfg, **warps)
    assert torch.isclose(probs.sum(), torch.tensor(1.0, dtype=torch.float64))
    assert chi2_pvalue(counts, probs) > 1e-3
    tv = 0.5 * (counts / SAMPLES - probs).abs().sum()
    assert tv < 0.05
    if name != "cached_ar":
        assert int(res.accepted.sum()) > SAMPLES // 4 and int(res.rejected.sum()) > SAMPLES // 10


def test_sync_sjd_samples_follow_the_exact_distribution(model):
    """Batch-Synchronous SJD in small batches (a huge batch would almost never accept)."""
    engine = make_engine("sjd_sync", window=4, decoding="speculative")
    prefix, N, B = torch.zeros(1, 0, dtype=torch.long), GRID * GRID, 4
    counts = torch.zeros(V ** N, dtype=torch.float64)
    accepted = 0
    for s in range(SAMPLES // (4 * B)):       # fewer samples: the loop is slower
        res = engine.generate(model, torch.full((B,), 2), prefix.expand(B, -1), N, seed=s)
        code = (res.tokens * V ** torch.arange(N - 1, -1, -1)).sum(1)
        counts += torch.bincount(code, minlength=V ** N).double()
        accepted += int(res.accepted.sum())
    probs = exact_distribution(model, 2, prefix, N, None)
    assert accepted > 0
    assert chi2_pvalue(counts, probs) > 1e-3


def test_a_wrong_resampling_rule_is_detected(model, monkeypatch):
    """Resampling from p after a rejection (instead of norm(max(0, p - q))) biases the
    distribution; the same statistics must reject it."""
    prefix, N, cfg = torch.zeros(1, 0, dtype=torch.long), GRID * GRID, None
    probs = exact_distribution(model, 1, prefix, N, cfg)
    monkeypatch.setattr(rollout.verify, "residual", lambda p, q: p)
    engine = make_engine("hbsjd", window=4, decoding="speculative")
    counts, _ = sample_counts(model, engine, 1, prefix, N, cfg, seed=11)
    assert chi2_pvalue(counts, probs) < 1e-8
    assert 0.5 * (counts / SAMPLES - probs).abs().sum() > 0.05


def test_a_wrong_acceptance_rule_is_detected(model, monkeypatch):
    """Accepting every draft with probability p(x) (ignoring q) is also caught."""
    prefix, N = torch.zeros(1, 0, dtype=torch.long), GRID * GRID
    probs = exact_distribution(model, 1, prefix, N, None)
    real = rollout.verify.verify_sample

    def ignore_q(p, drafts, q, *args):
        return real(p, drafts, torch.ones_like(q), *args)
    monkeypatch.setattr("rollout.jacobi.verify_sample", ignore_q)
    engine = make_engine("hbsjd", window=4, decoding="speculative")
    counts, _ = sample_counts(model, engine, 1, prefix, N, None, seed=11)
    assert chi2_pvalue(counts, probs) < 1e-8


# ---- coupled refresh on longer sequences --------------------------------------------------

V2, GRID2 = 2, 3


@pytest.fixture(scope="module")
def long_model():
    return peaked_model(3, V2, GRID2, 0.5)


def long_counts(model, engine, prefix, cfg, seed, **warps):
    P, N = prefix.shape[1], GRID2 * GRID2 - prefix.shape[1]
    labels = torch.full((SAMPLES,), 1)
    res = engine.generate(model, labels, prefix.expand(SAMPLES, -1), N, cfg_scale=cfg,
                          seed=seed, **warps)
    code = (res.tokens[:, P:] * V2 ** torch.arange(N - 1, -1, -1)).sum(1)
    return torch.bincount(code, minlength=V2 ** N).double(), res


def long_exact(model, prefix, cfg, **warps):
    return exact_distribution(model, 1, prefix, GRID2 * GRID2 - prefix.shape[1], cfg, **warps)


LONG_CASES = [  # engine, options, P, cfg, warps
    ("sjd_independent", dict(window=6), 0, None, {}),
    ("sjd_sync", dict(window=4), 0, None, {}),
    ("hbsjd", dict(window=6, execution="full", history_offset=1), 2, None, {}),
    ("hbsjd", dict(window=8, execution="compact"), 0, 2.0, dict(temperature=0.8)),
    ("hbsjd", dict(window=5, execution="hybrid", gamma=SAMPLES // 3), 3, 1.5, dict(top_p=0.9)),
    ("hbsjd", dict(window=8, execution="hybrid", gamma=SAMPLES // 2), 1, None,
     dict(temperature=1.2, top_k=2)),
]


@pytest.mark.parametrize("name,opts,P,cfg,warps", LONG_CASES)
def test_coupled_refresh_follows_the_exact_distribution(long_model, name, opts, P, cfg, warps):
    prefix = torch.tensor([[1, 0, 1]])[:, :P]
    engine = make_engine(name, decoding="speculative", refresh="coupled", **opts)
    if name == "sjd_sync":     # the batch minimum: small batches, half the samples (slow loop)
        counts = torch.zeros(V2 ** (GRID2 * GRID2 - P), dtype=torch.float64)
        for s in range(SAMPLES // 16):
            res = engine.generate(long_model, torch.full((8,), 1), prefix.expand(8, -1),
                                  GRID2 * GRID2 - P, cfg_scale=cfg, seed=s, **warps)
            code = (res.tokens[:, P:] * V2 ** torch.arange(8 - P, -1, -1)).sum(1)
            counts += torch.bincount(code, minlength=counts.numel()).double()
    else:
        counts, res = long_counts(long_model, engine, prefix, cfg, seed=5, **warps)
    probs = long_exact(long_model, prefix, cfg, **warps)
    assert chi2_pvalue(counts, probs) > 1e-3      # (512 cells: total variation is mostly noise)


def test_refresh_keeps_a_stale_draft_with_probability_min_1_p_over_q():
    """The coupling rule, exactly: draft x after the first rejection `a` is kept iff
    u * q(x) < p(x); a replaced draft comes from norm(max(0, p - q)); the last column (no stale
    draft) is drawn from p."""
    from rollout.verify import verify_sample
    col = torch.arange(4)[:, None]
    done, checked = torch.zeros(1, 4, 1, dtype=torch.bool), col < 3
    p = torch.tensor([[0.3, 0.7]]).repeat(4, 1)[None].double()          # (1, W=4, V=2)
    q = torch.tensor([[0.6, 0.4]]).repeat(4, 1)[None].double()          # (1, 4, 2)
    drafts = torch.tensor([[0, 0, 0, 0]])[..., None]
    u_accept = torch.full((1, 4, 1), 0.9, dtype=torch.float64)   # p/q = 0.5: column 0 rejected
    u_token = u_draft = torch.full((1, 4, 1), 0.1, dtype=torch.float64)  # p-sample: token 0
    # keep iff u < p(0) / q(0) = 0.5
    u_couple = torch.tensor([0.0, 0.49, 0.51, 0.0], dtype=torch.float64).view(1, 4, 1)
    u = torch.stack([u_accept, u_couple, u_token, u_draft])
    a, new = verify_sample(p, drafts, q, done, checked, u, col, coupled=True)
    assert int(a) == 0
    assert new.view(4).tolist() == [1, 0, 1, 0]   # 0, 2 from the residual [0, 0.3]; 1 kept
    # p == q keeps every stale draft, whatever u is
    p_eq = torch.cat([p[:, :1], q[:, 1:]], 1)             # column 0 still rejects draft 0
    a, new = verify_sample(p_eq, torch.tensor([[0, 1, 1, 1]])[..., None], q, done, checked,
                           torch.stack([u_accept, u_couple * 0 + 0.999, u_token, u_draft]),
                           col, True)
    assert int(a) == 0 and new.view(4).tolist() == [1, 1, 1, 0]
    a, new = verify_sample(p, drafts, q, done, checked,
                           torch.stack([u_accept, u_couple, u_token,
                                        torch.tensor([0.1, 0.5, 0.2, 0.9]).double().view(1, 4, 1)]),
                           col, coupled=False)
    assert int(a) == 0 and new.view(4).tolist() == [1, 1, 0, 1]  # resample: inverse CDF of p


def test_a_tree_path_couples_its_bonus_token_and_the_drafts_past_it():
    """On a candidate branch of one column only the root column is checked, but columns 1 and
    2 still hold drafts: the token at `a` = 1 (no draft checked there) keeps its stale draft
    with probability min(1, p / q), else comes from the residual, as the stale draft after it
    does; the column with no draft is drawn from p."""
    from rollout.verify import verify_sample
    col = torch.arange(4)[:, None]
    checked, drafted = col < 1, col < 3
    held = col == 0                                   # the root: chosen by the root column
    p = torch.tensor([[0.3, 0.7]]).repeat(4, 1)[None].double()          # (1, W=4, V=2)
    q = torch.tensor([[0.6, 0.4]]).repeat(4, 1)[None].double()
    drafts = torch.zeros(1, 4, 1, dtype=torch.long)
    u_accept = torch.full((1, 4, 1), 0.9, dtype=torch.float64)
    u_token = u_draft = torch.full((1, 4, 1), 0.1, dtype=torch.float64)  # p-sample: token 0
    got = []
    for keep_1, keep_2 in ((0.49, 0.51), (0.51, 0.49)):           # keep iff u < p/q = 0.5
        u_couple = torch.tensor([0.0, keep_1, keep_2, 0.0], dtype=torch.float64).view(1, 4, 1)
        a, new = verify_sample(p, drafts, q, held[None], checked, torch.stack(
            [u_accept, u_couple, u_token, u_draft]), col, True, drafted)
        got.append((int(a), new.view(4).tolist()))
    assert got == [(1, [0, 0, 1, 0]), (1, [0, 1, 0, 0])]   # residual [0, 0.3]: token 1
    a, new = verify_sample(p, drafts, q, held[None], checked, torch.stack(
        [u_accept, u_couple, u_token, u_draft]), col, True)         # drafted = checked
    assert (int(a), new.view(4).tolist()) == (1, [0, 0, 0, 0])     # all from p


def test_a_coupling_that_ignores_q_is_detected(long_model, monkeypatch):
    """Keeping every stale draft (no min(1, p/q) test) leaves drafts distributed as their old
    proposal while the verifier is told q = p: the statistics reject it."""
    import rollout.jacobi
    real = rollout.jacobi.verify_sample

    def keep_all(p, drafts, q, done, checked, u, *args):
        u = u.clone()
        u[1] = -1.0                               # the coupling test u * q(x) < p(x) passes
        return real(p, drafts, q, done, checked, u, *args)
    monkeypatch.setattr(rollout.jacobi, "verify_sample", keep_all)
    prefix = torch.zeros(1, 0, dtype=torch.long)
    engine = make_engine("hbsjd", window=8, decoding="speculative", refresh="coupled",
                         execution="full")
    counts, _ = long_counts(long_model, engine, prefix, None, seed=5)
    assert chi2_pvalue(counts, long_exact(long_model, prefix, None)) < 1e-8


# ---- candidate drafting at the correction point (rollout/candidates.py) --------------------

@pytest.fixture
def branch_wins(monkeypatch):
    """Counts the rows whose window was a tree and those a branch j > 0 won, so every case
    shows that its candidates were drafted and chosen."""
    import rollout.candidates
    real, seen = rollout.candidates.choose_path, {"tree": 0, "won": 0}

    def spy(root, offset, cand, on, tree):
        branch, path, valid = real(root, offset, cand, on, tree)
        seen["tree"] += int(on.sum())
        seen["won"] += int((branch > 0).sum())
        return branch, path, valid
    monkeypatch.setattr(rollout.candidates, "choose_path", spy)
    return seen


def candidate_counts(model, engine, prefix, cfg, **warps):
    """-> counts over the V ** N generated sequences and their exact probabilities."""
    V, P, N = model.vocab_size, prefix.shape[1], model.block_size - prefix.shape[1]
    res = engine.generate(model, torch.full((SAMPLES,), 1), prefix.expand(SAMPLES, -1), N,
                          cfg_scale=cfg, seed=11, **warps)
    code = (res.tokens[:, P:] * V ** torch.arange(N - 1, -1, -1)).sum(1)
    counts = torch.bincount(code, minlength=V ** N).double()
    return counts, exact_distribution(model, 1, prefix, N, cfg, **warps)


CANDIDATE_CASES = [  # model (seed, V, grid), P, engine, options, cfg, warps
    ((7, 4, 2), 0, "hbsjd", dict(window=4, candidates=4, execution="full"), None, {}),
    ((1, 4, 2), 0, "sjd_independent", dict(window=3, candidates=2), 2.0, dict(temperature=0.8)),
    ((5, 5, 2), 0, "hbsjd", dict(window=4, candidates=4, execution="compact"), 1.5, dict(top_k=3)),
    ((5, 4, 2), 0, "hbsjd", dict(window=4, candidates=4, branch=2, execution="hybrid",
                                 gamma=SAMPLES // 2), None, dict(temperature=1.3, top_p=0.9)),
    ((3, 3, 3), 3, "hbsjd", dict(window=6, candidates=2, branch=2, refresh="resample"), 2.0,
     dict(temperature=0.8)),
    ((3, 3, 3), 4, "hbsjd", dict(window=5, candidates=3, branch=2), None, {}),
]


@pytest.mark.parametrize("spec,P,name,opts,cfg,warps", CANDIDATE_CASES)
def test_sampled_candidates_follow_the_exact_distribution(branch_wins, spec, P, name, opts, cfg,
                                                          warps):
    """Recursive rejection at the correction point over K = 2..4 candidates, branches of 1 or
    2 columns, CFG, temperature, top-k / top-p, both refresh rules and every execution."""
    seed, V, grid = spec
    model = peaked_model(seed, V, grid, 0.6 if grid == 2 else 0.5)
    engine = make_engine(name, decoding="speculative", **opts)
    counts, probs = candidate_counts(model, engine, torch.tensor([[1, 0, 2, 1]])[:, :P], cfg,
                                     **warps)
    assert chi2_pvalue(counts, probs) > 1e-3
    assert branch_wins["tree"] > SAMPLES // 4 and branch_wins["won"] > SAMPLES // 20


def test_a_candidate_accepted_without_the_residual_draw_is_detected(branch_wins, monkeypatch):
    """After c_0's rejection a fixed candidate may only win when the residual's draw is it;
    accepting c_1 with its probability under p instead (the plain rule for a draft that was
    not drawn from q) biases the tokens, and the same statistics must reject it."""
    import rollout.candidates
    real = rollout.candidates.root_token

    def accept_c1_by_p(st, guided, p, offset, u, plan):
        root = real(st, guided, p, offset, u, plan)
        B, V = guided.shape[0], guided.shape[-1]
        col = offset.clamp(max=plan.W - 1).view(B, 1, 1)
        p0 = p.gather(1, col.expand(B, 1, V)).view(B, V)
        c0, c1 = st.seq.gather(1, st.cur[:, None]).view(B), st.cand[:, 1]
        take = (root != c0) & (u[2].gather(1, col).view(B) < p0.gather(1, c1[:, None]).view(B))
        return torch.where(take & st.on_tree, c1, root)
    model = peaked_model(3, 3, 3, 0.5)
    prefix = torch.tensor([[1, 0, 2, 1]])
    engine = make_engine("hbsjd", window=5, decoding="speculative", candidates=3, branch=2)
    counts, probs = candidate_counts(model, engine, prefix, None)
    assert chi2_pvalue(counts, probs) > 1e-3                 # the real rule, same samples
    monkeypatch.setattr(rollout.candidates, "root_token", accept_c1_by_p)
    counts, probs = candidate_counts(model, engine, prefix, None)
    assert chi2_pvalue(counts, probs) < 1e-8
    assert 0.5 * (counts / SAMPLES - probs).abs().sum() > 0.05


# ---- a bf16 model (the LlamaGen presets' model.dtype, opd/models/precision.py) --------------------

@pytest.fixture(scope="module")
def bf16_model():
    return peaked_model(7, V, GRID, 0.6).to(torch.bfloat16)


BF16_CASES = [  # engine, options, P, cfg, warps
    ("sjd_independent", dict(window=4), 0, None, {}),
    ("hbsjd", dict(window=4, execution="compact"), 0, 2.0, {}),
    ("hbsjd", dict(window=3, execution="hybrid", gamma=SAMPLES // 2), 1, 1.5, dict(temperature=0.8)),
]


@pytest.mark.parametrize("name,opts,P,cfg,warps", BF16_CASES)
def test_bf16_model_samples_follow_its_exact_distribution(bf16_model, name, opts, P, cfg, warps):
    """Weights and matmuls in bf16, distributions and acceptance in float32 (uniforms float64):
    the samples follow the exact enumeration of the same bf16 model's teacher-forced forwards
    (cached and uncached bf16 forwards differ by round-off only, far below what 4000 samples
    resolve)."""
    prefix = torch.tensor([[2]])[:, :P]
    N = GRID * GRID - P
    engine = make_engine(name, decoding="speculative", **opts)
    counts, res = sample_counts(bf16_model, engine, 1, prefix, N, cfg, seed=11, **warps)
    probs = exact_distribution(bf16_model, 1, prefix, N, cfg, **warps)
    assert torch.isclose(probs.sum(), torch.tensor(1.0, dtype=torch.float64), atol=1e-5)
    assert chi2_pvalue(counts, probs) > 1e-3
    assert 0.5 * (counts / SAMPLES - probs).abs().sum() < 0.05
    assert int(res.accepted.sum()) > SAMPLES // 4 and int(res.rejected.sum()) > SAMPLES // 10
    assert res.logprobs.dtype == torch.float32


def test_bf16_model_with_a_wrong_resampling_rule_is_detected(bf16_model, monkeypatch):
    """The same statistics still reject the wrong rule on the bf16 model: they have the power."""
    prefix, N = torch.zeros(1, 0, dtype=torch.long), GRID * GRID
    probs = exact_distribution(bf16_model, 1, prefix, N, None)
    monkeypatch.setattr(rollout.verify, "residual", lambda p, q: p)
    engine = make_engine("hbsjd", window=4, decoding="speculative")
    counts, _ = sample_counts(bf16_model, engine, 1, prefix, N, None, seed=11)
    assert chi2_pvalue(counts, probs) < 1e-8
