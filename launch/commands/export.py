"""`opd export`: write a run's student as a LlamaGen checkpoint ({"model": state dict}).

    opd export --ckpt runs/digits-kd-gkd-… --out student.pt            # newest complete checkpoint
    opd export --ckpt runs/x/checkpoints/step_000200 --out c2i_S.pt --force
    opd export --ckpt runs/x --out student.safetensors --format safetensors  # + student.json
"""
from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export", help="write a run's student as a LlamaGen checkpoint file",
        description="Write the student of a training checkpoint (either run.mode) as "
                    "{\"model\": state dict} in LlamaGen's key layout, like LlamaGen's c2i_*.pt.")
    p.add_argument("--ckpt", metavar="RUN_OR_STEP", required=True,
                   help="run directory (its newest complete checkpoint) or a "
                        "checkpoints/step_N directory")
    p.add_argument("--out", metavar="FILE", required=True, help="the .pt file to write")
    p.add_argument("--format", choices=("pt", "safetensors"), default="pt",
                   help="pt: LlamaGen's {\"model\": state dict} (default); safetensors: the "
                        "state dict as safetensors, plus FILE's .json with the model's shape")
    p.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    return p


def run(args: argparse.Namespace) -> int:
    from opd.run.export import export_student

    info = export_student(args.ckpt, args.out, force=args.force, format=args.format)
    model = f", {info['preset']}" if info["preset"] else ""
    print(f"opd export: wrote {info['path']} (step {info['step']}, {info['params']:,} params"
          f"{model}) from {info['checkpoint']}"
          + (f"; model shape in {info['shape']}" if "shape" in info else ""))
    return 0
