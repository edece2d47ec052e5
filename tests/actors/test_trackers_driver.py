"""In run.mode=ray the driver logs (opd/run/trackers.py through opd/run/loop.py's StepLog): the default
tracker, TensorBoard, holds every metrics.parquet column of the pipeline's rows (queue/,
learner/ ... included) and the quality rows of the evaluation worker, read back with
TensorBoard's EventAccumulator."""
import pytest

from actors.driver.pipeline import run_distributed
from opd.config.schema import load_config
from opd.run.metrics_log import read_metrics
from opd.run.trackers import step_scalars


@pytest.mark.slow   # StepLog logs both modes' rows: tests/opd/test_trackers.py (the reference
#                      loop's, read back), test_tag_groups_every_column_by_stage (the Ray columns)
def test_the_driver_logs_every_row_to_tensorboard(ray_session, tiny_overrides, tmp_path,
                                                  check_tensorboard):
    cfg = load_config("tiny", [*tiny_overrides, "run.checkpoint_every=0", "rollout.num_cpus=0.25",
                               "teacher.num_cpus=0.25", "learner.num_cpus=0.5"])
    assert cfg.run.loggers == ("tensorboard",)
    run_distributed(cfg, tmp_path, progress=False)
    acc = check_tensorboard(tmp_path, [0, 2, 3])
    rows = read_metrics(tmp_path)
    tags = set().union(*(step_scalars(r, [rows[0]["phase"]]) for r in rows))
    assert {"queue/queue_depth", "learner/learner_idle", "rollout/rollout_wait"} <= tags
    assert [e.step for e in acc.Images("samples/student")] == [0, 2, 3]
