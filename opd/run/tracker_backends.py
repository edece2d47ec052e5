"""One class per experiment tracker, behind the interface opd/run/trackers.py drives:

    t = Backend(cfg, run_dir, run_id=None | "<kept id>", start=step)   # None: a new tracker run
    t.run_id, t.purges          # its run's id (kept in trackers.json); whether a resume re-sends
    t.config(params, phases)    # flat {dotted key: value} of the resolved config; phase lines
    t.scalars(step, {tag: x})   # one metrics.parquet row
    t.quality(step, {tag: x}, image_tag, png | None)   # one quality.parquet row and its grid
    t.close()                   # the run's end (a resume continues the same tracker run)
    t.abandon()                 # after a failure: release what it holds, best effort

Each package is imported by its class only, so a run imports only the trackers it logs to.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

from opd.config.schema import RunConfig

TENSORBOARD_DIR = "tensorboard"
MLFLOW_DIR = "mlflow"
EXPERIMENT = "opd"
STAGES = ("loss", "rollout", "teacher", "learner", "onpolicy", "queue")
"""The stages a metrics.parquet column is grouped under (opd.run.trackers.tag)."""


def _png(path: Path):
    """(H, W, 3) uint8 array of a PNG."""
    import numpy as np
    from PIL import Image
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


class TensorBoardTracker:
    """Event files in <run_dir>/tensorboard (`tensorboard --logdir runs/` shows every run).  A
    resume writes with purge_step=start: TensorBoard then drops the earlier attempt's events of
    the steps being repeated."""
    purges = True

    def __init__(self, cfg: RunConfig, run_dir: Path, *, run_id: str | None, start: int):
        from torch.utils.tensorboard import SummaryWriter
        self.run_id = run_id or f"{run_dir.name}/{TENSORBOARD_DIR}"
        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR), flush_secs=10,
                                    purge_step=start if run_id is not None else None)

    def config(self, params: dict, phases: list[str]) -> None:
        from torch.utils.tensorboard.summary import hparams
        for summary in hparams(params, {}):
            self.writer.file_writer.add_summary(summary)
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in params.items()), 0)
        self.writer.add_text("phases", "\n\n".join(phases), 0)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def quality(self, step: int, values: dict[str, float], image_tag: str,
                image: Path | None) -> None:
        new = [k for k in values if k.startswith("quality/teacher_")]
        if new and not getattr(self, "_layout", False):
            self.writer.add_custom_scalars({"quality: student and teacher": {
                k.split("_", 1)[1]: ["Multiline", [k.replace("teacher_", ""), k]]
                for k in sorted(new)}})
            self._layout = True
        self.scalars(step, values)
        if image is not None:
            self.writer.add_image(image_tag, _png(image), step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

    abandon = close


class MlflowTracker:
    """A run in experiment "opd" of run.mlflow_uri ("" = sqlite:///<run_dir>/mlflow/mlflow.db
    with artifacts beside it).  Requests give up after a few seconds' retries (MLflow's own
    default retries for minutes), unless the MLFLOW_HTTP_REQUEST_* variables say otherwise."""
    purges = False

    def __init__(self, cfg: RunConfig, run_dir: Path, *, run_id: str | None, start: int):
        for key, value in (("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2"),
                           ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1"),
                           ("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")):
            os.environ.setdefault(key, value)
        from mlflow.tracking import MlflowClient
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)  # its table set-up
        logging.getLogger("alembic").setLevel(logging.WARNING)
        uri, artifacts = cfg.run.mlflow_uri, None
        if not uri:
            local = (run_dir / MLFLOW_DIR).resolve()
            local.mkdir(parents=True, exist_ok=True)
            uri, artifacts = f"sqlite:///{local / 'mlflow.db'}", (local / "artifacts").as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
        else:
            exp = self.client.get_experiment_by_name(EXPERIMENT)
            exp_id = (exp.experiment_id if exp is not None else
                      self.client.create_experiment(EXPERIMENT, artifact_location=artifacts))
            self.run_id = self.client.create_run(exp_id, run_name=run_dir.name).info.run_id

    def config(self, params: dict, phases: list[str]) -> None:
        from mlflow.entities import Param
        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        items += [Param(f"phases.{i}", line) for i, line in enumerate(phases)]
        for i in range(0, len(items), 100):                   # MLflow's batch limit
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def scalars(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        items = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def quality(self, step: int, values: dict[str, float], image_tag: str,
                image: Path | None) -> None:
        self.scalars(step, values)
        if image is not None:
            self.client.log_artifact(self.run_id, str(image), artifact_path="samples")

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")

    def abandon(self) -> None:
        pass


class WandbTracker:
    """A W&B run in <run_dir>/wandb, offline unless WANDB_MODE is set (project: WANDB_PROJECT,
    else "opd").  Steps are plotted against `step`, evaluations against `quality/step`, so
    evaluations that finish late (ray mode) still land at their own step."""
    purges = False

    def __init__(self, cfg: RunConfig, run_dir: Path, *, run_id: str | None, start: int):
        import wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", EXPERIMENT), name=run_dir.name,
            id=run_id or uuid.uuid4().hex[:8], resume="allow", dir=str(run_dir),
            mode=os.environ.get("WANDB_MODE") or "offline", reinit="create_new",
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))
        self.run_id = self.run.id
        self.run.define_metric("step")
        self.run.define_metric("quality/step")
        for stage in STAGES:
            self.run.define_metric(f"{stage}/*", step_metric="step")
        for prefix in ("quality", "samples"):
            self.run.define_metric(f"{prefix}/*", step_metric="quality/step")

    def config(self, params: dict, phases: list[str]) -> None:
        self.run.config.update({**params, "phases": phases}, allow_val_change=True)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"step": step, **values})

    def quality(self, step: int, values: dict[str, float], image_tag: str,
                image: Path | None) -> None:
        import wandb
        extra = {image_tag: wandb.Image(str(image))} if image is not None else {}
        self.run.log({"quality/step": step, **values, **extra})

    def close(self) -> None:
        self.run.finish()

    def abandon(self) -> None:
        self.run.finish(exit_code=1)


BACKENDS = {"tensorboard": TensorBoardTracker, "mlflow": MlflowTracker, "wandb": WandbTracker}
