"""Invariant 3, one seed one sample: with decoding "sample" (the keyed Gumbel-max rule,
rollout/sampling.py `perturb`) a token is a function of its position's distribution and the
noise of (seed, image id, position), so every engine commits Cached AR's tokens: SJD (batch
minimum), Independent and HB-SJD at windows 1, 2, 4, 8 and 16 and W "auto" (measured, and
under two schedules that switch W and the mode between rounds), Full, Compact and Hybrid execution, batches and slot counts, candidate drafting,
CFG, temperature, top-k and top-p, compiled and eager.  Equality, not statistics; the
statistics (exact enumeration, as in tests/rollout/test_distribution.py) show that those
tokens follow the model's distribution.  Noise keyed by the round, or by the column of the
window, fails the same equality checks.
"""
import pytest
import torch

import rollout.jacobi
import rollout.sampling
from rollout import make_engine
from rollout.sampling import splitmix64
from tests.rollout.schedules import graded, steer, switching
from tests.rollout.test_distribution import (GRID, SAMPLES, chi2_pvalue, exact_distribution,
                                             peaked_model, sample_counts)

T = 16                            # GPT-tiny: grid 4
WINDOWS = (1, 2, 4, 8, 16)
ENGINES = [("sjd_sync", {}), ("sjd_independent", {}), ("hbsjd", dict(execution="full")),
           ("hbsjd", dict(execution="compact")), ("hbsjd", dict(execution="hybrid", gamma=3))]
SAMPLING = [dict(cfg_scale=None), dict(cfg_scale=2.0, temperature=0.8, top_k=4),
            dict(cfg_scale=1.5, temperature=1.3, top_p=0.8)]


def same(res, ref, what) -> None:
    assert torch.equal(res.tokens, ref.tokens), what
    assert torch.allclose(res.logprobs, ref.logprobs, rtol=0, atol=1e-6), what


def check_engines(model, labels, prefix, sampling: dict, slots=None, seed=7) -> None:
    """Every engine and window of ENGINES x WINDOWS, and W "auto" (measured, and under two schedules), commit
    Cached AR's tokens and log-probs (AssertionError naming the first that does not)."""
    from contextlib import nullcontext
    kw = dict(sampling, seed=seed, slots=slots)
    N = T - prefix.shape[1]
    ref = make_engine("cached_ar", decoding="sample").generate(model, labels, prefix, N, **kw)
    for W in WINDOWS:
        for name, opts in ENGINES:
            res = make_engine(name, window=W, decoding="sample", **opts).generate(
                model, labels, prefix, N, **kw)
            same(res, ref, (name, opts, W))
    for schedule in (None, switching, graded):
        for execution in ("full", "compact", "hybrid"):
            with steer(schedule) if schedule else nullcontext():
                res = make_engine("hbsjd", window="auto", execution=execution,
                                  decoding="sample").generate(model, labels, prefix, N, **kw)
            same(res, ref, ("auto", schedule, execution))


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("B,P,slots", [(1, 0, None), (5, 3, None), (7, 2, 3)])
def test_every_engine_and_window_commits_cached_ar_samples(tiny, batch, sampling, B, P, slots):
    model = tiny(2)
    labels, prefix = batch(model, B, P, 1)
    check_engines(model, labels, prefix, sampling, slots)


@pytest.mark.parametrize("sampling", SAMPLING[1:])
def test_a_large_vocabulary_commits_cached_ar_samples(tiny, batch, sampling):
    """Vocabulary 300: the two-level noise (rollout/sampling.py `perturb`) in every engine."""
    model = tiny(2, vocab_size=300)
    labels, prefix = batch(model, 5, 3, 1)
    check_engines(model, labels, prefix, sampling)


def test_the_equality_is_not_trivial(tiny, batch):
    """The cases above accept and reject drafts, and the seed changes the tokens."""
    model = tiny(2)
    labels, prefix = batch(model, 8, 0)
    res = make_engine("hbsjd", window=8, decoding="sample").generate(model, labels, prefix, T,
                                                                     seed=7)
    assert res.rounds < T and int(res.accepted.sum()) > 8 and int(res.rejected.sum()) > 0
    assert res.mean_committed > 1.5
    other = make_engine("cached_ar", decoding="sample").generate(model, labels, prefix, T, seed=8)
    assert not torch.equal(other.tokens, res.tokens)


@pytest.mark.parametrize("sampling", SAMPLING[1:])
@pytest.mark.parametrize("K,L", [(2, 1), (4, 2)])
def test_candidate_drafting_commits_cached_ar_samples(tiny, batch, sampling, K, L):
    """Candidates at the correction point (the next-best perturbed tokens among them) change
    the rounds, never the tokens; also in W "auto" and through slots."""
    model = tiny(3, grid_size=6, vocab_size=5)
    labels, prefix = batch(model, 7, 7, 3)
    N = model.block_size - 7
    for slots in (None, 3):
        kw = dict(sampling, seed=5, slots=slots)
        ref = make_engine("cached_ar", decoding="sample").generate(model, labels, prefix, N, **kw)
        won = 0
        for W in (2, 4, 8, 16, "auto"):
            for name, opts in (("sjd_independent", {}), ("hbsjd", dict(execution="hybrid",
                                                                        gamma=4))):
                if W == "auto":
                    if name != "hbsjd":
                        continue
                with steer(graded):
                    res = make_engine(name, window=W, candidates=K, branch=L, decoding="sample",
                                      **opts).generate(model, labels, prefix, N, **kw)
                same(res, ref, (name, opts, W, slots))
                won += int(res.accepted.sum())
        assert won > 0


def test_compiled_rounds_commit_cached_ar_samples(tiny, batch):
    """Compiled rounds (Full, Compact buckets, W "auto") and compiled Cached AR (backend
    "eager"; tests/rollout/test_compile.py also runs "aot_eager", inductor's input)."""
    backend = "eager"
    model = tiny(4, vocab_size=5, grid_size=4)
    labels, prefix = batch(model, 7, 2, seed=5)
    kw = dict(cfg_scale=2.0, seed=3, slots=4, temperature=0.9, top_k=4)
    ref = make_engine("cached_ar", decoding="sample").generate(model, labels, prefix, 14, **kw)
    for opts in (dict(window=4, execution="hybrid", gamma=3), dict(window=16),
                 dict(window="auto")):
        with steer(switching):
            res = make_engine("hbsjd", decoding="sample", compile=backend, **opts).generate(
                model, labels, prefix, 14, **kw)
        same(res, ref, opts)
    res = make_engine("cached_ar", decoding="sample", compile=backend).generate(
        model, labels, prefix, 14, **kw)
    same(res, ref, "compiled cached_ar")


# ---- mutations: noise that is not keyed by (seed, image, position) alone ------------------

def keyed_by_round(real):
    """jacobi_update whose noise also hashes the image's round counter."""
    def update(st, *args):
        key = st.key
        st.key = splitmix64(key ^ st.rounds)
        try:
            return real(st, *args)
        finally:
            st.key = key
    return update


def keyed_by_column(real):
    """perturb keyed by the column of the window instead of the token's position."""
    def perturb(guided, key, position, *warps):
        return real(guided, key, position - position[:, :1], *warps)
    return perturb


@pytest.mark.parametrize("target,mutation", [(rollout.jacobi, "jacobi_update"),
                                             (rollout.jacobi, "perturb")])
def test_noise_not_keyed_by_position_fails_the_equality(tiny, batch, monkeypatch, target,
                                                        mutation):
    model = tiny(2)
    labels, prefix = batch(model, 5, 3, 1)
    check_engines(model, labels, prefix, SAMPLING[1])
    wrong = (keyed_by_round if mutation == "jacobi_update" else keyed_by_column)
    monkeypatch.setattr(target, mutation, wrong(getattr(target, mutation)))
    with pytest.raises(AssertionError):
        check_engines(model, labels, prefix, SAMPLING[1])


# ---- the rule itself ----------------------------------------------------------------------

@pytest.mark.parametrize("V,warps", [(300, {}), (512, dict(top_k=40)), (257, dict(top_p=0.7)),
                                     (40, {})])
def test_the_rule_draws_from_p(V, warps):
    """40000 keyed draws from one distribution (above FLAT_VOCAB in blocks of
    `block_size(V)`, the last padded) follow p; masked tokens never come; shifting the logits
    changes no token."""
    from rollout.sampling import block_size, perturb
    assert block_size(16384) == 128 and block_size(V) == (V if V <= 256 else 32)
    logits = torch.randn(V, generator=torch.Generator().manual_seed(V)) * 2
    n = 40000
    key, position = torch.arange(n)[:, None] * 7919, torch.full((n, 1), 3)
    scores, p = perturb(logits.expand(n, V), key, position, 1.0, **{"top_k": None,
                                                                     "top_p": None, **warps})
    tokens = scores.argmax(-1)
    again, _ = perturb(logits.expand(n, V) + 5.0, key, position, 1.0,
                       **{"top_k": None, "top_p": None, **warps})
    assert torch.equal(again.argmax(-1), tokens)
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[p[0] == 0].sum() == 0
    assert chi2_pvalue(counts, p[0].double()) > 1e-3


# ---- the tokens follow the model's distribution (exact enumeration) ----------------------

KEYED_CASES = [  # engine, options, P, cfg, warps
    ("cached_ar", {}, 0, None, {}),
    ("hbsjd", dict(window=4, execution="compact"), 0, 2.0, {}),
    ("hbsjd", dict(window=3, execution="hybrid", gamma=SAMPLES // 2), 1, None,
     dict(temperature=0.7, top_k=2)),
    ("sjd_independent", dict(window=4, candidates=3), 0, 1.5, dict(temperature=1.3, top_p=0.8)),
    ("sjd_sync", dict(window=4), 0, None, {}),
]


@pytest.mark.parametrize("name,opts,P,cfg,warps", KEYED_CASES)
def test_keyed_samples_follow_the_exact_ar_distribution(name, opts, P, cfg, warps):
    """4000 images with distinct ids on a vocabulary of 3, grid 2: the chi-square test against
    the exact enumeration passes, with drafts accepted and rejected along the way."""
    model = peaked_model(7, 3, GRID, 0.6)
    prefix = torch.tensor([[2]])[:, :P]
    N = GRID * GRID - P
    engine = make_engine(name, decoding="sample", **opts)
    counts, res = sample_counts(model, engine, 1, prefix, N, cfg, seed=11, **warps)
    probs = exact_distribution(model, 1, prefix, N, cfg, **warps)
    assert chi2_pvalue(counts, probs) > 1e-3
    assert 0.5 * (counts / SAMPLES - probs).abs().sum() < 0.05
    if name != "cached_ar":
        assert int(res.accepted.sum()) > SAMPLES // 4 and int(res.rejected.sum()) > SAMPLES // 10


def test_a_wrong_noise_is_detected(monkeypatch):
    """Gumbel-max needs standard Gumbel noise: exponential noise (-log u) in its place biases
    the tokens, and the same statistics reject it."""
    model = peaked_model(7, 3, GRID, 0.6)
    prefix, N = torch.zeros(1, 0, dtype=torch.long), GRID * GRID
    probs = exact_distribution(model, 1, prefix, N, None)
    uniform = rollout.sampling.uniform
    monkeypatch.setattr(rollout.sampling, "gumbel",
                        lambda key, position, ids, stream: -uniform(key, position, ids,
                                                                    stream).log())
    counts, _ = sample_counts(model, make_engine("hbsjd", window=4, decoding="sample"), 1, prefix,
                              N, None, seed=11)
    assert chi2_pvalue(counts, probs) < 1e-8
