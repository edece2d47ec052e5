"""Experiment trackers (run.loggers): TensorBoard, MLflow and Weights & Biases receive what the
run directory holds, as the run writes it.

    trackers = RunTrackers(cfg, run_dir, start=start, resume=resume)   # opd/run/loop.py's StepLog
    trackers.step(row)             # one metrics.parquet row
    trackers.follow(quality_log)   # quality.parquet rows (and their sample grids), sent at sync()
    trackers.close()

What each tracker gets:
- every metrics.parquet row, each column under its stage: `tag(column)` below is the one rule
  (`rollout_s` -> rollout/rollout_s, `loss` -> loss/loss, `queue_depth` -> queue/queue_depth);
  a list column is one scalar per entry (`rollout/commit_hist/3`), a string column its index
  (`loss/phase`: the phase's index in distill.phases; `rollout/source`: data 0, student 1,
  teacher 2); the x axis is the row's step;
- every quality.parquet row as quality/<column> at its step, and the teacher's levels as
  quality/teacher_<column> at the same steps: a reference line beside the student's curve
  (TensorBoard also draws the two in one chart, its custom-scalars layout);
- the sample grids of every evaluation as images (samples/student, samples/teacher);
- the resolved config as hyperparameters and the phases with their step ranges (a new run only).

Offline by default: TensorBoard writes event files into the run directory, MLflow into a local
store there unless run.mlflow_uri names a server, W&B runs offline unless WANDB_MODE is set.
Resume continues the same tracker run: the ids are kept in <run_dir>/trackers.json, with what
each tracker has received, so a resumed run sends every step once.  TensorBoard gets the
resumed steps again (its purge_step drops the events of the steps being repeated, so it shows
what metrics.parquet holds); MLflow and W&B cannot drop logged values, so they skip the steps
they already have (the same values on a deterministic resume, wall-clock columns aside).

A tracker never stops a run: one that fails (an unreachable server, a full disk) prints one line
and logs no more.  A tracker whose package is missing is a config error before the run starts
(`check_loggers`, called by opd/run/preflight.py).  No Ray here: in ray mode the driver logs.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

from opd.config.schema import RunConfig
from opd.config.loader import ConfigError
from opd.config.files import config_to_dict
from opd.distill.phases import phases
from opd.run.tracker_backends import BACKENDS, STAGES

STATE_FILE = "trackers.json"
EXTRAS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
"""run.loggers entry -> the module it imports (also the name of its pyproject extra)."""

STAGE_OF = {
    "rollout": ("prefix_len", "rounds", "ar_rounds", "mean_committed", "commit_hist", "window_hist",
                "image_rounds_max", "image_rounds_mean", "longest_single_run",
                "generated_tokens", "samples_per_s", "weight_sync_s", "weight_bytes",
                "delivered_bytes", "source"),
    "learner": ("grad_norm", "policy_version", "step_s", "step_cpu_s"),
    "onpolicy": ("on_policy",),
    "queue": ("batch_id", "policy_lag", "reused", "reissued"),
}
"""Columns that do not start with their stage's name; every other column without a stage
prefix (the loss, the objective's own figures, `phase`) is under loss/."""
SOURCES = ("data", "student", "teacher")
QUALITY_SKIP = ("step", "role", "samples")     # keys and a setting, not measures


def tag(column: str) -> str:
    """The tracker tag of a metrics.parquet column: <stage>/<column>, the stage being the
    column's own prefix (rollout_s -> rollout/rollout_s), else STAGE_OF, else loss."""
    stage = next((s for s in STAGES if column.startswith(s + "_")), None)
    if stage is None:
        stage = next((s for s, cols in STAGE_OF.items() if column in cols), "loss")
    return f"{stage}/{column}"


def step_scalars(row: dict, phase_names: list[str]) -> dict[str, float]:
    """A metrics.parquet row as {tag: float} (None, and strings of no known index, left out)."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key == "step" or value is None:
            continue
        if isinstance(value, str):
            names = phase_names if key == "phase" else SOURCES if key == "source" else ()
            if value in names:
                out[tag(key)] = float(names.index(value))
        elif isinstance(value, (list, tuple)):
            out.update({f"{tag(key)}/{i}": float(v) for i, v in enumerate(value) if v is not None})
        elif isinstance(value, (bool, int, float)):
            out[tag(key)] = float(value)
    return out


def quality_scalars(row: dict, teacher: dict | None) -> dict[str, float]:
    """A student's quality.parquet row as quality/<column>, with the teacher's levels
    (`teacher`: its row) as quality/teacher_<column> at the same step; the teacher's own row
    gives none (its levels appear beside every student row, its grid is sent alone)."""
    def numbers(r: dict, prefix: str) -> dict[str, float]:
        return {f"quality/{prefix}{k}": float(v) for k, v in r.items()
                if k not in QUALITY_SKIP and v is not None and not isinstance(v, str)
                and not (prefix and k == "seconds")}
    if row.get("role") == "teacher":
        return {}
    out = numbers(row, "")
    if teacher is not None:
        out.update(numbers(teacher, "teacher_"))
    return out


def flat_config(cfg: RunConfig) -> dict[str, str | float | int | bool]:
    """The resolved config as dotted keys; lists, dicts and None as their JSON text."""
    out: dict = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, (bool, int, float, str)):
            out[prefix] = value
        else:
            out[prefix] = json.dumps(value)
    walk("", config_to_dict(cfg))
    return out


def phase_lines(cfg: RunConfig) -> list[str]:
    """One line per phase: name, step range [start, end), what it trains on."""
    return [p.describe() for p in phases(cfg)]


def check_loggers(cfg: RunConfig) -> None:
    """ConfigError (exit 2, before the run starts) for a run.loggers entry whose package is
    not installed, naming the pyproject extra that installs it."""
    for name in cfg.run.loggers:
        if importlib.util.find_spec(EXTRAS[name]) is None:
            raise ConfigError(f"run.loggers names {name}, but the {EXTRAS[name]} package is not "
                              f"installed; install it with pip install -e \".[{name}]\" (or "
                              f"pip install {EXTRAS[name]}), or leave {name} out of run.loggers",
                              "run.loggers")


def warn(line: str) -> None:
    print(f"opd: {line}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# The state kept in the run directory.

def read_state(run_dir: Path) -> dict:
    path = run_dir / STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def write_state(run_dir: Path, state: dict) -> None:
    tmp = run_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, run_dir / STATE_FILE)


def quality_key(row: dict) -> str:
    return f"{row['role']}:{row['step']}"


def grid_of(run_dir: Path, row: dict) -> tuple[str, Path]:
    """The sample grid an evaluation wrote (opd/eval/tracking.py) and its image tag."""
    from opd.eval.tracking import SAMPLES_DIR, TEACHER_GRID, student_grid_path
    if row["role"] == "teacher":
        return "samples/teacher", run_dir / SAMPLES_DIR / TEACHER_GRID
    return "samples/student", student_grid_path(run_dir, row["step"])


# ---------------------------------------------------------------------------------------------
# The run's trackers.

class RunTrackers:
    """The trackers of run.loggers for steps [start, ...) of the run in `run_dir`."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, *, start: int, resume: bool):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.phase_names = [p.name for p in phases(cfg)]
        self.state = read_state(self.run_dir) if resume else {}
        self.trackers: dict[str, object] = {}
        self.quality_logs: list = []
        for name in cfg.run.loggers:
            own = self.state.get(name, {})
            run_id = own.get("run_id")
            try:
                tracker = BACKENDS[name](cfg, self.run_dir, run_id=run_id, start=start)
            except Exception as e:               # noqa: BLE001  (a tracker never stops a run)
                warn(f"{name} did not start and logs nothing in this run: {_reason(e)}")
                continue
            if run_id is None:
                self._call(name, lambda t=tracker: t.config(flat_config(cfg), phase_lines(cfg)))
            sent_steps = own.get("steps", -1)
            sent_quality = set(own.get("quality", []))
            if tracker.purges:                   # it shows the repeated steps anew
                sent_steps = min(sent_steps, start - 1)
                sent_quality = {k for k in sent_quality if int(k.split(":")[1]) < start}
            self.state[name] = {"run_id": tracker.run_id, "steps": sent_steps,
                                "quality": sorted(sent_quality)}
            self.trackers[name] = tracker
        self._save()

    def run_id(self, name: str) -> str | None:
        return self.state.get(name, {}).get("run_id")

    def follow(self, quality_log) -> None:
        """Send the rows of `quality_log` (an opd.run.metrics_log.MetricsLog of quality.parquet) at
        every sync: a row is sent once, with its sample grid."""
        self.quality_logs.append(quality_log)

    def step(self, row: dict) -> None:
        """One metrics.parquet row, then any quality rows that arrived since the last."""
        step = int(row["step"])
        scalars = step_scalars(row, self.phase_names)
        for name in list(self.trackers):
            if step > self.state[name]["steps"]:
                if self._call(name, lambda t=self.trackers[name]: t.scalars(step, scalars)):
                    self.state[name]["steps"] = step
        self.sync()

    def sync(self) -> None:
        """Send the quality rows no tracker has had yet (and their grids)."""
        rows = [r for log in self.quality_logs for r in log.rows]
        teacher = next((r for r in rows if r.get("role") == "teacher"), None)
        changed = False
        for name in list(self.trackers):
            sent = set(self.state[name]["quality"])
            for row in sorted(rows, key=lambda r: (r["step"], r["role"] != "teacher")):
                key = quality_key(row)
                if key in sent or name not in self.trackers:
                    continue
                image_tag, grid = grid_of(self.run_dir, row)
                t = self.trackers[name]
                if self._call(name, lambda: t.quality(int(row["step"]),
                                                       quality_scalars(row, teacher),
                                                       image_tag, grid if grid.is_file() else None)):
                    sent.add(key)
                    changed = True
            if name in self.trackers:
                self.state[name]["quality"] = sorted(sent)
        if changed or self.trackers:
            self._save()

    def close(self) -> None:
        """Send what is left and end every tracker run (a resume continues it)."""
        self.sync()
        for name in list(self.trackers):
            self._call(name, self.trackers[name].close)
        self.trackers.clear()
        self._save()

    def _call(self, name: str, fn) -> bool:
        """fn(); on any failure: one line, and the tracker is dropped for the rest of the run."""
        try:
            fn()
            return True
        except Exception as e:                   # noqa: BLE001  (a tracker never stops a run)
            warn(f"{name} failed and logs no more in this run: {_reason(e)}")
            tracker = self.trackers.pop(name, None)
            if tracker is not None:
                try:
                    tracker.abandon()
                except Exception:                # noqa: BLE001
                    pass
            return False

    def _save(self) -> None:
        if self.state:
            try:
                write_state(self.run_dir, self.state)
            except OSError as e:
                warn(f"cannot write {self.run_dir / STATE_FILE}: {e.strerror}")


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


__all__ = ["RunTrackers", "check_loggers", "tag", "step_scalars", "quality_scalars",
           "flat_config", "STATE_FILE", "STAGES"]
