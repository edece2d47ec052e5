"""The sections of a run config about where and how it runs: the Ray cluster, the evaluation of
sample quality, and the run itself (directory, seed, mode, trackers).

    cfg.cluster.address, cfg.eval.every, cfg.run.mode   # None, 600, "ray"

Sections of the run config's schema (opd/config/root.py joins them; opd/config/schema.py
loads them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from opd.config.rollout import Decoding, EngineName

Logger = Literal["tensorboard", "mlflow", "wandb"]


@dataclass
class ClusterConfig:
    """The Ray cluster."""

    address: str | None = None
    """Ray address to join ("auto", "ray://host:10001", ...); None = start a local Ray on loopback."""
    num_cpus: Annotated[int, Field(ge=1)] | None = None
    """CPUs of a locally started Ray; None = all of this machine's."""
    dashboard_host: str = "127.0.0.1"
    """Interface the Ray dashboard binds to."""
    include_dashboard: bool = True
    """Start the Ray dashboard with a local Ray."""
    max_restarts: Annotated[int, Field(ge=0)] = 3
    """Restarts of a failed rollout or teacher worker (it reloads the current weights; its work is issued again)."""
    role_resources: bool = False
    """Workers also ask for one custom resource each: opd_rollout / opd_teacher / opd_learner (the node types of configs/cluster.yaml)."""


@dataclass
class EvalConfig:
    """Sample-quality evaluation (FID, IS, precision / recall), also during `opd train`."""

    track: bool = True
    """Track quality during `opd train` (opd/eval/tracking.py): quality.parquet, sample grids over training, the closing table; false = no evaluation while training."""
    every: Annotated[int, Field(ge=0)] = 600
    """Evaluate the student during training every this many learner steps, besides step 0 and the last step; 0 = only step 0 and the last step."""
    num_samples: Annotated[int, Field(ge=1)] = 1000
    """Images generated per evaluation (FID is biased and noisy on a few hundred)."""
    extractor: Literal["digits-cnn", "inception-v3-compat"] = "digits-cnn"
    """Feature extractor: a small CNN for digits, or torch-fidelity's Inception (needs inception_weights offline)."""
    inception_weights: str | None = None
    """Local Inception weights file for the inception-v3-compat extractor."""
    engine: EngineName | None = None
    """Engine used to sample evaluation images; None = rollout.engine."""
    decoding: Decoding | None = "sample"
    """Decoding of evaluation samples: sample (the field's practice; greedy gives one image per class), None = rollout.decoding."""
    seed: int = 0
    """Seed of the evaluation samples (image i is keyed by (seed, i)); the same for every run compared."""
    batch_size: Annotated[int, Field(ge=1)] = 50
    """Images generated per engine call during evaluation."""
    reference: str | None = None
    """Reference statistics file (opd.eval.fidelity.save_reference_statistics); None = the held-out split's images."""
    prefix_ratio: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.5
    """Held-out prefix ratio of the on-policy KL (`kl_samples`): the student completes held-out
    prefixes; whole images from the class token are what FID / class accuracy measure."""
    kl_rows: Annotated[int, Field(ge=1)] | None = None
    """Held-out rows for the KL measures tracked during training (held-out KL(teacher‖student), on-policy KL); None = the whole held-out split."""
    num_cpus: Annotated[float, Field(ge=0.0)] = 0.5
    """Ray CPUs of the evaluation worker that tracks quality in run.mode=ray."""
    num_gpus: Annotated[float, Field(ge=0.0)] = 0.0
    """Ray GPUs of the evaluation worker (fractions share a device)."""


@dataclass
class RunOptions:
    """The run itself: where it writes, how it is seeded and executed."""

    dir: str | None = None
    """Run directory; None = runs/<name>-<timestamp>."""
    name: str = ""
    """Run name (the run directory's prefix); "" = the dataset and what the phases train with,
    e.g. digits-kd-gkd for a KD warm start, then GKD."""
    seed: int = 0
    """Global seed (data order, rollouts, initialization)."""
    mode: Literal["ray", "reference"] = "ray"
    """`ray`: the distributed pipeline; `reference`: the single-process reference loop."""
    checkpoint_every: Annotated[int, Field(ge=0)] = 200
    """Checkpoint every this many steps; 0 = only at the end."""
    log_every: Annotated[int, Field(ge=1)] = 1
    """Log metrics every this many steps."""

    # -- experiment trackers (opd/run/trackers.py, docs/TRACKERS.md) --
    loggers: tuple[Logger, ...] = ("tensorboard",)
    """Experiment trackers that receive every metrics.parquet and quality.parquet row, the sample
    grids, the resolved config and the phases: any of `tensorboard`, `mlflow`, `wandb`; () = none.
    TensorBoard by default: it is what the field's trainers (torchtitan, verl, OpenRLHF) write
    without an account or a server, it writes event files into the run directory (offline), and
    `tensorboard --logdir runs/` overlays every run.  mlflow and wandb need their pyproject
    extras (`pip install -e ".[mlflow]"`, `".[wandb]"`); wandb runs offline unless WANDB_MODE
    says otherwise."""
    mlflow_uri: str = ""
    """MLflow tracking URI for run.loggers=[mlflow]: "" = a local store in the run directory
    (sqlite:///<run_dir>/mlflow/mlflow.db), or a tracking server such as http://127.0.0.1:5000."""
