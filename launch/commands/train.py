"""`opd train`: on-policy distillation, distributed on Ray (mode=ray) or in one process
(mode=reference), in the phases of `distill.phases` (the digits default: KD on data, then
on-policy GKD on HB-SJD student rollouts).

    opd train                                   # the embedded digits default
    opd train distill.objective=kd              # plain KD on data for the whole run
    opd train --config tiny run.mode=reference
    opd train --resume runs/digits-kd-gkd-20261130-101500

With eval.track (on by default) the student is evaluated at step 0, every eval.every steps
and at the end (quality.parquet, samples/student_step_N.png); the closing table compares it
with the teacher (quality.md).

Ctrl-C (SIGINT) during the steps: the current step is finished and checkpointed, the command
names the checkpoint and the `--resume` command and exits with 130 (a second Ctrl-C aborts
without a checkpoint, naming the last complete one; also 130).  The run directory is locked
while the command runs (opd/run/rundir.py); a full disk or an unwritable directory is one line and
exit code 2, earlier checkpoints intact.
Inside `ray job submit` the job's cluster is joined (RAY_ADDRESS); see docs/CLUSTER.md.
"""
from __future__ import annotations

import argparse
import errno
import sys
from pathlib import Path

from launch.commands import add_config_args


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="on-policy distillation (Ray, or reference loop)",
                              description="Distill the teacher into the student in the phases "
                                          "of distill.phases; the default: 2,400 steps, KD on "
                                          "data for 1,800, then on-policy GKD for 600, where 3/4 "
                                          "of the batches are the current student's HB-SJD "
                                          "rollouts (keyed sampling: Cached AR's tokens for the "
                                          "seed), streamed piece by piece to the teacher and the "
                                          "learner; evaluations on 1,000 samples every 600 steps. "
                                          "distill.objective=kd alone: plain KD on data for the "
                                          "whole run. Writes a run directory.")
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue the run in RUN_DIR from its latest checkpoint")
    add_config_args(p)
    return p


def run(args: argparse.Namespace) -> int:
    from opd.config.schema import check_resume_overrides, check_retired_keys, load_config
    from opd.config.loader import ConfigError
    from opd.config.files import save_config
    from opd.run.preflight import check_inputs
    from opd.run.rundir import (CONFIG_FILE, RunDirError, check_saved_config, prepare_run_dir,
                            release_lock)

    cfg = args.cfg
    if args.resume:
        if not (Path(args.resume) / CONFIG_FILE).is_file():
            raise RunDirError(f"cannot resume from {args.resume}: it holds no {CONFIG_FILE}; "
                              f"pass the directory of an earlier opd train run")
        if args.config is not None:
            raise ConfigError(f"--resume takes the run's own {CONFIG_FILE}, not --config "
                              f"{args.config}; pass only key=value overrides of what may change")
        check_retired_keys(args.overrides)
        check_resume_overrides(args.overrides)
        check_saved_config(args.resume)
        cfg = load_config(f"{args.resume}/{CONFIG_FILE}",
                          [*args.overrides, f"run.dir={args.resume}"])
    check_inputs(cfg)
    run_dir = prepare_run_dir(cfg, resume=bool(args.resume))     # takes run_dir/lock
    if args.resume and args.overrides:       # the next resume continues with them too
        save_config(cfg, run_dir / CONFIG_FILE)
        print(f"opd train: resuming {run_dir} with {' '.join(args.overrides)}", file=sys.stderr,
              flush=True)
    try:
        return train(cfg, run_dir, resume=bool(args.resume))
    finally:
        release_lock(run_dir)


WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
"""OSErrors of a disk or directory the user can fix: one line, exit 2, not a stack trace."""


def train(cfg, run_dir: Path, *, resume: bool) -> int:
    """The run in `run_dir` (locked), its plots and tables; 130 after Ctrl-C."""
    from opd.run.interrupt import GracefulInterrupt
    from opd.run.checkpoints import latest_checkpoint
    from opd.run.loop import RunInterrupted
    from opd.run.rundir import RunDirError
    from opd.run.summary import print_summary

    print(f"opd train: run directory {run_dir} (mode={cfg.run.mode})", flush=True)
    try:
        with GracefulInterrupt() as interrupt:
            if cfg.run.mode == "reference":
                from opd.run.reference import run_reference
                rows = run_reference(cfg, run_dir, resume=resume, interrupt=interrupt)
            else:
                from actors.driver.pipeline import run_distributed
                rows = run_distributed(cfg, run_dir, resume=resume, interrupt=interrupt)
    except RunInterrupted as e:
        print(f"opd train: interrupted with {e.step} steps done; checkpoint {e.checkpoint}; "
              f"continue with: opd train --resume {e.run_dir}", file=sys.stderr, flush=True)
        return 130
    except KeyboardInterrupt:               # a second Ctrl-C, or one during start-up
        last = latest_checkpoint(run_dir, report=None)
        print(f"opd train: aborted without a checkpoint of this step; "
              f"{f'the last complete one is {last}' if last else 'no checkpoint was written'}; "
              f"continue with: opd train --resume {run_dir}", file=sys.stderr, flush=True)
        return 130
    except OSError as e:
        if e.errno not in WRITE_ERRNOS:
            raise
        raise RunDirError(f"{e.filename or run_dir}: {e.strerror}; free space or fix the "
                          f"permissions there, then continue with: opd train --resume "
                          f"{run_dir}") from None
    from opd.run.artifacts import plot_training
    from opd.eval.tracking import read_quality
    from opd.run.summary import write_quality_summary
    plot_training(rows, run_dir / "training.png", quality=read_quality(run_dir))
    print_summary(rows, run_dir)
    table = write_quality_summary(run_dir)
    if table:
        print(f"\nquality ({run_dir}/quality.md)\n{table}", end="")
    return 0
