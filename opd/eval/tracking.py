"""Quality over training: the student measured at step 0, every `eval.every` steps and at the
last step; the teacher measured once, cached across runs.  Both run modes call this module (the
reference loop in its own process, the Ray pipeline in an evaluation worker).

    ev = Evaluator(cfg, teacher)                      # decoder, reference features, student copy
    ev.teacher_row(run_dir)                           # cached: $OPD_CACHE/quality/teacher-<hash>
    ev.load(student.state_dict())                     # or actors.transport.weights.load_numpy_weights
    row = ev.student_row(step, run_dir)               # + samples/student_step_<step>.png
    log = quality_log(run_dir, resume=..., start=...) # quality.parquet, one row per evaluation

A row (one evaluation, a `quality.parquet` row):

    step        learner step of the evaluated weights (the teacher's row: 0)
    role        "student" | "teacher"
    fid, precision, recall, isc   eval.num_samples class-balanced samples with fixed keys
                (eval.seed) against the held-out images (or eval.reference), eval.extractor
    samples     how many (eval.num_samples then; FID's bias depends on it)
    class_acc   the digits CNN's agreement with the sampled class; None without digits-cnn
    kl_data     held-out KL(teacher ‖ student) per token (nats), first eval.kl_rows rows
    kl_samples  KL(teacher ‖ student) on student-generated suffixes of held-out prefixes
    seconds     wall time of this evaluation (the teacher's: ~0 when read from the cache)

Evaluation is read-only (invariant 9, docs/ARCHITECTURE.md): it samples and measures a copy of the student
with keyed random numbers, and restores the caller's torch / numpy / random generator states,
thread count and determinism setting, so a run's losses are the same with tracking on or off.
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from rollout.calibrate import cache_root
from opd.config.schema import RunConfig, TeacherConfig
from opd.config.files import config_hash
from opd.eval.features import DIGITS_EXTRACTOR
from opd.eval.grid import save_grid
from opd.eval.run import (check_eval_config, eval_settings, grid_layout, heldout_images,
                          weights_path)
from opd.eval.sample import ImageDecoder, Samples, sample_images, sampling_config
from opd.run.metrics_log import MetricsLog, read_metrics
from opd.models import create_model
from opd.models.factory import dataset_digest, model_overrides, pretrain_key
from opd.data.splits import data_paths, open_dataset

QUALITY_FILE = "quality.parquet"
SAMPLES_DIR = "samples"
TEACHER_GRID = "teacher.png"
COLUMNS = ("step", "role", "fid", "precision", "recall", "isc", "class_acc", "samples",
           "kl_data", "kl_samples", "seconds")
CACHE_VERSION = 1
"""Bump when what a cached teacher row means changes."""


# ---------------------------------------------------------------------------------------------
# When a run evaluates.

def is_eval_step(cfg: RunConfig, step: int) -> bool:
    """True for the steps a run evaluates (eval.track on): 0, multiples of eval.every, and
    distill.steps (the last)."""
    e = cfg.eval
    return e.track and (step in (0, cfg.distill.steps) or bool(e.every and step % e.every == 0))


def eval_steps(cfg: RunConfig) -> list[int]:
    """Every step `is_eval_step` holds for, in order (empty when eval.track is off)."""
    return [s for s in range(cfg.distill.steps + 1) if is_eval_step(cfg, s)]


def student_grid_path(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / SAMPLES_DIR / f"student_step_{step:06d}.png"


# ---------------------------------------------------------------------------------------------
# quality.parquet

def quality_log(run_dir: str | os.PathLike, *, resume: bool = False, start: int = 0) -> MetricsLog:
    """The run's quality.parquet rows (flushed at every append).  Resumed from step `start`:
    the rows of steps <= start are kept (their weights are the resumed ones), later ones
    dropped (they are evaluated again)."""
    log = MetricsLog(run_dir, resume=resume, file=QUALITY_FILE)
    log.truncate(start + 1)
    return log


def read_quality(run_dir: str | os.PathLike) -> list[dict]:
    """The rows of `<run_dir>/quality.parquet` ([] when the run tracked nothing)."""
    path = Path(run_dir) / QUALITY_FILE
    return read_metrics(path) if path.is_file() else []


def has_row(rows: list[dict], role: str, step: int | None = None) -> bool:
    return any(r.get("role") == role and (step is None or r.get("step") == step) for r in rows)


# ---------------------------------------------------------------------------------------------
# Read-only evaluation.

@contextmanager
def read_only():
    """Run the body without leaving a trace in the caller's random streams (torch CPU and
    initialised CUDA devices, numpy, random), thread count or determinism setting."""
    py_state, np_state = random.getstate(), np.random.get_state()
    threads = torch.get_num_threads()
    det, warn_only = (torch.are_deterministic_algorithms_enabled(),
                      torch.is_deterministic_algorithms_warn_only_enabled())
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det, warn_only=warn_only)


def teacher_identity(cfg: RunConfig) -> dict:
    """What names the run's teachers and how they combine: per teacher its checkpoint file
    (path, size, mtime), else the key of its cached pretrained model."""
    from opd.distill.teachers import run_teachers
    t = run_teachers(cfg)
    return {"rule": t.rule, "teachers": [
        {"identity": _identity(cfg, e), "classes": list(e.classes), "weight": e.weight,
         "guided": e.guided} for e in t.entries]}


def _identity(cfg: RunConfig, t: TeacherConfig) -> dict:
    ckpt = t.ckpt or cfg.model.teacher_ckpt
    if ckpt:
        return {"checkpoint": dataset_digest(Path(ckpt)), "preset": t.model or cfg.model.teacher}
    train_file, _ = data_paths(cfg)
    return {"pretrained": pretrain_key(cfg, "teacher", train_file, t)}


def reference_identity(cfg: RunConfig) -> dict:
    """What determines the reference features: the file or the held-out split, the decoder,
    the extractor and its weights."""
    e = cfg.eval
    ref = (dataset_digest(Path(e.reference)) if e.reference
           else dataset_digest(data_paths(cfg)[1]))
    vq = dataset_digest(Path(cfg.model.vq_ckpt)) if cfg.model.vq_ckpt else None
    weights = weights_path(cfg)
    return {"reference": ref, "vq": vq, "extractor": e.extractor,
            "weights": dataset_digest(Path(weights)) if weights else None}


def teacher_cache_key(cfg: RunConfig) -> dict:
    """Teacher identity + every eval setting its figures depend on."""
    n = cfg.eval.num_samples
    return {"teacher": teacher_identity(cfg), "settings": eval_settings(cfg, n),
            "reference": reference_identity(cfg), "model": model_overrides(cfg),
            "version": CACHE_VERSION}


def teacher_cache_path(cfg: RunConfig) -> Path:
    """$OPD_CACHE/quality/teacher-<hash>.json (its grid: the same name, .png)."""
    return cache_root() / "quality" / f"teacher-{config_hash(teacher_cache_key(cfg))}.json"


class Evaluator:
    """What every evaluation of one run shares: the teacher, a student copy (its own module,
    so the trained student's mode, caches and gradients are never touched), the image decoder,
    the reference (features cached on disk) and the held-out split for the KL measures."""

    def __init__(self, cfg: RunConfig, teacher, *, device: torch.device | str | None = None):
        check_eval_config(cfg, cfg.eval.num_samples)
        p = next(teacher.parameters())
        self.cfg, self.teacher = cfg, teacher
        self.device = torch.device(device) if device is not None else p.device
        with read_only():                        # initialising a model draws random numbers
            self.student = create_model(cfg.model.student, **model_overrides(cfg))
        self.student = self.student.to(self.device, p.dtype).eval().requires_grad_(False)
        self.decoder = ImageDecoder(cfg, self.device)
        self.heldout = open_dataset(cfg, "heldout")
        self.kl_cfg = sampling_config(cfg, engine=cfg.rollout.engine, decoding=cfg.rollout.decoding)
        self._reference: str | None = None

    # -- the reference ------------------------------------------------------------------------

    @property
    def reference(self) -> str:
        """eval.reference, else the held-out images' features, saved once under the cache."""
        if self._reference is None:
            if self.cfg.eval.reference:
                self._reference = self.cfg.eval.reference
            else:
                from opd.eval.fidelity import save_reference_statistics
                key = reference_identity(self.cfg)
                path = cache_root() / "quality" / f"reference-{config_hash(key)}.pt"
                if not path.is_file():
                    images = heldout_images(self.cfg, self.decoder)
                    tmp = path.with_suffix(f".tmp{os.getpid()}")
                    save_reference_statistics(images, tmp, extractor=self.cfg.eval.extractor,
                                              weights_path=weights_path(self.cfg))
                    os.replace(tmp, path)
                self._reference = str(path)
        return self._reference

    # -- measuring ----------------------------------------------------------------------------

    def load(self, state: dict) -> None:
        """Copy a student state dict (tensors) into the evaluation copy."""
        self.student.load_state_dict(state)

    def sample_metrics(self, model) -> tuple[dict, Samples]:
        """fid, precision, recall, isc, class_acc of `model`'s eval.num_samples samples."""
        from opd.eval.fidelity import compute_metrics

        e, n = self.cfg.eval, self.cfg.eval.num_samples
        samples = sample_images(model, self.cfg, n, decoder=self.decoder)
        m = compute_metrics(samples.images, self.reference, extractor=e.extractor,
                            weights_path=weights_path(self.cfg), seed=e.seed,
                            isc_splits=min(10, n), batch_size=64)
        class_acc = None
        if e.extractor == DIGITS_EXTRACTOR:
            from opd.eval.run import class_accuracy
            class_acc = class_accuracy(samples.images, samples.labels)
        return {"fid": m["fid"], "precision": m["precision"], "recall": m["recall"],
                "isc": m["isc"], "class_acc": class_acc}, samples

    def save_samples(self, samples: Samples, path: Path) -> Path:
        """One class per column, the first rows of the sample set (fixed keys)."""
        count, nrow, upscale = grid_layout(self.student.num_classes, samples.images.shape[0],
                                           samples.images.shape[-1])
        return save_grid(samples.images[:count], path, nrow=nrow, upscale=upscale)

    def student_row(self, step: int, run_dir: str | os.PathLike) -> dict:
        """Evaluate the loaded student copy as the weights of `step`; writes
        samples/student_step_<step>.png and returns its quality.parquet row."""
        from opd.eval.quality import quality_report

        start = time.perf_counter()
        with read_only():
            metrics, samples = self.sample_metrics(self.student)
            self.save_samples(samples, student_grid_path(run_dir, step))
            q = quality_report(self.student, self.teacher, self.heldout, self.kl_cfg,
                               num_rows=self.cfg.eval.kl_rows)
        return row(step, "student", metrics, self.cfg.eval.num_samples, q["kl_data"],
                   q["kl_samples"], time.perf_counter() - start)

    def teacher_row(self, run_dir: str | os.PathLike) -> dict:
        """The teacher's row (step 0; its KL to itself is 0) and samples/teacher.png, from the
        cache when this teacher was measured at these settings before, else measured now and
        cached."""
        start = time.perf_counter()
        path = teacher_cache_path(self.cfg)
        grid = path.with_suffix(".png")
        if path.is_file() and grid.is_file():
            metrics = json.loads(path.read_text())["metrics"]
        else:
            with read_only():
                metrics, samples = self.sample_metrics(self.teacher)
            path.parent.mkdir(parents=True, exist_ok=True)
            self.save_samples(samples, grid)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"metrics": metrics, "key": teacher_cache_key(self.cfg),
                                       "seconds": time.perf_counter() - start}, indent=1))
            os.replace(tmp, path)
        out = Path(run_dir) / SAMPLES_DIR / TEACHER_GRID
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(grid, out)
        return row(0, "teacher", metrics, self.cfg.eval.num_samples, 0.0, 0.0,
                   time.perf_counter() - start)


def row(step: int, role: str, metrics: dict, samples: int, kl_data: float, kl_samples: float,
        seconds: float) -> dict:
    """One quality.parquet row (COLUMNS); non-finite numbers become None."""
    def clean(v):
        return None if v is None or (isinstance(v, float) and not math.isfinite(v)) else float(v)
    out = {"step": int(step), "role": role,
           **{k: clean(metrics.get(k)) for k in ("fid", "precision", "recall", "isc", "class_acc")},
           "samples": int(samples),
           "kl_data": clean(kl_data), "kl_samples": clean(kl_samples), "seconds": float(seconds)}
    return {k: out[k] for k in COLUMNS}


def evaluate_student(student, teacher, cfg: RunConfig, step: int,
                     out_dir: str | os.PathLike) -> dict:
    """One evaluation of `student` (left as it is: a copy is measured) as the weights of
    `step`; writes out_dir/samples/student_step_<step>.png and returns the quality row.
    A run evaluates many times: keep an `Evaluator` instead of calling this in a loop."""
    ev = Evaluator(cfg, teacher, device=next(student.parameters()).device)
    ev.load(student.state_dict())
    return ev.student_row(step, out_dir)


__all__ = ["Evaluator", "evaluate_student", "is_eval_step", "eval_steps", "quality_log",
           "read_quality", "read_only", "teacher_cache_path", "QUALITY_FILE", "COLUMNS"]
