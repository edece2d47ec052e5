"""Quality over training on Ray: the evaluation worker gets the published weights of every
evaluated version, quality.parquet has the rows of steps 0, every and the end, and the losses
are those of the same run without tracking (invariant 9)."""
import math

import pytest

from actors.driver.pipeline import run_distributed
from opd.config.schema import load_config
from opd.eval.tracking import read_quality

STEPS = 5


def cfg_for(tiny_overrides, *extra):
    """tiny (eval.every=2) for 5 steps, as the pipeline tests run it (no label dropout: the
    learner's global RNG is not seeded, so a run with it is not repeatable, tracked or not)."""
    return load_config("tiny", [*tiny_overrides, f"distill.steps={STEPS}", "rollout.gamma=2",
                                "rollout.decoding=greedy", "run.checkpoint_every=0",
                                "rollout.num_cpus=0.25",
                                "teacher.num_cpus=0.25", "learner.num_cpus=0.5",
                                "eval.num_cpus=0.5", *extra])


def losses(rows):
    return [r["loss"] for r in rows]


@pytest.fixture(scope="module")
def tracked(ray_session, tiny_overrides, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ray_tracked")
    return run_distributed(cfg_for(tiny_overrides), run_dir, progress=False), run_dir


def test_quality_rows_and_grids_from_the_evaluation_worker(tracked, tiny_overrides, tmp_path):
    rows, run_dir = tracked
    quality = read_quality(run_dir)
    assert [(r["step"], r["role"]) for r in quality] == \
        [(0, "teacher"), (0, "student"), (2, "student"), (4, "student"), (5, "student")]
    for r in quality:
        assert math.isfinite(r["fid"]) and 0 <= r["class_acc"] <= 1
        assert 0 <= r["precision"] <= 1 and 0 <= r["recall"] <= 1
    assert all(r["kl_data"] > 0 for r in quality[1:])
    assert len({r["kl_data"] for r in quality[1:]}) == 4       # every version is another one
    samples = sorted(p.name for p in (run_dir / "samples").iterdir())
    assert samples == [f"student_step_{s:06d}.png" for s in (0, 2, 4, 5)] + ["teacher.png"]
    # the worker measured the starting weights exactly as an evaluation in this process does
    from opd.eval.tracking import evaluate_student
    from opd.models.factory import load_role_model
    cfg = cfg_for(tiny_overrides)
    here = evaluate_student(load_role_model(cfg, "student"), load_role_model(cfg, "teacher"),
                            cfg, 0, tmp_path)
    assert {k: v for k, v in here.items() if k != "seconds"} == \
        {k: v for k, v in quality[1].items() if k != "seconds"}


@pytest.mark.slow   # invariant 9: tests/opd/test_tracking.py::test_tracking_does_not_change_the_losses
def test_tracking_does_not_change_the_losses(tracked, ray_session, tiny_overrides, tmp_path):
    rows, _ = tracked
    off = run_distributed(cfg_for(tiny_overrides, "eval.track=false"), tmp_path, progress=False)
    assert losses(off) == losses(rows)                          # exact on CPU
    assert [r["grad_norm"] for r in off] == [r["grad_norm"] for r in rows]
    assert read_quality(tmp_path) == [] and not (tmp_path / "samples").exists()
