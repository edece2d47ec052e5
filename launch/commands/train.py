"""`opd train`: on-policy distillation, distributed on Ray (mode=ray) or in one process
(mode=reference).

    opd train                                   # the embedded digits default
    opd train --config tiny run.mode=reference
    opd train --resume runs/digits-gkd-20261130-101500

With eval.track (on by default) the student is evaluated at step 0, every eval.every steps
and at the end (quality.parquet, samples/student_step_N.png); the closing table compares it
with the teacher (quality.md).

Ctrl-C (SIGINT) during the steps: the current step is finished and checkpointed, the command
names the checkpoint and the `--resume` command and exits with 130 (a second Ctrl-C aborts).
Inside `ray job submit` the job's cluster is joined (RAY_ADDRESS); see README "Cluster".
"""
from __future__ import annotations

import argparse
import sys

from launch.commands import add_config_args


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="on-policy distillation (Ray, or reference loop)",
                              description="Distill the teacher into the student on-policy: "
                                          "student rollouts (HB-SJD), teacher scores, student "
                                          "updates. Writes a run directory.")
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue the run in RUN_DIR from its latest checkpoint")
    add_config_args(p)
    return p


def run(args: argparse.Namespace) -> int:
    from actors.interrupt import GracefulInterrupt
    from opd.config import load_config
    from opd.preflight import check_inputs
    from opd.reference import RunInterrupted
    from opd.rundir import prepare_run_dir
    from opd.summary import print_summary

    cfg = args.cfg
    if args.resume:
        cfg = load_config(f"{args.resume}/config.yaml", [f"run.dir={args.resume}"])
    check_inputs(cfg)
    run_dir = prepare_run_dir(cfg, resume=bool(args.resume))
    print(f"opd train: run directory {run_dir} (mode={cfg.run.mode})", flush=True)
    try:
        with GracefulInterrupt() as stop:
            if cfg.run.mode == "reference":
                from opd.reference import run_reference
                rows = run_reference(cfg, run_dir, resume=bool(args.resume), stop=stop.check)
            else:
                from actors.pipeline import run_distributed
                rows = run_distributed(cfg, run_dir, resume=bool(args.resume), interrupt=stop)
    except RunInterrupted as e:
        print(f"opd train: interrupted with {e.step} steps done; checkpoint {e.checkpoint}; "
              f"continue with: opd train --resume {e.run_dir}", file=sys.stderr, flush=True)
        return 130
    from opd.artifacts import plot_training
    from opd.eval.tracking import read_quality
    from opd.summary import write_quality_summary
    plot_training(rows, run_dir / "training.png", quality=read_quality(run_dir))
    print_summary(rows, run_dir)
    table = write_quality_summary(run_dir)
    if table:
        print(f"\nquality ({run_dir}/quality.md)\n{table}", end="")
    return 0
