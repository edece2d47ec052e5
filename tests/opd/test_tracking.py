"""Quality over training in the reference loop: which steps are evaluated, quality.parquet,
the cached teacher row, exact resume, and invariant 9 (tracking never changes the losses)."""
import math

import pytest
import torch

from opd.config.schema import load_config
from opd.eval.tracking import (COLUMNS, Evaluator, eval_steps, evaluate_student, read_only,
                               read_quality, teacher_cache_path)
from opd.run.metrics_log import read_metrics
from opd.run.reference import run_reference

STEPS = 4


def cfg_for(tiny_overrides, *extra, dropout: bool = True):
    """tiny (eval.every=2, 8 samples, 8 KL rows); label dropout on in the training forward
    (`dropout`), so training draws from the global torch RNG and any draw by evaluation would
    show in the losses."""
    return load_config("tiny", [*tiny_overrides, f"distill.steps={STEPS}", "rollout.gamma=2",
                                "rollout.engine=cached_ar",
                                f"learner.student_dropout={str(dropout).lower()}", *extra])


def losses(rows):
    return [r["loss"] for r in rows]


def student_steps(rows):
    return [r["step"] for r in rows if r["role"] == "student"]


@pytest.fixture(scope="module")
def tracked(tiny_overrides, tmp_path_factory):
    from opd.models.factory import load_role_model
    for role in ("teacher", "student"):   # pretraining in the run would reseed the global RNG
        load_role_model(cfg_for(tiny_overrides), role, progress=False)
    run_dir = tmp_path_factory.mktemp("tracked")
    return run_reference(cfg_for(tiny_overrides), run_dir, progress=False), run_dir


def test_eval_steps():
    def steps(*o):
        return eval_steps(load_config("tiny", list(o)))
    assert steps() == [0, 2, 3]                                   # tiny: 3 steps, every 2
    assert steps("distill.steps=7", "eval.every=3") == [0, 3, 6, 7]
    assert steps("distill.steps=6", "eval.every=3") == [0, 3, 6]
    assert steps("distill.steps=5", "eval.every=0") == [0, 5]     # only the start and the end
    assert steps("eval.track=false") == []
    assert eval_steps(load_config("default")) == [0, 600, 1200, 1800, 2400]


def test_quality_rows_for_step_0_every_and_the_end(tracked):
    rows, run_dir = tracked
    quality = read_quality(run_dir)
    assert [(r["step"], r["role"]) for r in quality] == \
        [(0, "teacher"), (0, "student"), (2, "student"), (4, "student")]
    assert all(list(r) == list(COLUMNS) for r in quality)
    for r in quality:
        assert math.isfinite(r["fid"]) and r["fid"] >= 0
        assert 0 <= r["class_acc"] <= 1 and 0 <= r["precision"] <= 1 and 0 <= r["recall"] <= 1
        assert r["seconds"] >= 0
    teacher = quality[0]
    assert teacher["kl_data"] == 0 and teacher["kl_samples"] == 0
    assert all(r["kl_data"] > 0 and r["kl_samples"] > 0 for r in quality[1:])
    kl = [r["kl_data"] for r in quality[1:]]
    assert len(set(kl)) == 3                                      # the student changed
    samples = sorted(p.name for p in (run_dir / "samples").iterdir())
    assert samples == ["student_step_000000.png", "student_step_000002.png",
                       "student_step_000004.png", "teacher.png"]
    assert (run_dir / "training.png").is_file()


def test_tracking_does_not_change_the_losses(tracked, tiny_overrides, tmp_path):
    rows, _ = tracked
    off = run_reference(cfg_for(tiny_overrides, "eval.track=false"), tmp_path, progress=False)
    assert losses(off) == losses(rows)                            # exact: invariant 9
    assert [r["grad_norm"] for r in off] == [r["grad_norm"] for r in rows]
    assert read_quality(tmp_path) == [] and not (tmp_path / "samples").exists()


def test_evaluate_student_gives_the_tracked_row(tracked, tiny_overrides, tmp_path):
    """Fixed keys: a fresh evaluation of the starting student repeats the run's step-0 row."""
    from opd.models.factory import load_role_model
    _, run_dir = tracked
    cfg = cfg_for(tiny_overrides)
    student, teacher = load_role_model(cfg, "student"), load_role_model(cfg, "teacher")
    row = evaluate_student(student, teacher, cfg, 0, tmp_path)
    before = read_quality(run_dir)[1]
    assert {k: v for k, v in row.items() if k != "seconds"} == \
        {k: v for k, v in before.items() if k != "seconds"}
    assert (tmp_path / "samples" / "student_step_000000.png").is_file()


def test_teacher_row_is_cached(tracked, tiny_overrides, tmp_path, monkeypatch):
    rows, run_dir = tracked
    cfg = cfg_for(tiny_overrides)
    path = teacher_cache_path(cfg)
    assert path.is_file() and path.with_suffix(".png").is_file()  # written by the tracked run
    mtime = path.stat().st_mtime_ns
    from opd.models.factory import load_role_model
    teacher = load_role_model(cfg, "teacher")
    measured = []
    real = Evaluator.sample_metrics

    def counting(self, model):
        measured.append("teacher" if model is teacher else "student")
        return real(self, model)

    monkeypatch.setattr(Evaluator, "sample_metrics", counting)
    ev = Evaluator(cfg, teacher)
    again = ev.teacher_row(tmp_path)
    assert measured == [] and path.stat().st_mtime_ns == mtime    # read, not measured again
    assert {k: v for k, v in again.items() if k != "seconds"} == \
        {k: v for k, v in read_quality(run_dir)[0].items() if k != "seconds"}
    assert (tmp_path / "samples" / "teacher.png").read_bytes() == \
        (run_dir / "samples" / "teacher.png").read_bytes()
    other = cfg_for(tiny_overrides, "eval.seed=1")                # other samples: other figures
    assert teacher_cache_path(other) != path
    Evaluator(other, teacher).teacher_row(tmp_path)
    assert measured == ["teacher"] and teacher_cache_path(other).is_file()


def test_resume_keeps_earlier_rows_once(tiny_overrides, tmp_path):
    # no label dropout: a reference checkpoint does not hold the global RNG state
    cfg = cfg_for(tiny_overrides, "eval.every=1", "run.checkpoint_every=2", dropout=False)
    first = run_reference(cfg, tmp_path, progress=False, stop_after=3)     # checkpoint at 2
    assert student_steps(read_quality(tmp_path)) == [0, 1, 2, 3]
    kept = read_quality(tmp_path)[:4]                                     # teacher, 0, 1, 2
    resumed = run_reference(cfg, tmp_path, progress=False, resume=True)
    quality = read_quality(tmp_path)
    assert [(r["step"], r["role"]) for r in quality] == \
        [(0, "teacher")] + [(s, "student") for s in range(STEPS + 1)]
    assert quality[:4] == kept                                            # not evaluated again
    assert losses(resumed)[:3] == losses(first)
    assert read_metrics(tmp_path) == resumed


def test_read_only_leaves_the_random_streams_alone():
    import random

    import numpy as np
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    expected = (torch.rand(3), np.random.rand(), random.random())
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    with read_only():
        torch.manual_seed(123)
        torch.rand(100)
        np.random.seed(1)
        random.seed(1)
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(not torch.are_deterministic_algorithms_enabled())
        assert not torch.is_grad_enabled()
    got = (torch.rand(3), np.random.rand(), random.random())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
    assert torch.get_num_threads() == threads
    assert torch.are_deterministic_algorithms_enabled() == det
