"""In run.mode=ray the driver logs (opd/trackers.py through opd/loop.py's StepLog): the default
tracker, TensorBoard, holds every metrics.parquet column of the pipeline's rows (queue/,
learner/ ... included) and the quality rows of the evaluation worker, read back with
TensorBoard's EventAccumulator."""
import numpy as np

from actors.driver.pipeline import run_distributed
from opd.config import load_config
from opd.eval.tracking import read_quality
from opd.metrics import read_metrics
from opd.trackers import quality_scalars, step_scalars


def test_the_driver_logs_every_row_to_tensorboard(ray_session, tiny_overrides, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    cfg = load_config("tiny", [*tiny_overrides, "run.checkpoint_every=0", "rollout.num_cpus=0.25",
                               "teacher.num_cpus=0.25", "learner.num_cpus=0.5"])
    assert cfg.run.loggers == ("tensorboard",)
    run_distributed(cfg, tmp_path, progress=False)
    rows = read_metrics(tmp_path)
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    expected = {r["step"]: step_scalars(r, [rows[0]["phase"]]) for r in rows}
    tags = set().union(*expected.values())
    assert {"queue/queue_depth", "learner/learner_idle", "rollout/rollout_wait"} <= tags
    for t in tags:
        assert {e.step: e.value for e in acc.Scalars(t)} == \
            {s: np.float32(v[t]) for s, v in expected.items() if t in v}, t
    quality = read_quality(tmp_path)
    teacher = next(r for r in quality if r["role"] == "teacher")
    students = [r for r in quality if r["role"] == "student"]
    assert [r["step"] for r in students] == [0, 2, 3]
    for r in students:
        for t, v in quality_scalars(r, teacher).items():
            assert [e.value for e in acc.Scalars(t) if e.step == r["step"]] == [np.float32(v)], t
    assert [e.step for e in acc.Images("samples/student")] == [0, 2, 3]
