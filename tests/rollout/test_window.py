"""The window policy (W="auto", rollout/window.py): its rule in numbers, greedy tokens equal to
Cached AR's while W and Full / Compact change between rounds, execution-mode invariance for a
given policy, determinism, and a policy that peeks at the round it chooses for (the round's
own acceptance) caught by the exact-enumeration statistics of tests/rollout/test_distribution.py.

Every test uses a fixture cost table (tests/rollout/tables.py `cost_table`), never a timed one,
so the choices are the same on every machine."""
from types import SimpleNamespace

import pytest
import torch

import rollout.hbsjd
from rollout import make_engine
from rollout.hbsjd import full_round
from rollout.jacobi import one_hot, rewindow
from rollout.window import PRIOR, STRENGTH, Acceptance, CostTable, WindowPolicy
from tests.rollout.tables import cost_table

from tests.rollout.test_distribution import chi2_pvalue, exact_distribution, peaked_model

T = 16


def switching_table(R: int) -> CostTable:
    """Full costs the same at every W; Compact costs its rows times W: all rows active -> Full
    at the largest W; once few enough rows are active -> Compact at W = 1 (or 2 when drafts are
    likely accepted); in between the windows change with the acceptance seen."""
    return cost_table(R, lambda compact, rows, W: rows * W / R if compact else 1.0)


def test_cost_table_interpolates_over_rows_and_width():
    t = cost_table(8, lambda compact, rows, W: (rows if compact else 8) * (1 + W))
    assert t.cost(False, 8, 4) == 8 * 5 and t.cost(True, 3, 2) == 3 * 3
    assert t.cost(True, 3, 3) == pytest.approx(3 * 4)            # between W 2 and 4
    assert t.cost(True, 3, 6) == pytest.approx(3 * 7)            # between W 4 and 8
    assert t.cost(False, 8, 20) == pytest.approx(8 * 21)         # past W 16: the last segment


def test_acceptance_rates_and_expected_tokens_by_hand():
    a = Acceptance(3)
    assert a.rates() == [PRIOR] * 3 and a.expected_tokens(1) == 1.0
    assert a.expected_tokens(3) == pytest.approx(1 + 0.5 + 0.25)
    a.add([10, 6, 0], [6, 3, 0])            # depth 1: 6 of 10, depth 2: 3 of 6, depth 3: none
    r1 = (6 + STRENGTH * PRIOR) / (10 + STRENGTH)
    r2 = (3 + STRENGTH * r1) / (6 + STRENGTH)
    assert a.rates() == pytest.approx([r1, r2, r2])               # untried depth: the last
    assert a.expected_tokens(4) == pytest.approx(1 + r1 + r1 * r2 + r1 * r2 * r2)


def test_the_policy_maximises_expected_tokens_per_second():
    flat = cost_table(8, lambda c, rows, W: 1.0)
    linear = cost_table(8, lambda c, rows, W: float(W))
    windows = (1, 2, 4, 8, 16)
    a = Acceptance(15)
    assert WindowPolicy(flat, windows).choose(8, a) == (16, False)      # free drafts: longest
    assert WindowPolicy(linear, windows).choose(8, a) == (1, False)     # W costs W: Cached AR
    # Full costs 1 at every W, Compact rows * W / 8: with 2 rows active Compact W 1 costs 0.25,
    # W 2 costs 0.5: (1 + 0.5) / 0.5 = 3 < 1 / 0.25 = 4 -> W 1; Full W 16 gives < 2 / 1
    t = switching_table(8)
    assert WindowPolicy(t, windows).choose(8, a) == (16, False)
    assert WindowPolicy(t, windows).choose(2, a) == (1, True)
    assert WindowPolicy(t, windows, modes=("full",)).choose(2, a) == (16, False)
    sure = Acceptance(15)
    sure.add([1000] * 15, [1000] * 15)
    # every draft accepted: Full W 16 gives ~16 / 1, more than Compact W 1's 1 / 0.25
    assert WindowPolicy(t, windows).choose(2, sure) == (16, False)


def graded_table(R: int) -> CostTable:
    """Full and Compact both dearer at larger W (Compact in proportion to its rows): the
    windows step between several sizes >= 2 as rows finish and acceptance is measured."""
    return cost_table(R, lambda compact, rows, W: rows / R * (1 + 0.1 * W)
                                   if compact else 1.0 + 0.1 * W)


def engines(R: int):
    table = switching_table(R)
    yield dict(window="auto", costs=table)
    yield dict(window="auto", costs=table, execution="full")
    yield dict(window="auto", costs=table, execution="compact")
    yield dict(window="auto", costs=table, candidates=3)
    yield dict(window="auto", costs=cost_table(R, lambda c, rows, W: 1.0 + 0.2 * W))


@pytest.mark.parametrize("cfg", [None, 2.0])
@pytest.mark.parametrize("P,B,slots", [(0, 1, None), (0, 8, None), (5, 6, None), (3, 8, 3)])
def test_policy_returns_cached_ar_tokens(tiny, batch, cfg, P, B, slots):
    model = tiny(2)
    labels, prefix = batch(model, B, P, 1)
    ref = make_engine("cached_ar").generate(model, labels, prefix, T - P, cfg_scale=cfg)
    seen = set()
    for opts in engines(min(B, slots or B)):
        res = make_engine("hbsjd", **opts).generate(model, labels, prefix, T - P,
                                                    cfg_scale=cfg, slots=slots)
        assert torch.equal(res.tokens, ref.tokens), opts
        assert res.committed.sum(0).tolist() == [T - P] * B
        assert len(res.windows) == res.rounds and res.windows[0] == 0
        seen |= set(res.windows[1:])
    assert len(seen) >= 2                                # the windows did change


def test_greedy_windows_and_modes_switch_within_one_rollout(tiny, batch):
    model = tiny(2)
    labels, prefix = batch(model, 8, 0, 1)
    res = make_engine("hbsjd", window="auto", costs=switching_table(8)).generate(model, labels,
                                                                            prefix, T)
    pairs = set(zip(res.windows[1:], res.modes[1:]))
    assert (15, "full") in pairs and any(m == "compact" for _, m in pairs), pairs
    assert len({w for w, _ in pairs}) >= 2, pairs
    assert sum(res.window_histogram(16)) == res.rounds - 1


@pytest.mark.parametrize("decoding", ["greedy", "sample", "speculative"])
def test_execution_mode_and_repeated_calls_do_not_change_the_tokens(tiny, batch, decoding):
    """Costs that depend on W only: Full, Compact and Hybrid choose the same windows, so their
    tokens are the same (invariant 3 for a given policy); a second call repeats the first."""
    model = tiny(1)
    labels, prefix = batch(model, 6, 2, 1)
    table = cost_table(6, lambda c, rows, W: 1.0 + 0.1 * W)
    out = {}
    for execution in ("full", "compact", "hybrid", "hybrid"):
        out.setdefault(execution, []).append(make_engine(
            "hbsjd", window="auto", costs=table, execution=execution, decoding=decoding).generate(
                model, labels, prefix, T - 2, cfg_scale=2.0, seed=3, temperature=0.9, top_k=8))
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


def test_w_auto_without_a_calibration_names_the_command(tiny, batch, tmp_path):
    model = tiny(0)
    labels, prefix = batch(model, 2, 0)
    engine = make_engine("hbsjd", window="auto", calibration=str(tmp_path / "none.json"))
    with pytest.raises(ValueError, match=r"--window auto"):
        engine.generate(model, labels, prefix, T)
    with pytest.raises(ValueError, match=r"'auto' \(HB-SJD"):
        make_engine("hbsjd", window="automatic")
    with pytest.raises(ValueError, match=r"must be an int >= 1, got 'auto'"):
        make_engine("sjd_independent", window="auto")


def test_missing_costs_are_measured_once_and_saved(tiny, batch, tmp_path, monkeypatch):
    import rollout.calibrate as rc
    from rollout.window import WINDOWS
    measured = []
    real = rc.measure_verifier_latencies
    monkeypatch.setattr(rc, "measure_verifier_latencies", lambda model, batch, windows, **kw:
                        measured.append((batch, list(windows))) or real(
                            model, batch, windows, repeats=1, warmup=0, active=[1, batch]))
    model = tiny(0)
    labels, prefix = batch(model, 3, 0)
    path = tmp_path / "cal.json"
    for _ in range(2):
        engine = make_engine("hbsjd", window="auto", calibration=str(path), calibrate_missing=True)
        engine.generate(model, labels, prefix, T)
    assert measured == [(3, list(WINDOWS))]                  # one interleaved measurement
    assert {(e["batch"], e["W"]) for e in rc.read_calibration(path)} == {(3, W) for W in WINDOWS}


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
    """The policy switches W and Full / Compact between rounds (both fixture tables), with
    both refresh rules, CFG, warps and candidate drafting; decoding "speculative" unless the
    case says "sample" (whose tokens are Cached AR's, tests/rollout/test_keyed_sampling.py)."""
    seed, V, grid = spec
    model = peaked_model(seed, V, grid, 0.6 if grid == 2 else 0.5)
    prefix = torch.tensor([[1, 0, 1, 1]])[:, :P]
    probs = exact_distribution(model, 1, prefix, model.block_size - P, cfg, **warps)
    seen = set()
    for table in (switching_table(SAMPLES), graded_table(SAMPLES)):
        counts, windows = sampled_counts(model, dict(window="auto", costs=table, **opts), prefix,
                                         cfg, **warps)
        assert chi2_pvalue(counts, probs) > 1e-3
        assert {m for _, m in windows} == {"full", "compact"}
        seen |= {w for w, _ in windows}
    assert len(seen) >= 2, seen


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


def stepped(policy, active, acceptance, *rest):
    """A schedule of the round index only (a function of the past, so lossless): Full W 3,
    then Compact W 2, then Compact W 3."""
    r = acceptance.rounds + 1
    return (2 if r == 2 else 3), r >= 2


def exact_then_mutated(monkeypatch, model, schedule, mutation, windows: set) -> None:
    """Whole images of `model` sampled (16000) under a window `schedule` (in place of
    `WindowPolicy.choose`): they follow the exact distribution, take every (W, mode) of `windows`,
    and with `mutation` in place of `rewindow` they do not."""
    prefix = torch.zeros(1, 0, dtype=torch.long)
    probs = exact_distribution(model, 1, prefix, model.block_size, None)
    opts = dict(window="auto", costs=graded_table(SAMPLES))
    monkeypatch.setattr("tests.rollout.test_window.SAMPLES", 4 * SAMPLES)
    monkeypatch.setattr(WindowPolicy, "choose", schedule)
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

    def execution(active, gamma, acceptance, policy, st, plan, plan_for, hold):
        big = plan_for(policy.largest)
        trial = rewindow(st.select(torch.arange(st.cur.shape[0])), plan, big)
        counts = full_round(model, trial, call["req"], big)
        W = 1 if bool(((counts[1] == 0) & (counts[2] == 1)).any()) else policy.largest
        chosen = SimpleNamespace(choose=lambda *_: (W, False), largest=policy.largest)
        return real_execution(active, gamma, acceptance, chosen, st, plan, plan_for, hold)
    monkeypatch.setattr(rollout.hbsjd, "run_jacobi", run_jacobi)
    monkeypatch.setattr(rollout.hbsjd, "execution", execution)


def test_a_policy_that_peeks_at_its_round_is_detected(monkeypatch):
    """One image per call (the window is per call), 1000 of them: the real policy passes the
    statistics, the peeking one fails them."""
    model = peaked_model(7, 3, 2, 0.6)
    prefix = torch.zeros(1, 0, dtype=torch.long)
    probs = exact_distribution(model, 1, prefix, 4, None)
    opts = dict(window="auto", costs=cost_table(1, lambda c, rows, W: 1.0))
    monkeypatch.setattr("tests.rollout.test_window.SAMPLES", 1000)
    counts, windows = sampled_counts(model, opts, prefix, batch=1)
    assert {w for w, _ in windows} == {3}
    assert chi2_pvalue(counts, probs) > 1e-3
    peeking(monkeypatch, model)
    counts, windows = sampled_counts(model, opts, prefix, batch=1)
    assert {w for w, _ in windows} == {1, 3}
    assert chi2_pvalue(counts, probs) < 1e-8


# ---- the round's fixed cost and the probe rounds (hand-made tables) ---------------------------

def test_a_rounds_fixed_cost_makes_longer_windows_pay():
    """Forward W * 1 ms at every row count; prior acceptance 0.5 -> E[tokens] 1, 1.5, 1.875,
    ~2, ~2.  Without a fixed cost W 1 wins (1 / 1 against 1.5 / 2); with 3 ms per round W 2
    wins (1.5 / 5 = 0.3 against 1 / 4 = 0.25 and 1.875 / 7 = 0.27); with 20 ms W 4 (1.875 /
    24 against 1.5 / 22 and 1.99 / 28)."""
    fwd = lambda compact, rows, W: 1e-3 * W                                       # noqa: E731
    windows, a = (1, 2, 4, 8, 16), Acceptance(15)
    for fixed, W in ((None, 1), (3e-3, 2), (20e-3, 4)):
        t = cost_table(8, fwd, fixed=None if fixed is None else lambda W: fixed)
        assert WindowPolicy(t, windows, modes=("full",)).choose(8, a) == (W, False), fixed
    t = cost_table(8, fwd, fixed=lambda W: 1e-3 * (2 + W))  # fixed part grows too
    assert t.cost(False, 8, 4) == pytest.approx(4e-3 + 6e-3)
    assert t.cost(True, 3, 3) == pytest.approx(3e-3 + 5e-3)              # interpolated over W


def test_calibration_entries_carry_the_decodings_fixed_cost():
    entry = lambda W, g, s: dict(batch=4, active=[1, 4], full_s=[W, W, W],       # noqa: E731
                                 compact_s=[W / 4, W], overhead_s=dict(greedy=g, sample=s))
    entries = {1: entry(1.0, 0.5, 2.0), 2: entry(2.0, 0.5, 2.5)}
    greedy, sample = (CostTable.from_entries(entries, d) for d in ("greedy", "sample"))
    assert greedy.cost(False, 4, 1) == 1.5 and sample.cost(False, 4, 2) == 4.5
    assert sample.cost(True, 1, 1) == 0.25 + 2.0


def test_a_probe_replaces_w1_every_probe_th_round_and_learns_acceptance():
    from rollout.window import PROBE
    # a round costs W + 0.5: on the prior W 1's 1 / 1.5 beats W 2's 1.5 / 2.5 and W 4's
    # 1.875 / 4.5
    linear = cost_table(8, lambda c, rows, W: W + 0.5)
    policy = WindowPolicy(linear, (1, 2, 4, 8, 16))
    chosen = [policy.choose(8, Acceptance(15, rounds=r - 1))[0] for r in range(1, 3 * PROBE + 1)]
    # rounds 8, 9, 16, 17, 24: the probes, the next wider window (W 2)
    assert chosen == [1] * 7 + [2, 2] + [1] * 6 + [2, 2] + [1] * 6 + [2]
    assert PROBE == 8
    # depth 1 measured at ~0.9 (902 / 1004 with the prior), deeper depths extrapolated from
    # it: W 4's 3.43 / 4.5 = 0.762 beats W 2's 1.90 / 2.5 = 0.759 and W 8's 5.66 / 8.5; on a
    # probe round (16) the next wider window, W 8
    for rounds, W in ((14, 4), (15, 8), (16, 8), (17, 4)):
        some = Acceptance(15, rounds=rounds)
        some.add([1000] + [0] * 14, [900] + [0] * 14)
        assert policy.choose(8, some) == (W, False), rounds
    sure = Acceptance(15, rounds=2)                          # a probe saw every draft accepted:
    sure.add([50] * 15, [50] * 15)                           # W 16's ~15 / 16.5 beats 1 / 1.5
    assert policy.choose(8, sure) == (16, False)
    only = WindowPolicy(linear, (1,))                        # nothing to probe with: W 1
    assert only.choose(8, Acceptance(0, rounds=PROBE - 1)) == (1, False)


def test_rollouts_on_a_w1_table_probe_and_keep_cached_ar_tokens(tiny, batch):
    """A table on which W 1 wins on the prior: the rollout still runs a W >= 2 round every
    PROBE-th round (greedy tokens unchanged), and its windows are the same on a second call."""
    from rollout.window import PROBE
    model = tiny(2)
    labels, prefix = batch(model, 4, 0, 1)
    ref = make_engine("cached_ar").generate(model, labels, prefix, T)
    table = cost_table(4, lambda c, rows, W: float(W) ** 2)
    runs = [make_engine("hbsjd", window="auto", costs=table, execution="full").generate(
        model, labels, prefix, T) for _ in range(2)]
    res = runs[0]
    assert torch.equal(res.tokens, ref.tokens) and runs[1].windows == res.windows
    assert set(res.windows[1:PROBE]) == {1}, res.windows
    assert min(res.windows[PROBE: PROBE + 2]) >= 2, res.windows


def test_the_table_is_made_non_decreasing_in_w():
    from rollout.window import monotone
    assert monotone([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert monotone([5.0, 1.0, 0.0]) == [2.0, 2.0, 2.0] and monotone([1.0, 2.0]) == [1.0, 2.0]
    entry = lambda f, c, o: dict(batch=2, active=[1, 2], full_s=[f], compact_s=c,  # noqa: E731
                                 overhead_s=dict(greedy=o, sample=o))
    # a load spike made W 1's Full forward dearer than W 2's, and W 2's Compact-at-1 cheaper
    t = CostTable.from_entries({1: entry(3.0, [1.0, 2.0], 0.5), 2: entry(1.0, [0.5, 3.0], 0.3),
                                4: entry(4.0, [2.0, 4.0], 1.0)})
    assert t.full == {1: 2.0, 2: 2.0, 4: 4.0} and t.fixed == {1: 0.4, 2: 0.4, 4: 1.0}
    assert t.compact[1] == ([1, 2], [0.75, 2.0]) and t.compact[2] == ([1, 2], [0.75, 3.0])
