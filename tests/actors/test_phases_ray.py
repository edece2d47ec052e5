"""distill.phases on Ray: the run equals the reference loop across a phase boundary (invariant
5), and a run whose phases never sample from the student holds no rollout worker."""
import json

import pytest

from actors.driver.pipeline import run_distributed
from actors.driver.records import CONSUMED_FILE
from opd.config.schema import load_config
from opd.distill.onpolicy import STRICT_BOUND
from opd.run.reference import run_reference

LOSS_TOL = 1e-5          # as tests/actors/test_pipeline.py: DeepSpeed fp32 vs torch AdamW


def cfg_for(tiny_overrides, *extra):
    return load_config("tiny", [*tiny_overrides, "distill.steps=4", "rollout.gamma=2",
                                "run.checkpoint_every=0", "rollout.num_cpus=0.25",
                                "teacher.num_cpus=0.25", "learner.num_cpus=0.5", *extra])


def test_phased_run_equals_the_reference_across_the_boundary(ray_session, tiny_overrides,
                                                             tmp_path):
    phased = ("distill.phases=[{name: warm, steps: 2, objective: kd}, "
              "{name: onpolicy, objective: gkd, lam: 1.0, lr: 1.0e-3, warmup_steps: 1}]")
    ref = run_reference(cfg_for(tiny_overrides, phased), tmp_path / "ref", progress=False)
    rows = run_distributed(cfg_for(tiny_overrides, phased), tmp_path / "ray", progress=False)
    assert [r["phase"] for r in rows] == [r["phase"] for r in ref] == ["warm"] * 2 + ["onpolicy"] * 2
    assert [r["source"] for r in rows] == ["data"] * 2 + ["student"] * 2
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref], rel=0, abs=LOSS_TOL)
    assert all(r["onpolicy_logprob_delta_max"] < STRICT_BOUND for r in rows[2:])
    assert [r["rollout_workers"] for r in rows] == [1] * 4


def test_a_kd_run_starts_no_rollout_worker(ray_session, tiny_overrides, tmp_path):
    """No rollout worker and no weights published; the teacher workers build the data pieces
    they score (the driver puts none), and one killed while building and scoring one loses
    nothing and repeats nothing: the reference loop's losses, every batch consumed once."""
    import ray
    seen, payloads, killed = [], [], []

    def kill_once(pipeline, kind, step, worker, **_):
        if not killed and kind == "score" and step == 1:
            killed.append(worker)
            ray.kill(pipeline.teacher[worker], no_restart=False)

    kd = ("distill.objective=kd", "teacher.num_workers=2")
    ref = run_reference(cfg_for(tiny_overrides, *kd), tmp_path / "ref", progress=False)
    rows = run_distributed(cfg_for(tiny_overrides, *kd), tmp_path / "ray", progress=False, hooks={
        "after_step": lambda p, **_: seen.append((len(p.groups.rollout),
                                                  p.publisher.published.ref)),
        "after_seal": lambda p, step: payloads.extend(x.made.payload
                                                      for x in p.planner.plans[step].pieces),
        "after_submit": kill_once})
    assert seen == [(0, None)] * 4                         # no worker, no weights published
    assert payloads == [None] * 4                          # one piece a step, none put here
    assert [r["rollout_workers"] for r in rows] == [0] * 4
    assert [r["weight_bytes"] for r in rows] == [0] * 4
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref], rel=0, abs=LOSS_TOL)
    record = json.loads((tmp_path / "ray" / CONSUMED_FILE).read_text())
    assert killed and record["worker_failures"] == {"rollout": 0, "teacher/default": 1}
    assert record["reissued"] >= 1
    assert record["rollout_workers"] == {"min": 0, "max": 0}
    assert record["consumed"] == {str(b): 1 for b in range(4)}
