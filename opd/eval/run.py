"""Evaluate a student: samples → images → FID / IS / precision / recall; and runs side by side.

    ck = resolve_checkpoint("runs/digits-kd-gkd-…")            # run dir, checkpoint dir or c2i_*.pt
    report = evaluate_checkpoint(ck)                         # writes eval.json + samples.png
    rows = compare(["runs/a", "runs/b"])                     # the paper's Table 1 analogue
    print(format_table(rows))

A checkpoint is one of

    run directory      <run>/config.yaml + <run>/checkpoints/step_N/student.pt (the newest
                       complete N; either run.mode, layout in opd/run/checkpoints.py)
    checkpoint dir     <run>/checkpoints/step_N/student.pt (config from <run>/config.yaml if any)
    weights file       a LlamaGen c2i_*.pt (or any state dict) for the config's model.student

The reference is `eval.reference` (a `save_reference_statistics` file) or the held-out split's
images, decoded exactly as the samples are.  Feature extractors are offline only: `digits-cnn`
for the digits data, `inception-v3-compat` with the local file `eval.inception_weights`.

eval.json holds metrics (fid, isc, isc_std, precision, recall, f_score; for digits also
class_acc, the digits CNN's agreement with the conditioning label), the settings the
samples were made with (engine, decoding, num_samples, seed, sampling knobs), rollout
statistics (rounds, mean committed tokens, tokens/s) and seconds per phase; compare reuses a
run's eval.json when its settings and checkpoint match.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from opd.run.checkpoints import STUDENT_FILE, checkpoint_step, find_checkpoint
from opd.config.schema import RunConfig, load_config
from opd.config.loader import ConfigError
from opd.eval.features import DIGITS_EXTRACTOR, INCEPTION_EXTRACTOR, inception_weights_path
from opd.eval.grid import save_grid
from opd.eval.sample import ImageDecoder, is_digits, sample_images, sampling_config
from opd.models import load_llamagen_checkpoint
from opd.models.factory import model_overrides
from opd.data.splits import open_dataset

EVAL_FILE = "eval.json"
GRID_FILE = "samples.png"
MIN_SAMPLES = 4
"""3-NN precision / recall need more than 3 images (IS uses min(10, N) splits); meaningful
FID needs far more (thousands for ImageNet; a few hundred for digits)."""


@dataclass
class Checkpoint:
    """A resolved `--ckpt`: the config to evaluate under and the student weights file."""
    cfg: RunConfig
    weights: Path           # file holding the student state dict (under "model" or top level)
    kind: str               # "run" | "checkpoint" | "file"
    run_dir: Path | None    # the run it belongs to, if any
    step: int | None        # learner step of the checkpoint, if known

    @property
    def name(self) -> str:
        return (self.run_dir or self.weights).name


def resolve_checkpoint(ckpt: str | os.PathLike, *, config: str | os.PathLike | None = None,
                       overrides: list[str] | tuple[str, ...] = ()) -> Checkpoint:
    """Find the config and the weights for `ckpt` (see the module docstring).

    The config is `config` (a preset or YAML path) when given, else the run's config.yaml,
    else the embedded default; `overrides` apply on top."""
    path = Path(ckpt)
    if not path.exists():
        raise FileNotFoundError(f"--ckpt {str(path)!r} does not exist; pass a run directory, a "
                                f"checkpoints/step_N directory or a c2i_*.pt weights file")
    if path.is_dir():
        ckpt_dir, run_dir = find_checkpoint(path)      # CheckpointError naming path and fix
        kind = "checkpoint" if ckpt_dir == path else "run"
        weights, step = ckpt_dir / STUDENT_FILE, checkpoint_step(ckpt_dir)
    else:
        kind, weights, run_dir, step = "file", path, None, None
    if config is None and run_dir is not None and (run_dir / "config.yaml").is_file():
        cfg = load_config(run_dir / "config.yaml", overrides)
    else:
        cfg = load_config(config, overrides)
    return Checkpoint(cfg, weights, kind, run_dir, step)


def load_student(ck: Checkpoint, device: str | torch.device = "cpu"):
    """The student GPT (preset model.student) with the checkpoint's weights, eval mode."""
    model = load_llamagen_checkpoint(ck.weights, ck.cfg.model.student, **model_overrides(ck.cfg))
    return model.to(device).eval().requires_grad_(False)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ---------------------------------------------------------------------------------------------
# Checks made before any sampling.

def check_eval_config(cfg: RunConfig, num_samples: int) -> None:
    """Errors a user can fix, raised before anything is generated."""
    e = cfg.eval
    if num_samples < MIN_SAMPLES:
        raise ConfigError(f"eval.num_samples={num_samples}: FID / IS / precision-recall need at least "
                          f"{MIN_SAMPLES} images (meaningful numbers need hundreds)", "eval.num_samples")
    if e.extractor == INCEPTION_EXTRACTOR:
        inception_weights_path(e.inception_weights)     # FileNotFoundError naming file and key
    elif not is_digits(cfg):
        raise ConfigError(f"eval.extractor={DIGITS_EXTRACTOR!r} only measures the digits data; for "
                          f"data.dataset={cfg.data.dataset!r} set eval.extractor={INCEPTION_EXTRACTOR} "
                          f"and eval.inception_weights=/path/to/weights", "eval.extractor")
    if e.reference is not None and not os.path.isfile(e.reference):
        raise FileNotFoundError(f"eval.reference {e.reference!r} does not exist; write one with "
                                f"`opd eval --save-reference FILE` or unset it to use the held-out split")


def weights_path(cfg: RunConfig) -> str | None:
    """The extractor's weights file: eval.inception_weights for Inception, else the cached CNN."""
    return cfg.eval.inception_weights if cfg.eval.extractor == INCEPTION_EXTRACTOR else None


def heldout_images(cfg: RunConfig, decoder: ImageDecoder, limit: int | None = None) -> Tensor:
    """uint8 (N, 3, H, W): the held-out split's token sequences decoded like the samples."""
    heldout = open_dataset(cfg, "heldout")
    n = heldout.num_rows if limit is None else min(limit, heldout.num_rows)
    return decoder(torch.from_numpy(heldout.tokens[:n]))


def save_heldout_reference(cfg: RunConfig, path: str | os.PathLike, *, limit: int | None = None) -> Path:
    """Write the held-out images' features (`save_reference_statistics`) to `path`, so later
    evaluations read `eval.reference=path` instead of decoding the split again."""
    from opd.eval.fidelity import save_reference_statistics

    check_eval_config(cfg, MIN_SAMPLES)
    images = heldout_images(cfg, ImageDecoder(cfg, default_device()), limit)
    return save_reference_statistics(images, path, extractor=cfg.eval.extractor,
                                     weights_path=weights_path(cfg))


# ---------------------------------------------------------------------------------------------
# One model.

def eval_settings(cfg: RunConfig, num_samples: int) -> dict:
    """Everything that determines an evaluation's numbers (compared before reusing eval.json)."""
    scfg = sampling_config(cfg)
    r, e = scfg.rollout, cfg.eval
    return {"engine": r.engine, "decoding": r.decoding, "num_samples": num_samples,
            "seed": e.seed, "cfg_scale": r.cfg_scale, "temperature": r.temperature,
            "top_k": r.top_k, "top_p": r.top_p, "extractor": e.extractor,
            "reference": e.reference or "heldout"}


def default_out_dir(ck: Checkpoint, cfg: RunConfig) -> Path:
    """<run>/eval-<engine>[-greedy][-step_N] for run checkpoints, else eval-out/."""
    scfg = sampling_config(cfg)
    name = f"eval-{scfg.rollout.engine}" + ("-greedy" if scfg.rollout.decoding == "greedy" else "")
    if ck.run_dir is None:
        return Path("eval-out")
    if ck.kind == "checkpoint" and ck.step is not None:
        name += f"-step_{ck.step:06d}"
    return ck.run_dir / name


def grid_layout(num_classes: int, num_images: int, side: int) -> tuple[int, int, int]:
    """(images in the grid, images per row, upscale): one class per column for up to 16
    classes, at most 8 rows, each image at least 64 px."""
    nrow = num_classes if num_classes <= 16 else 8
    return min(num_images, nrow * 8), nrow, max(1, 64 // side)


def evaluate(model, cfg: RunConfig, out_dir: str | os.PathLike, *, num_samples: int | None = None,
             info: dict | None = None, progress: bool = False) -> dict:
    """Sample `num_samples` (default eval.num_samples) class-balanced images from `model`,
    measure them against the reference and write out_dir/eval.json and out_dir/samples.png.

    Returns the eval.json content: metrics {fid, isc, isc_std, precision, recall, f_score;
    class_acc for digits: the digits CNN's agreement with the conditioning labels},
    settings, rollout statistics, class_counts, seconds {sampling, decoding, reference,
    metrics, total}, plus `info` (checkpoint, run, step)."""
    from opd.eval.fidelity import compute_metrics

    start = time.perf_counter()
    n = num_samples or cfg.eval.num_samples
    check_eval_config(cfg, n)
    device = next(model.parameters()).device
    decoder = ImageDecoder(cfg, device)
    t0 = time.perf_counter()
    reference = cfg.eval.reference or heldout_images(cfg, decoder)
    ref_seconds = time.perf_counter() - t0
    samples = sample_images(model, cfg, n, decoder=decoder, progress=progress)
    t0 = time.perf_counter()
    metrics = compute_metrics(samples.images, reference, extractor=cfg.eval.extractor,
                              weights_path=weights_path(cfg), seed=cfg.eval.seed,
                              isc_splits=min(10, n), batch_size=64)
    if cfg.eval.extractor == DIGITS_EXTRACTOR:
        metrics["class_acc"] = class_accuracy(samples.images, samples.labels)
    metric_seconds = time.perf_counter() - t0
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    count, nrow, upscale = grid_layout(model.num_classes, n, samples.images.shape[-1])
    save_grid(samples.images[:count], out / GRID_FILE, nrow=nrow, upscale=upscale)
    report = {
        **(info or {}),
        "metrics": metrics,
        "engine": samples.stats["engine"], "decoding": samples.stats["decoding"],
        "num_samples": n,
        "settings": eval_settings(cfg, n),
        "reference_images": None if isinstance(reference, str) else int(reference.shape[0]),
        "rollout": samples.stats,
        "class_counts": torch.bincount(samples.labels, minlength=model.num_classes).tolist(),
        "grid": GRID_FILE,
        "seconds": {**samples.seconds, "reference": ref_seconds, "metrics": metric_seconds,
                    "total": time.perf_counter() - start},
    }
    (out / EVAL_FILE).write_text(json.dumps(report, indent=1) + "\n")
    return report


@torch.no_grad()
def class_accuracy(images: Tensor, labels: Tensor) -> float:
    """Fraction of uint8 digit images (N, 3, H, W) that the digits CNN classifies as the class
    they were generated for (labels (N,)): how well the samples follow their condition."""
    from opd.eval.features import classifier_accuracy, load_digits_cnn

    return classifier_accuracy(load_digits_cnn()[0], images.cpu(), labels.cpu())


@torch.no_grad()
def per_class_accuracy(images: Tensor, labels: Tensor, num_classes: int) -> list[float]:
    """`class_accuracy` of each class's samples: [class 0, class 1, ...] (NaN for a class
    without samples)."""
    from opd.eval.features import load_digits_cnn

    predicted = load_digits_cnn()[0].eval()(images.cpu())[1].argmax(-1)
    right = predicted == labels.cpu()
    return [float(right[labels.cpu() == c].float().mean()) if (labels == c).any()
            else float("nan") for c in range(num_classes)]


def checkpoint_info(ck: Checkpoint) -> dict:
    """What eval.json records about the evaluated checkpoint and the run that trained it."""
    info = {"checkpoint": str(ck.weights), "checkpoint_kind": ck.kind, "step": ck.step,
            "checkpoint_mtime": ck.weights.stat().st_mtime,
            "run_dir": None if ck.run_dir is None else str(ck.run_dir)}
    if ck.run_dir is not None:
        r, d = ck.cfg.rollout, ck.cfg.distill
        info["training"] = {"engine": r.engine, "decoding": r.decoding, "objective": d.objective,
                            "steps": d.steps, "mode": ck.cfg.run.mode}
    return info


def evaluate_checkpoint(ck: Checkpoint | str | os.PathLike, *, out_dir: str | os.PathLike | None = None,
                        num_samples: int | None = None, with_kl: bool = False, reuse: bool = False,
                        kl_rows: int | None = None, progress: bool = False) -> dict:
    """`evaluate` the student of a checkpoint (a `Checkpoint` or anything `resolve_checkpoint`
    takes) into out_dir (default `default_out_dir`); the report also gets `out_dir`.

    with_kl: add `quality` (opd.eval.quality.quality_report: held-out KL(teacher‖student) `kl_data`,
    on-policy `kl_samples`, NLLs) on the first `kl_rows` held-out rows (None: all).
    reuse: return an existing eval.json instead when its settings and checkpoint match."""
    if not isinstance(ck, Checkpoint):
        ck = resolve_checkpoint(ck)
    cfg, n = ck.cfg, num_samples or ck.cfg.eval.num_samples
    out = Path(out_dir) if out_dir is not None else default_out_dir(ck, cfg)
    info = checkpoint_info(ck)
    report = _matching_report(out / EVAL_FILE, eval_settings(cfg, n), info) if reuse else None
    student = None
    if report is None:
        check_eval_config(cfg, n)
        student = load_student(ck, default_device())
        report = evaluate(student, cfg, out, num_samples=n, info=info, progress=progress)
    if with_kl and (report.get("quality") is None or report.get("quality_rows") != kl_rows):
        student = student or load_student(ck, default_device())
        t0 = time.perf_counter()
        report["quality"] = heldout_quality(student, cfg, kl_rows)
        report["quality_rows"] = kl_rows
        report["seconds"]["quality"] = time.perf_counter() - t0
        (out / EVAL_FILE).write_text(json.dumps(report, indent=1) + "\n")
    report["out_dir"] = str(out)
    return report


def _matching_report(path: Path, settings: dict, info: dict) -> dict | None:
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    same = (report.get("settings") == settings
            and all(report.get(k) == info[k] for k in ("checkpoint", "step", "checkpoint_mtime")))
    return report if same else None


def heldout_quality(student, cfg: RunConfig, num_rows: int | None = None) -> dict:
    """`opd.eval.quality.quality_report` against the run's teacher (its teachers, as the one
    model the run distilled towards: `opd.distill.ensemble.load_teacher`), with the run's
    training rollout (engine and decoding; an uncalibrated gamma='auto' falls back as in
    sampling)."""
    from opd.distill.ensemble import load_teacher
    from opd.eval.quality import quality_report

    teacher = load_teacher(cfg, progress=False, device=next(student.parameters()).device)
    qcfg = sampling_config(cfg, engine=cfg.rollout.engine, decoding=cfg.rollout.decoding)
    return quality_report(student, teacher, open_dataset(cfg, "heldout"), qcfg, num_rows=num_rows)


# ---------------------------------------------------------------------------------------------
# Several runs side by side.

COLUMNS = [("run", "run"), ("training rollout", "train_rollout"), ("steps", "steps"),
           ("FID ↓", "fid"), ("IS ↑", "isc"), ("precision ↑", "precision"),
           ("recall ↑", "recall"), ("class acc ↑", "class_acc"),
           ("KL(T‖S) held-out ↓", "kl_teacher_student"),
           ("rollout s/step (train)", "train_rollout_s")]


def compare(ckpts: list[str | os.PathLike], *, config: str | os.PathLike | None = None,
            overrides: list[str] | tuple[str, ...] = (), num_samples: int | None = None,
            reuse: bool = True, kl_rows: int | None = None, progress: bool = False) -> list[dict]:
    """Evaluate each run's final student (reusing a matching eval.json) and return one row per
    run: run, training engine/decoding, steps, fid, isc, precision, recall, held-out
    KL(teacher‖student) per token, on-policy KL, the training rollout's mean seconds per step
    and committed tokens per round, and the evaluation engine/decoding."""
    rows = []
    for ckpt in ckpts:
        ck = resolve_checkpoint(ckpt, config=config, overrides=overrides)
        rep = evaluate_checkpoint(ck, num_samples=num_samples, with_kl=True, reuse=reuse,
                                  kl_rows=kl_rows, progress=progress)
        train = rep.get("training") or {}
        m, q = rep["metrics"], rep["quality"]
        rows.append({
            "run": ck.name, "run_dir": rep["run_dir"], "checkpoint": rep["checkpoint"],
            "train_engine": train.get("engine"), "train_decoding": train.get("decoding"),
            "train_rollout": (f"{train['engine']} / {train['decoding']}" if train else "—"),
            "objective": train.get("objective"), "steps": rep["step"],
            "fid": m["fid"], "isc": m["isc"], "isc_std": m["isc_std"],
            "precision": m["precision"], "recall": m["recall"], "class_acc": m.get("class_acc"),
            "kl_teacher_student": q["kl_data"], "kl_samples": q["kl_samples"],
            **_training_speed(ck.run_dir),
            "eval_engine": rep["engine"], "eval_decoding": rep["decoding"],
            "num_samples": rep["num_samples"], "eval_dir": rep["out_dir"],
        })
    return rows


def _training_speed(run_dir: Path | None) -> dict:
    """Mean rollout seconds per student step and committed tokens per round, from metrics.parquet."""
    path = None if run_dir is None else run_dir / "metrics.parquet"
    if path is None or not path.is_file():
        return {"train_rollout_s": None, "train_mean_committed": None}
    from opd.run.metrics_log import read_metrics
    rows = [r for r in read_metrics(path) if r.get("source") == "student"]
    if not rows:
        return {"train_rollout_s": None, "train_mean_committed": None}
    return {"train_rollout_s": sum(r["rollout_s"] for r in rows) / len(rows),
            "train_mean_committed": sum(r["mean_committed"] for r in rows) / len(rows)}


def _cell(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 10 else f"{value:.2f}"
    return str(value)


def format_table(rows: list[dict]) -> str:
    """Markdown table of `compare` rows, with a line saying how the samples were made."""
    lines = ["| " + " | ".join(h for h, _ in COLUMNS) + " |",
             "|" + "|".join("---" if k in ("run", "train_rollout") else "---:" for _, k in COLUMNS) + "|"]
    lines += ["| " + " | ".join(_cell(r.get(k)) for _, k in COLUMNS) + " |" for r in rows]
    made = sorted({f"{r['num_samples']} samples, {r['eval_engine']} / {r['eval_decoding']}" for r in rows})
    return "\n".join(lines) + f"\n\nEvaluation: {'; '.join(made)}; KL per token in nats.\n"


def write_compare(rows: list[dict], path: str | os.PathLike) -> tuple[Path, Path]:
    """`path` with suffix .json (the rows) and .md (the table); returns both paths."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    js, md = path.with_suffix(".json"), path.with_suffix(".md")
    js.write_text(json.dumps(rows, indent=1) + "\n")
    md.write_text(format_table(rows))
    return js, md


__all__ = ["Checkpoint", "resolve_checkpoint", "load_student", "evaluate", "evaluate_checkpoint",
           "compare", "format_table", "write_compare", "save_heldout_reference",
           "heldout_quality", "check_eval_config", "default_out_dir"]
