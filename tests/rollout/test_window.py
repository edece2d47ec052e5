"""The window policy (W="auto", rollout/window.py) in the engine: greedy tokens equal to Cached
AR's while W and Full / Compact change between rounds, execution-mode invariance for a given
schedule, and a policy that peeks at the round it chooses for (the round's own acceptance)
caught by the exact-enumeration statistics of tests/rollout/test_distribution.py.

The tests steer the windows by schedules (tests/rollout/schedules.py) where they need them to
change, so their choices are the same on every machine; the rule itself is tested on given
seconds and tokens, never a timing, in tests/rollout/test_window_rule.py."""
import time
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

import rollout.hbsjd
import rollout.window
from rollout import make_engine
from rollout.rounds import full_round
from rollout.jacobi import one_hot, rewindow
from rollout.window_calls import AR, CallWindows
from tests.rollout.schedules import graded, steer, switching, widest

from tests.rollout.test_distribution import chi2_pvalue, exact_distribution, peaked_model

T = 16


def engines():
    """(options, schedule) pairs: the measured policy, and schedules that switch W and the mode
    between rounds (tests/rollout/schedules.py)."""
    yield dict(window="auto"), None
    yield dict(window="auto"), switching
    yield dict(window="auto", execution="full"), switching
    yield dict(window="auto", execution="compact"), switching
    yield dict(window="auto", candidates=3), switching
    yield dict(window="auto"), graded


@pytest.mark.parametrize("cfg", [None, 2.0])
@pytest.mark.parametrize("P,B,slots", [(0, 1, None), (0, 8, None), (5, 6, None), (3, 8, 3)])
def test_policy_returns_cached_ar_tokens(tiny, batch, cfg, P, B, slots):
    model = tiny(2)
    labels, prefix = batch(model, B, P, 1)
    ref = make_engine("cached_ar").generate(model, labels, prefix, T - P, cfg_scale=cfg)
    seen = set()
    for opts, schedule in engines():
        with steer(schedule) if schedule else nullcontext():
            res = make_engine("hbsjd", **opts).generate(model, labels, prefix, T - P,
                                                        cfg_scale=cfg, slots=slots)
        assert torch.equal(res.tokens, ref.tokens), (opts, schedule)
        assert res.committed.sum(0).tolist() == [T - P] * B
        assert len(res.windows) == res.rounds and res.windows[0] == 0
        seen |= set(res.windows[1:])
    assert len(seen) >= 2                                # the windows did change


def test_greedy_windows_and_modes_switch_within_one_rollout(tiny, batch):
    model = tiny(2)
    labels, prefix = batch(model, 8, 0, 1)
    with steer(switching):
        res = make_engine("hbsjd", window="auto").generate(model, labels, prefix, T)
    pairs = set(zip(res.windows[1:], res.modes[1:]))
    assert (15, "full") in pairs and any(m == "compact" for _, m in pairs), pairs
    assert len({w for w, _ in pairs}) >= 2, pairs
    assert sum(res.window_histogram(16)) == res.rounds - 1


@pytest.mark.parametrize("decoding", ["greedy", "sample", "speculative"])
def test_execution_mode_and_repeated_calls_do_not_change_the_tokens(tiny, batch, decoding):
    """A schedule of the round only: Full, Compact and Hybrid run the same windows, so their
    tokens are the same (invariant 3 for given windows); a second call repeats the first."""
    model = tiny(1)
    labels, prefix = batch(model, 6, 2, 1)
    out = {}
    for execution in ("full", "compact", "hybrid", "hybrid"):
        with steer(lambda policy, active: (policy.windows[policy.round % 3], False)):
            out.setdefault(execution, []).append(make_engine(
                "hbsjd", window="auto", execution=execution, decoding=decoding).generate(
                    model, labels, prefix, T - 2, cfg_scale=2.0, seed=3, temperature=0.9,
                    top_k=8))
    full = out["full"][0]
    assert len(set(full.windows[1:])) >= 2, full.windows
    for res in (out["compact"][0], *out["hybrid"]):
        assert torch.equal(res.tokens, full.tokens) and res.windows == full.windows
        assert torch.equal(res.logprobs, full.logprobs)


def test_a_fixed_window_is_unchanged(tiny, batch):
    model = tiny(2)
    labels, prefix = batch(model, 5, 1, 1)
    res = make_engine("hbsjd", window=4, decoding="sample").generate(model, labels, prefix, T - 1,
                                                                seed=2)
    assert set(res.windows[1:]) == {4}
    assert res.window_histogram(16)[3] == res.rounds - 1


def _handed(stream) -> list:
    return [(type(x).__name__, getattr(x, "start", None), x.tokens.tolist(), x.logprobs.tolist())
            for x in stream]


@pytest.mark.parametrize("decoding", ["greedy", "sample"])
def test_a_call_given_to_cached_ar_is_cached_ars(tiny, batch, monkeypatch, decoding):
    """Where the call rule picks the `AR` arm (rollout/window_calls.py), W "auto"'s call is run
    by Cached AR: the same spans, images, tokens and log-probs as Cached AR's own call, its
    rounds counted as W 1's, and its seconds price the arm."""
    model = tiny(2)
    labels, prefix = batch(model, 8, 3, 1)
    kw = dict(cfg_scale=2.0, seed=5, slots=3, span=4)
    ref = make_engine("cached_ar", decoding=decoding).stream(model, labels, prefix, T - 3, **kw)
    offered = []

    def choose(self, windows, rates):
        offered.append(windows)
        self.pending = (AR, False)
        return AR
    monkeypatch.setattr(CallWindows, "choose", choose)
    engine = make_engine("hbsjd", window="auto", decoding=decoding)
    stream = engine.stream(model, labels, prefix, T - 3, **kw)
    assert _handed(stream) == _handed(ref)
    res = stream.result
    assert torch.equal(res.tokens, ref.result.tokens)
    assert torch.equal(res.logprobs, ref.result.logprobs)
    assert res.windows == [0] + [1] * (res.rounds - 1) and res.rounds == ref.result.rounds
    assert offered == [(AR, 1, 2, 4, 8, 12)]
    policy, = engine._policies.values()
    assert set(policy.calls.measured(offered[0])) == {AR}


def test_speculative_calls_are_never_given_to_cached_ar(tiny, batch, monkeypatch):
    """Speculative tokens depend on the windows run: no call of it is offered to Cached AR."""
    model = tiny(2)
    labels, prefix = batch(model, 4, 0, 1)
    offered, real = [], CallWindows.choose

    def choose(self, windows, rates):
        offered.append(windows)
        return real(self, windows, rates)
    monkeypatch.setattr(CallWindows, "choose", choose)
    engine = make_engine("hbsjd", window="auto", decoding="speculative")
    for seed in range(4):
        engine.generate(model, labels, prefix, T, seed=seed)
    assert len(offered) == 4 and all(AR not in w for w in offered)


def test_each_call_length_has_its_own_policy(tiny, batch):
    """Calls of 16 and 8 new tokens by turns through one engine: a policy for each length,
    offering the windows that length can use and pricing only its own calls (what a token
    costs moves with N, tests/rollout/test_window_calls.py); the first call of each runs the
    rounds' rule, which is not counted."""
    model = tiny(2)
    labels, prefix = batch(model, 4, 8, 1)
    engine = make_engine("hbsjd", window="auto", decoding="sample")
    for seed in range(6):
        P = 8 * (seed % 2)
        engine.generate(model, labels, prefix[:, :P], T - P, seed=seed)
    # the engine's policies by key: (model, rows, N, CFG, decoding)
    lengths = {key[2]: policy for key, policy in engine._policies.items()}
    assert sorted(lengths) == [8, 16]
    assert [lengths[N].calls.calls for N in (8, 16)] == [2, 2]
    assert all(W <= 7 for W in lengths[8].calls.cost)


def test_the_policy_prices_by_its_clock_without_the_consumer(tiny, batch, monkeypatch):
    """The policy measures rounds and calls on its clock (`policy_clock`: on a one-thread CPU
    process this thread's CPU seconds), and a streaming call's consumer is not on it.  Here a
    clock that ticks a second each time it is read, and that the consumer moves by 1000 s at
    each hand-out (images, spans): no round or call is priced at 1000 s or more; without
    `hand_out`'s accounting every call would carry several thousand."""
    assert rollout.window.policy_clock("cpu", 1) is time.thread_time
    assert rollout.window.policy_clock("cpu", 2) is time.perf_counter
    assert rollout.window.policy_clock("cuda", 1) is time.perf_counter
    now = [0.0]

    def clock():
        now[0] += 1.0
        return now[0]
    monkeypatch.setattr(rollout.hbsjd, "policy_clock", lambda device, threads: clock)
    model = tiny(2)
    labels, prefix = batch(model, 4, 0, 1)
    engine = make_engine("hbsjd", window="auto", decoding="sample")
    handed = 0
    for seed in range(4):
        for _ in engine.stream(model, labels, prefix, T, seed=seed, span=4):
            now[0] += 1000.0
            handed += 1
    (policy,) = engine._policies.values()
    assert handed >= 4 * 4 and policy.calls.calls == 3
    assert all(0 < m.mean < 1000 for m in policy.seconds.values() if m.weight)
    assert all(0 < m.mean * 4 * T < 1000 for m in policy.calls.cost.values() if m.weight)


def test_w_auto_needs_no_calibration_and_writes_none(tiny, batch, tmp_path):
    """The policy measures its own rounds: no calibration file is read or written."""
    model = tiny(0)
    labels, prefix = batch(model, 2, 0)
    path = tmp_path / "none.json"
    res = make_engine("hbsjd", window="auto", calibration=str(path)).generate(model, labels,
                                                                             prefix, T)
    assert res.committed.sum(0).tolist() == [T] * 2 and not path.exists()
    with pytest.raises(ValueError, match=r"'auto' \(HB-SJD"):
        make_engine("hbsjd", window="automatic")
    with pytest.raises(ValueError, match=r"must be an int >= 1, got 'auto'"):
        make_engine("sjd_independent", window="auto")


# ---- sampled decoding: exact distribution with W changing, and a policy that peeks -----------

SAMPLES = 4000


def sampled_counts(model, opts, prefix, cfg=None, seed=11, batch=SAMPLES, **warps):
    V, P = model.vocab_size, prefix.shape[1]
    N = model.block_size - P
    counts = torch.zeros(V ** N, dtype=torch.float64)
    windows = []
    for s in range(SAMPLES // batch):
        res = make_engine("hbsjd", **{"decoding": "speculative", **opts}).generate(
            model, torch.full((batch,), 1), prefix.expand(batch, -1), N, cfg_scale=cfg,
            seed=seed + s, **warps)
        code = (res.tokens[:, P:] * V ** torch.arange(N - 1, -1, -1)).sum(1)
        counts += torch.bincount(code, minlength=V ** N).double()
        windows += list(zip(res.windows[1:], res.modes[1:]))
    return counts, windows


VARYING = [  # model (seed, V, grid), P, options, cfg, warps
    ((7, 3, 2), 0, dict(), None, {}),
    ((7, 3, 2), 0, dict(refresh="resample"), 2.0, dict(temperature=0.8)),
    ((3, 2, 3), 0, dict(), None, {}),
    ((3, 2, 3), 2, dict(), 1.5, dict(top_p=0.9)),
    ((5, 4, 2), 0, dict(candidates=3), None, {}),
    ((3, 3, 3), 2, dict(candidates=3, branch=2), None, dict(temperature=1.2)),
    ((3, 2, 3), 0, dict(candidates=2, branch=3), None, {}),   # trees of W 4 in a state for 8
    ((7, 3, 2), 0, dict(decoding="sample"), 2.0, dict(temperature=0.8)),
    ((3, 3, 3), 2, dict(decoding="sample", candidates=3, branch=2), None, dict(temperature=1.2)),
]


@pytest.mark.parametrize("spec,P,opts,cfg,warps", VARYING)
def test_samples_follow_the_exact_distribution_while_the_window_changes(spec, P, opts, cfg,
                                                                       warps):
    """The windows switch W and Full / Compact between rounds (both schedules), with
    both refresh rules, CFG, warps and candidate drafting; decoding "speculative" unless the
    case says "sample" (whose tokens are Cached AR's, tests/rollout/test_keyed_sampling.py)."""
    seed, V, grid = spec
    model = peaked_model(seed, V, grid, 0.6 if grid == 2 else 0.5)
    prefix = torch.tensor([[1, 0, 1, 1]])[:, :P]
    probs = exact_distribution(model, 1, prefix, model.block_size - P, cfg, **warps)
    seen = set()
    for schedule in (switching, graded):
        with steer(schedule):
            counts, windows = sampled_counts(model, dict(window="auto", **opts), prefix, cfg,
                                             **warps)
        assert chi2_pvalue(counts, probs) > 1e-3
        assert {m for _, m in windows} == {"full", "compact"}
        seen |= {w for w, _ in windows}
    assert len(seen) >= 2, seen


@pytest.mark.xfail(strict=True, reason="a known bug: with speculative decoding, a W 1 round "
                   "(`jacobi.ar_round`) between wider ones skews the distribution; HB-SJD's policy "
                   "leaves W 1 out with that decoding (`HBSJD.policy`)")
def test_w1_rounds_between_wider_ones_keep_the_speculative_distribution():
    """Full rounds of W 1, 2, 4, 8 in turn: images of 9 binary tokens, 4000 samples
    for each of three seeds; the statistics reject (p 4e-4, 1e-2, 2e-3: the bug)."""
    model = peaked_model(3, 2, 3, 0.5)
    prefix = torch.zeros(1, 0, dtype=torch.long)
    probs = exact_distribution(model, 1, prefix, model.block_size, None)

    def cycle(policy, active):
        return policy.windows[policy.round % len(policy.windows)], False
    pvalues = []
    for seed in (11, 13, 14):
        with steer(cycle, also=(1,)):
            counts, windows = sampled_counts(model, dict(window="auto"), prefix, seed=seed)
        assert {w for w, _ in windows} == {1, 2, 4, 8}
        pvalues.append(chi2_pvalue(counts, probs))
    assert min(pvalues) > 1e-3 / 3, pvalues


def unshifted(st, old, new):
    """A wrong re-windowing: the old window's proposals kept by column, as if both windows
    started at the same token (they do not once a window is clipped at the end)."""
    if st.q is not None:
        B, V = st.cur.shape[0], st.q.shape[-1]
        col = new.ar.expand(B, new.W)
        tokens = st.seq.gather(1, st.cur.clamp(max=new.T - new.W)[:, None] + new.ar)
        q = st.q.gather(1, col.clamp(0, old.W - 1)[..., None].expand(B, new.W, V))
        st.q = torch.where((col < old.W)[..., None], q, one_hot(tokens, V, st.q.dtype))
    return st


def stepped(policy, active):
    """A schedule of the round index only (a function of the past, so lossless): Full W 3,
    then Compact W 2, then Compact W 3."""
    r = policy.round
    return (2 if r == 2 else 3), r >= 2


def exact_then_mutated(monkeypatch, model, schedule, mutation, windows: set) -> None:
    """Whole images of `model` sampled (16000) under a window `schedule` (in place of
    `WindowPolicy.choose`): they follow the exact distribution, take every (W, mode) of `windows`,
    and with `mutation` in place of `rewindow` they do not."""
    prefix = torch.zeros(1, 0, dtype=torch.long)
    probs = exact_distribution(model, 1, prefix, model.block_size, None)
    opts = dict(window="auto")
    monkeypatch.setattr("tests.rollout.test_window.SAMPLES", 4 * SAMPLES)
    with steer(schedule, also=(1,)):           # W 1 too (`HBSJD.policy` leaves it out)
        counts, seen = sampled_counts(model, opts, prefix)
        assert windows <= set(seen)
        assert chi2_pvalue(counts, probs) > 1e-3
        monkeypatch.setattr(rollout.hbsjd, "rewindow", mutation)
        counts, _ = sampled_counts(model, opts, prefix)
    assert chi2_pvalue(counts, probs) < 1e-8


def test_proposals_misaligned_across_a_window_change_are_detected(monkeypatch):
    """W steps 3 -> 2 -> 3 near the end of 4-token images: the same statistics accept the
    real re-windowing and reject `unshifted`."""
    exact_then_mutated(monkeypatch, peaked_model(5, 4, 2, 0.6), stepped, unshifted,
                       {(3, "full"), (2, "compact"), (3, "compact")})


def peeking(monkeypatch, model) -> None:
    """A wrong policy in place of the engine's (`hbsjd.execution` wrapped, the request taken
    from `hbsjd.run_jacobi`'s call): it runs the coming round at the largest window on a copy
    of the state and, where the first draft would be rejected, chooses W = 1 for it -- the
    token then comes from p instead of the residual: a rejected draft drawn again from p."""
    real_run, real_execution, call = rollout.hbsjd.run_jacobi, rollout.hbsjd.execution, {}

    def run_jacobi(model, req, *args, **kw):
        call["req"] = req
        return real_run(model, req, *args, **kw)

    def execution(active, left, gamma, policy, st, plan, plan_for, hold):
        big = plan_for(policy.largest)
        trial = rewindow(st.select(torch.arange(st.cur.shape[0])), plan, big)
        counts = full_round(model, trial, call["req"], big)
        W = 1 if bool(((counts[1] == 0) & (counts[2] == 1)).any()) else policy.largest
        chosen = SimpleNamespace(choose=lambda *_: (W, False), largest=policy.largest)
        return real_execution(active, left, gamma, chosen, st, plan, plan_for, hold)
    monkeypatch.setattr(rollout.hbsjd, "run_jacobi", run_jacobi)
    monkeypatch.setattr(rollout.hbsjd, "execution", execution)


def test_a_policy_that_peeks_at_its_round_is_detected(monkeypatch):
    """One image per call (the window is per call), 1000 of them: the real policy passes the
    statistics, the peeking one fails them."""
    model = peaked_model(7, 3, 2, 0.6)
    prefix = torch.zeros(1, 0, dtype=torch.long)
    probs = exact_distribution(model, 1, prefix, 4, None)
    opts = dict(window="auto")
    monkeypatch.setattr("tests.rollout.test_window.SAMPLES", 1000)
    with steer(widest):
        counts, windows = sampled_counts(model, opts, prefix, batch=1)
    assert {w for w, _ in windows} == {3}
    assert chi2_pvalue(counts, probs) > 1e-3
    peeking(monkeypatch, model)
    counts, windows = sampled_counts(model, opts, prefix, batch=1)
    assert {w for w, _ in windows} == {1, 3}
    assert chi2_pvalue(counts, probs) < 1e-8


