"""Rollout reuse (opd/distill/reuse.py, DESIGN.md invariant 6): which rollout a step trains on is
keyed by (seed, step), bounded in uses and lag, phase by phase; reuse 1 is the strict run bit for
bit; a reused step trains on the stored rollout with the current weights; resume refuses a
non-empty buffer."""
from collections import Counter

import pytest

from opd.config.loader import ConfigError
from opd.config.schema import load_config
from opd.distill.phases import phase_at
from opd.distill.plan import step_source
from opd.distill.reuse import ReuseSchedule, check_resume, max_lag
from opd.run.reference import run_reference
from opd.run.summary import summarize

REUSE = ("distill.reuse=3", "distill.reuse_buffer=2", "distill.reuse_fresh=0.3")


def sched_cfg(*extra, steps=300):
    return load_config("tiny", [f"distill.steps={steps}", *extra])


def test_reuse_1_trains_every_step_on_its_own_rollout():
    s = ReuseSchedule(sched_cfg())
    assert [s.origin(t) for t in range(300)] == list(range(300))
    assert all(s.kept(t) == () for t in range(300))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("lam", [1.0, 0.5])
def test_uses_lag_and_buffer_stay_within_their_bounds(seed, lam):
    cfg = sched_cfg(*REUSE, f"run.seed={seed}", f"distill.lam={lam}")
    s = ReuseSchedule(cfg)
    origins = [s.origin(t) for t in range(300)]
    p = phase_at(cfg, 0)
    uses = Counter(origins)
    assert max(uses.values()) == p.reuse                    # reached, never passed
    lags = [t - o for t, o in enumerate(origins)]
    assert 0 < max(lags) <= max_lag(p) == 6
    for t, o in enumerate(origins):
        assert origins[o] == o                              # a reused rollout was a fresh one
        if o != t:
            assert step_source(cfg, o)[1] == step_source(cfg, t)[1] == "student"
        assert len(s.kept(t)) <= p.reuse_buffer
    reused = sum(o != t for t, o in enumerate(origins))
    student = sum(step_source(cfg, t)[1] == "student" for t in range(300))
    assert 0.4 * student < reused < 0.8 * student           # reuse_fresh 0.3: about 0.6 reused
    assert ReuseSchedule(cfg).origin(299) == origins[299]   # a function of (seed, step)


def test_a_phase_reuses_only_its_own_rollouts():
    cfg = sched_cfg("distill.phases=[{steps: 100, objective: gkd, lam: 1.0, reuse: 4},"
                    " {objective: gkd, lam: 1.0}]", "distill.reuse_fresh=0.2", steps=200)
    s = ReuseSchedule(cfg)
    assert phase_at(cfg, 0).reuse == 4 and phase_at(cfg, 150).reuse == 1
    assert any(s.origin(t) != t for t in range(100))
    assert all(s.origin(t) == t for t in range(100, 200))   # the second phase: strict
    assert s.kept(99) != () and s.kept(100) == ()


def test_reuse_with_staleness_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="distill.staleness=1"):
        sched_cfg("distill.reuse=2", "distill.staleness=1")


def test_resume_with_a_buffered_rollout_is_refused():
    s = ReuseSchedule(sched_cfg(*REUSE))
    empty = [t for t in range(1, 300) if not s.kept(t - 1)]
    full = [t for t in range(1, 300) if s.kept(t - 1)]
    assert full and empty                          # emptied when its rollouts are used up
    for t in [0, *empty]:
        check_resume(s, t)
    for t in full:
        with pytest.raises(ConfigError, match=rf"cannot resume at step {t}: the rollouts of "
                                               rf"steps \[\d"):
            check_resume(s, t)


def ref_cfg(tiny_overrides, *extra):
    return load_config("tiny", [*tiny_overrides, "distill.steps=6", "rollout.gamma=2",
                                "rollout.decoding=greedy", *extra])


@pytest.fixture(scope="module")
def strict_run(tiny_overrides, tmp_path_factory):
    return run_reference(ref_cfg(tiny_overrides), tmp_path_factory.mktemp("strict"), progress=False)


def test_a_buffer_that_is_never_drawn_from_is_the_strict_run_bit_for_bit(strict_run, tiny_overrides,
                                                                        tmp_path):
    """reuse 3 with reuse_fresh 1: every rollout is buffered and none reused, so every step is
    the strict run's (reuse 1, the default) exactly."""
    rows = run_reference(ref_cfg(tiny_overrides, "distill.reuse=3", "distill.reuse_fresh=1.0"),
                         tmp_path, progress=False)
    assert [r["loss"] for r in rows] == [r["loss"] for r in strict_run]
    assert [r["grad_norm"] for r in rows] == [r["grad_norm"] for r in strict_run]
    assert [r["reused"] for r in strict_run] == [False] * 6
    assert [r["policy_lag"] for r in strict_run] == [0] * 6


def test_reused_steps_train_the_stored_rollout_with_the_current_weights(strict_run, tiny_overrides,
                                                                       tmp_path):
    cfg = ref_cfg(tiny_overrides, *REUSE)
    s = ReuseSchedule(cfg)
    rows = run_reference(cfg, tmp_path, progress=False)
    origins = [s.origin(t) for t in range(6)]
    assert [r["reused"] for r in rows] == [o != t for t, o in enumerate(origins)]
    assert any(r["reused"] for r in rows)
    fresh = [r for r in rows if not r["reused"]]
    assert [r["batch_id"] for r in fresh] == list(range(len(fresh)))   # a batch per fresh step
    for t, r in enumerate(rows):
        o = rows[origins[t]]
        assert r["policy_version"] == o["policy_version"] == origins[t]
        assert r["policy_lag"] == t - origins[t] <= max_lag(phase_at(cfg, t))
        assert (r["batch_id"], r["prefix_len"], r["generated_tokens"]) == \
            (o["batch_id"], o["prefix_len"], o["generated_tokens"])
        assert r["onpolicy_tokens"] == r["generated_tokens"]
        if r["reused"]:                    # the weights moved since the rollout: Δ is the lag's
            assert r["onpolicy_logprob_delta_max"] > 1e-3
            assert r["rollout_s"] == r["teacher_s"] == 0.0
    first = origins.index(next(o for t, o in enumerate(origins) if o != t)) + 1
    assert [r["loss"] for r in rows[:first]] == [r["loss"] for r in strict_run[:first]]
    summary = summarize(rows)                      # rollout speeds over the fresh rollouts only
    assert (summary["student_steps"], summary["reused_steps"], summary["reused_lag_max"]) == \
        (len(fresh), 6 - len(fresh), max(r["policy_lag"] for r in rows))
    assert "reused_steps" not in summarize(strict_run)


def test_resume_is_exact_where_the_buffer_is_empty_and_refused_where_it_is_not(tiny_overrides,
                                                                              tmp_path):
    """Seed 0 trains steps 1, 2 on step 0's rollout and 4, 5 on step 3's: after step 2 the buffer
    is empty (a checkpoint at 3 resumes exactly), after step 1 it holds step 0's rollout (a
    checkpoint at 2 is refused, in one line)."""
    cfg = ref_cfg(tiny_overrides, *REUSE, "run.checkpoint_every=3")
    full = run_reference(cfg, tmp_path / "full", progress=False)
    assert [r["policy_lag"] for r in full] == [0, 1, 2, 0, 1, 2]
    run_reference(cfg, tmp_path / "at3", progress=False, stop_after=3)
    resumed = run_reference(cfg, tmp_path / "at3", progress=False, resume=True)
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in full], rel=0, abs=1e-7)
    cfg = ref_cfg(tiny_overrides, *REUSE, "run.checkpoint_every=2")
    run_reference(cfg, tmp_path / "at2", progress=False, stop_after=2)
    with pytest.raises(ConfigError, match=r"^cannot resume at step 2: the rollouts of steps \[0\]"):
        run_reference(cfg, tmp_path / "at2", progress=False, resume=True)
