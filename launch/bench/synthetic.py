"""Synthetic inputs for a dry run at a real model's shapes: random-token Parquet data and
random-weight checkpoints, written at run time so nothing is downloaded.

    overrides = prepare_synthetic(cfg, out / "synthetic")     # ["data.dataset=parquet", ...]
    cfg = apply_overrides(cfg, overrides)

Data: `rows` train and `heldout_rows` held-out sequences of uniform token ids in [0, vocab_size)
and uniform labels in [0, num_classes), written by `opd.data.write_token_parquet` (tokenizer
"synthetic-uniform").  Weights: the student and teacher presets of `cfg.model` with every matrix
drawn from normal(0, init_std) (LlamaGen's own init zeroes the output head, which would make
every logit tie), saved as LlamaGen checkpoints ({"model": state dict}, float32).  Each model is
built in a child process, so the caller's peak memory does not carry a teacher-sized model.
Files are reused when a stamp of the same shapes, seed and std is present.
"""
from __future__ import annotations

import json
import multiprocessing
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from opd.config.schema import RunConfig

STAMP = "synthetic.json"


def _write_model(preset: str, overrides: dict, path: str, init_std: float, seed: int) -> None:
    from opd.models import create_model
    torch.manual_seed(seed)
    net = create_model(preset, **overrides)
    with torch.no_grad():
        for p in net.parameters():
            if p.dim() > 1:
                p.normal_(0.0, init_std)
    torch.save({"model": net.state_dict()}, path)


def _in_child(fn: Callable, *args) -> None:
    proc = multiprocessing.get_context("spawn").Process(target=fn, args=args)
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"writing a synthetic checkpoint failed (exit code {proc.exitcode}): "
                           f"{args[2]}")


def prepare_synthetic(cfg: RunConfig, out_dir: str | Path, *, rows: int = 64,
                      heldout_rows: int = 16, init_std: float = 0.02, seed: int = 0,
                      log: Callable = print) -> list[str]:
    """Write (or reuse) the synthetic dataset and checkpoints for `cfg`'s model shapes in
    `out_dir`; returns the dotted overrides that point a run config at them."""
    from opd.data import write_token_parquet
    from opd.models.factory import model_overrides
    out = Path(out_dir)
    m = cfg.model
    shapes = model_overrides(cfg)
    stamp = {"student": m.student, "teacher": m.teacher, **shapes, "rows": rows,
             "heldout_rows": heldout_rows, "init_std": init_std, "seed": seed}
    files = {"train": out / "train.parquet", "heldout": out / "heldout.parquet",
             "student": out / "student.pt", "teacher": out / "teacher.pt"}
    have = out / STAMP
    fresh = (have.is_file() and json.loads(have.read_text()) == stamp
             and all(f.is_file() for f in files.values()))
    if not fresh:
        out.mkdir(parents=True, exist_ok=True)
        have.unlink(missing_ok=True)
        rng = np.random.default_rng(seed)
        for split, n in (("train", rows), ("heldout", heldout_rows)):
            write_token_parquet(files[split], rng.integers(0, m.num_classes, n),
                                rng.integers(0, m.vocab_size, (n, m.grid_size ** 2)),
                                vocab_size=m.vocab_size, num_classes=m.num_classes,
                                grid_size=m.grid_size, tokenizer="synthetic-uniform")
        for role, preset, s in (("student", m.student, seed), ("teacher", m.teacher, seed + 1)):
            log(f"synthetic: random {preset} weights -> {files[role]}")
            _in_child(_write_model, preset, shapes, str(files[role]), init_std, s)
        have.write_text(json.dumps(stamp, indent=1) + "\n")
    return ["data.dataset=parquet", f"data.train={files['train']}",
            f"data.heldout={files['heldout']}", f"model.student_ckpt={files['student']}",
            f"model.teacher_ckpt={files['teacher']}"]
