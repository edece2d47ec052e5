"""Rollout reuse on Ray (opd/distill/reuse.py): with 2 rollout workers, 2 teacher workers and 2
learner ranks the pipeline trains every step on the rollout the reference loop does, with its
losses (invariant 5); a reused step consumes no prefix batch (invariant 7, consumed.json's
"reused"); the workers that made and scored a buffered rollout may die before it is reused."""
import pytest

from actors.driver.pipeline import run_distributed
from opd.config.loader import ConfigError
from opd.distill.phases import phase_at
from opd.distill.reuse import ReuseSchedule, max_lag
from opd.run.reference import run_reference
from tests.actors.test_pipeline import (LOSS_TOL, cfg_for, consumed, kill_and_wait, losses,
                                        stopped_after)

REUSE = ("distill.reuse=3", "distill.reuse_buffer=2", "distill.reuse_fresh=0.3",
         "rollout.num_workers=2", "teacher.num_workers=2", "learner.world_size=2",
         "learner.zero_stage=2", "learner.num_cpus=0.25", "data.batch_size=8", "distill.pieces=4",
         "distill.steps=7", "cluster.max_restarts=8")
"""7 steps, 4 on buffered rollouts (seed 0: steps 1, 2 on step 0's; 4, 5 on step 3's); 2 rollout
and 2 teacher workers, 2 learner ranks, 4 pieces."""


@pytest.fixture(scope="module")
def reuse_cfg(tiny_overrides):
    return cfg_for(tiny_overrides, *REUSE)


@pytest.fixture(scope="module")
def reference(reuse_cfg, tmp_path_factory):
    return run_reference(reuse_cfg, tmp_path_factory.mktemp("ref"), progress=False)


def assert_reuse_accounted(rows, reference, run_dir, cfg):
    s = ReuseSchedule(cfg)
    origins = [s.origin(t) for t in range(len(rows))]
    assert sum(o != t for t, o in enumerate(origins)) == 4
    assert losses(rows) == pytest.approx(losses(reference), rel=0, abs=LOSS_TOL)
    keys = ("step", "batch_id", "policy_version", "policy_lag", "reused")
    assert [[r[k] for k in keys] for r in rows] == [[r[k] for k in keys] for r in reference]
    assert [r["policy_lag"] for r in rows] == [t - o for t, o in enumerate(origins)]
    assert max(r["policy_lag"] for r in rows) <= max_lag(phase_at(cfg, 0))
    fresh = [t for t, o in enumerate(origins) if o == t]
    # a version is published only when a fresh rollout is made with it (the last one: never)
    assert [r["published"] for r in rows] == [t + 1 in fresh for t in range(len(rows))]
    record = consumed(run_dir)
    assert record["consumed"] == {str(b): 1 for b in range(len(fresh))}   # each batch once
    reused = {}
    for t, o in enumerate(origins):
        if o != t:
            reused[str(o)] = reused.get(str(o), 0) + 1
    assert record["reused"] == reused
    for r in rows:
        assert r["onpolicy_tokens"] == r["generated_tokens"]
        if r["reused"]:
            assert r["delivered_bytes"] == 0 and r["onpolicy_logprob_delta_max"] > 1e-3


@pytest.mark.slow   # the same checks on a run that also loses its workers:
#                    test_workers_lost_while_their_rollout_is_buffered_lose_nothing
def test_ray_reuses_the_reference_loops_rollouts(ray_session, reuse_cfg, reference, tmp_path):
    rows = run_distributed(reuse_cfg, tmp_path, progress=False)
    assert_reuse_accounted(rows, reference, tmp_path, reuse_cfg)


def test_workers_lost_while_their_rollout_is_buffered_lose_nothing(ray_session, reuse_cfg,
                                                                   reference, tmp_path):
    """After the first step whose rollout is buffered and reused later, every rollout and
    teacher worker is killed (all that they put in the object store is gone): the reused steps
    train on the learner ranks' own copies, nothing is made again."""
    s = ReuseSchedule(reuse_cfg)
    target = min(s.origin(t) for t in range(7) if s.reused(t))
    killed = []

    def after_step(pipeline, step, row):
        if step == target and not killed:
            for actor in [*pipeline.rollout, *pipeline.teacher]:
                kill_and_wait(actor)
            killed.append(step)

    rows = run_distributed(reuse_cfg, tmp_path, progress=False, hooks={"after_step": after_step})
    assert killed == [target]
    assert_reuse_accounted(rows, reference, tmp_path, reuse_cfg)


@pytest.mark.slow   # four runs (~85 s); the reference loop's twin runs by default (tests/opd/test_reuse.py)
def test_resume_is_exact_where_the_buffer_is_empty_and_refused_where_it_is_not(
        ray_session, tiny_overrides, reference, tmp_path):
    """After step 2 the buffer is empty (steps 1, 2 used step 0's rollout up): a checkpoint at 3
    resumes with the uninterrupted run's losses; after step 1 it holds step 0's rollout, which no
    checkpoint holds: resuming at 2 is refused in one line."""
    cfg = cfg_for(tiny_overrides, *REUSE, "run.checkpoint_every=3")
    first = stopped_after(cfg, tmp_path / "at3", 3)
    assert losses(first) == pytest.approx(losses(reference)[:3], rel=0, abs=LOSS_TOL)
    resumed = run_distributed(cfg, tmp_path / "at3", progress=False, resume=True)
    assert_reuse_accounted(resumed, reference, tmp_path / "at3", cfg)
    cfg = cfg_for(tiny_overrides, *REUSE, "run.checkpoint_every=2")
    stopped_after(cfg, tmp_path / "at2", 2)
    with pytest.raises(ConfigError, match=r"^cannot resume at step 2: the rollouts of steps \[0\]"):
        run_distributed(cfg, tmp_path / "at2", progress=False, resume=True)
