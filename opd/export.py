"""`opd export`: the student of a training checkpoint as a LlamaGen checkpoint file.

    info = export_student("runs/digits-kd-gkd-…", "student.pt")   # newest complete checkpoint
    info = export_student("runs/x/checkpoints/step_000200", "c2i_S_opd.pt", force=True)

The file holds {"model": state dict} in LlamaGen's key layout, fp32 (like LlamaGen's
c2i_*.pt), so `opd.models.load_llamagen_checkpoint(file, preset)`, `opd eval --ckpt file` and
LlamaGen's own sampling scripts load it.  When the run's config.yaml is there, the weights are
first loaded strictly into the run's `model.student` (a file that would not load is refused).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from opd.checkpoints import STUDENT_FILE, checkpoint_step, find_checkpoint
from opd.models import create_model, load_into, load_state_dict_safely


def export_student(ckpt: str | os.PathLike, out: str | os.PathLike, *,
                   force: bool = False) -> dict:
    """Write the student of `ckpt` (a run directory: its newest complete checkpoint, or a
    checkpoints/step_N directory) to `out` as {"model": state dict}.  An existing `out` is
    refused (FileExistsError) unless `force`.  Returns {path, checkpoint, step, params,
    preset} (preset None when the run's config.yaml is missing and the model was not checked)."""
    ckpt_dir, run_dir = find_checkpoint(ckpt)
    out = Path(out)
    if out.is_dir():
        raise IsADirectoryError(f"--out {out} is a directory; name the file to write, e.g. "
                                f"{out / 'student.pt'}")
    if out.exists() and not force:
        raise FileExistsError(f"--out {out} already exists; pass --force to overwrite it or "
                              f"choose another file")
    source = ckpt_dir / STUDENT_FILE
    state = load_state_dict_safely(source)
    preset = None
    if run_dir is not None and (run_dir / "config.yaml").is_file():
        from opd.config import load_config
        from opd.pretrain import model_overrides
        cfg = load_config(run_dir / "config.yaml")
        preset = cfg.model.student
        load_into(create_model(preset, **model_overrides(cfg)), state, str(source))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    torch.save({"model": state}, tmp)
    os.replace(tmp, out)
    return {"path": str(out), "checkpoint": str(ckpt_dir), "step": checkpoint_step(ckpt_dir),
            "params": sum(v.numel() for v in state.values()), "preset": preset}


__all__ = ["export_student"]
