"""Several teachers on Ray (opd/distill/teachers.py): each teacher has its own pool of workers
(opd/teacher/<name>/<i>), scores its share of each piece as soon as the piece exists, and the
learner ranks merge the shares in piece order.  Invariant 5: the Ray run equals the reference
loop, routed and mixed, with 2 learner ranks; a failed worker of one pool re-scores only that
pool's share; every batch is consumed once."""
import json
import math

import pytest
import ray

from actors.driver.pipeline import run_distributed
from actors.driver.records import CONSUMED_FILE
from opd.config.schema import load_config
from opd.distill.onpolicy import STRICT_BOUND
from opd.run.reference import run_reference

STEPS = 3
LOSS_TOL = 1e-5                      # as tests/actors/test_streaming.py
ROUTED = ("teachers=[{name: low, classes: [0,1,2,3,4], num_workers: 2, num_cpus: 0.25}, "
          "{name: high, classes: [5,6,7,8,9], num_cpus: 0.25}]")
MIXED = ("teachers=[{name: a, weight: 1.0, num_cpus: 0.25}, "
         "{name: b, weight: 3.0, model: GPT-digits-S, num_cpus: 0.25}]")


def cfg_for(tiny_overrides, *extra):
    return load_config("tiny", [*tiny_overrides, f"distill.steps={STEPS}", "data.batch_size=8",
                                "rollout.gamma=2", "rollout.decoding=sample",
                                "run.checkpoint_every=0", "rollout.num_cpus=0.25",
                                "learner.num_cpus=0.25", "eval.track=false",
                                "learner.world_size=2", "distill.pieces=4", *extra])


def check_equal(rows, ref, run_dir, names):
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref], rel=0, abs=LOSS_TOL)
    assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-4)
    for r, q in zip(rows, ref):
        assert r["onpolicy_logprob_delta_max"] < STRICT_BOUND
        for n in names:
            assert r[f"teacher_rows/{n}"] == q[f"teacher_rows/{n}"]
            assert r[f"teacher_kl/{n}"] == pytest.approx(q[f"teacher_kl/{n}"], abs=1e-4)
    record = json.loads((run_dir / CONSUMED_FILE).read_text())
    assert record["consumed"] == {str(b): 1 for b in range(STEPS)}


@pytest.mark.parametrize("form, names", [(ROUTED, ("low", "high")), (MIXED, ("a", "b"))],
                         ids=["routed", "mixed"])
def test_several_teachers_on_ray_equal_the_reference_loop(ray_session, tiny_overrides, tmp_path,
                                                         form, names):
    cfg = cfg_for(tiny_overrides, form)
    ref = run_reference(cfg, tmp_path / "ref", progress=False)
    track = ["eval.track=true", "eval.num_cpus=0.25"] if form == ROUTED else []
    rows = run_distributed(cfg_for(tiny_overrides, form, *track), tmp_path / "ray", progress=False)
    check_equal(rows, ref, tmp_path / "ray", names)
    if track:                      # the evaluation worker measures against the ensemble
        import pyarrow.parquet as pq
        quality = pq.read_table(tmp_path / "ray" / "quality.parquet").to_pylist()
        assert [(q["role"], q["step"]) for q in quality] == [
            ("teacher", 0), ("student", 0), ("student", 2), ("student", 3)]
    if form == MIXED:
        assert all(r["teacher_rows/a"] == r["teacher_rows/b"] == 8 for r in rows)
        assert all(r["teacher_kl/a"] != r["teacher_kl/b"] for r in rows)   # two models
    else:
        assert all(r["teacher_rows/low"] + r["teacher_rows/high"] == 8 for r in rows)


@pytest.mark.slow
def test_a_teacher_worker_killed_rescores_only_its_pools_share(ray_session, tiny_overrides,
                                                               tmp_path):
    """Worker 0 of teacher `low` dies as soon as it is given a share (step 1): its share is
    scored again by its pool; teacher `high` scores each of its shares once.  Slow: the step's
    answer to it is walked without Ray in tests/actors/test_step.py
    (`test_a_piece_is_scored_by_each_teacher_its_rows_need_...`), and the chaos soak with two
    teachers (tests/test_soak.py) kills teacher workers of both pools."""
    cfg = cfg_for(tiny_overrides, ROUTED, "cluster.max_restarts=4")
    ref = run_reference(cfg, tmp_path / "ref", progress=False)
    submitted, killed = [], []

    def after_submit(pipe, kind, step, worker, pool, **where):
        if kind != "score":
            return
        submitted.append((step, where["piece"], pool))
        if step == 1 and pool == "teacher/low" and not killed:
            killed.append((where["piece"], worker))
            ray.kill(pipe.pools[pool].actors[worker], no_restart=False)

    rows = run_distributed(cfg, tmp_path / "ray", progress=False,
                           hooks={"after_submit": after_submit})
    check_equal(rows, ref, tmp_path / "ray", ("low", "high"))
    piece = killed[0][0]
    # scored again by its pool (more than once if a resubmission found the restarting worker);
    # the other teacher's share of the piece: once
    assert submitted.count((1, piece, "teacher/low")) >= 2, submitted
    assert submitted.count((1, piece, "teacher/high")) <= 1, submitted
    assert math.isfinite(rows[1]["loss"]) and rows[1]["reissued"] >= 1
