"""`opd export`: the student of a training checkpoint as a LlamaGen checkpoint file, or as
safetensors.

    info = export_student("runs/digits-kd-gkd-…", "student.pt")   # newest complete checkpoint
    info = export_student("runs/x/checkpoints/step_000200", "c2i_S_opd.pt", force=True)
    info = export_student("runs/x", "student.safetensors", format="safetensors")  # + student.json

`pt` (the default) holds {"model": state dict} in LlamaGen's key layout, fp32 (like LlamaGen's
c2i_*.pt), so `opd.models.load_llamagen_checkpoint(file, preset)`, `opd eval --ckpt file` and
LlamaGen's own sampling scripts load it.  `safetensors` holds the same state dict, tensor for
tensor (read without pickle), and a JSON beside it (<out>.json) with the model's shape:
LlamaGen's preset name, vocab_size, num_classes, grid_size, the step and the parameter count.
Every reader of model.student_ckpt / model.teacher_ckpt / `opd eval --ckpt` takes either.  When
the run's config.yaml is there, the weights are first loaded strictly into the run's
`model.student` (a file that would not load is refused).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

import torch

from opd.run.checkpoints import STUDENT_FILE, checkpoint_step, find_checkpoint
from opd.models import create_model, load_into, load_state_dict_safely


FORMATS = ("pt", "safetensors")


def shape_path(out: str | os.PathLike) -> Path:
    """The JSON beside a safetensors export: student.safetensors -> student.json."""
    return Path(out).with_suffix(".json")


def export_student(ckpt: str | os.PathLike, out: str | os.PathLike, *,
                   force: bool = False, format: Literal["pt", "safetensors"] = "pt") -> dict:
    """Write the student of `ckpt` (a run directory: its newest complete checkpoint, or a
    checkpoints/step_N directory) to `out`: `pt` as {"model": state dict}, `safetensors` as the
    state dict plus shape_path(out).  An existing `out` (or JSON) is refused (FileExistsError)
    unless `force`.  Returns {path, checkpoint, step, params, preset} (preset None when the
    run's config.yaml is missing and the model was not checked), and `shape` (the JSON's path)
    for safetensors."""
    if format not in FORMATS:
        raise ValueError(f"--format {format!r}: choose one of {', '.join(FORMATS)}")
    ckpt_dir, run_dir = find_checkpoint(ckpt)
    out = Path(out)
    if out.is_dir():
        raise IsADirectoryError(f"--out {out} is a directory; name the file to write, e.g. "
                                f"{out / 'student.pt'}")
    for path in (out, shape_path(out)) if format == "safetensors" else (out,):
        if path.exists() and not force:
            raise FileExistsError(f"--out {path} already exists; pass --force to overwrite it "
                                  f"or choose another file")
    source = ckpt_dir / STUDENT_FILE
    state = load_state_dict_safely(source)
    preset, shape = None, {}
    if run_dir is not None and (run_dir / "config.yaml").is_file():
        from opd.config.schema import load_config
        from opd.models.factory import model_overrides
        cfg = load_config(run_dir / "config.yaml")
        preset = cfg.model.student
        load_into(create_model(preset, **model_overrides(cfg)), state, str(source))
        shape = {"vocab_size": cfg.model.vocab_size, "num_classes": cfg.model.num_classes,
                 "grid_size": cfg.model.grid_size}
    info = {"path": str(out), "checkpoint": str(ckpt_dir), "step": checkpoint_step(ckpt_dir),
            "params": sum(v.numel() for v in state.values()), "preset": preset}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    if format == "pt":
        torch.save({"model": state}, tmp)
    else:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp),
                  metadata={"format": "pt", "model": preset or ""})
        meta = {"model": preset, **shape, "step": info["step"], "params": info["params"],
                "weights": out.name, "layout": "LlamaGen GPT state dict"}
        side = shape_path(out)
        side_tmp = side.with_name(side.name + ".tmp")
        side_tmp.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(side_tmp, side)
        info["shape"] = str(side)
    os.replace(tmp, out)
    return info


__all__ = ["export_student"]
