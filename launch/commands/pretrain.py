"""`opd pretrain`: supervised teacher and student for the configured data (cached by config).

    opd pretrain                      # both roles of the embedded digits default
    opd pretrain --role teacher pretrain.teacher_steps=800
"""
from __future__ import annotations

import argparse

from launch.commands import add_config_args


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("pretrain", help="supervised next-token pretraining (cached)",
                              description="Train the teacher and student presets with "
                                          "cross-entropy on the configured dataset; results are "
                                          "cached by config hash and reused by `opd train`.")
    p.add_argument("--role", choices=("teacher", "student", "both"), default="both",
                   help="which model to pretrain (default: both)")
    p.add_argument("--force", action="store_true", help="retrain even if a cached model exists")
    add_config_args(p)
    return p


def run(args: argparse.Namespace) -> int:
    from opd.models.factory import pretrained_model

    roles = ("teacher", "student") if args.role == "both" else (args.role,)
    reports = [pretrained_model(args.cfg, role, force=args.force)[1] for role in roles]
    print(f"{'role':8} {'preset':14} {'params':>9} {'steps':>6} {'seconds':>8} "
          f"{'held-out NLL':>13} {'unigram NLL':>12}  file")
    for r in reports:
        print(f"{r['role']:8} {r['preset']:14} {r['params']:9,d} {r['steps']:6d} "
              f"{r['seconds']:8.1f} {r['heldout_nll']:13.4f} {r['unigram_nll']:12.4f}  {r['path']}")
    return 0
