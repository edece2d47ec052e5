"""`opd eval`: sample quality of a student (FID, IS, precision, recall), or runs side by side.

    opd eval --ckpt runs/digits-kd-gkd-…                    # latest checkpoint of a run
    opd eval --ckpt runs/x/checkpoints/step_000100 --engine cached_ar --num-samples 200
    opd eval --ckpt c2i_B_256.pt --config llamagen.yaml eval.inception_weights=pt_inception.pth
    opd eval --compare runs/a runs/b runs/c --engine cached_ar --out eval-out/table
    opd eval --save-reference ref.pt --config llamagen.yaml   # held-out features, once

Flags are shorthands for config keys: --engine eval.engine, --decoding eval.decoding,
--num-samples eval.num_samples, --reference eval.reference.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import get_args

from launch.commands import add_config_args


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from opd.config.schema import Decoding, EngineName  # no torch: the schema imports yaml and pydantic only

    p = subparsers.add_parser(
        "eval", help="FID / IS / precision / recall of a student, or a comparison of runs",
        description="Generate class-balanced samples from scratch with a rollout engine, decode "
                    "them to images and measure them with torch-fidelity (offline extractors) "
                    "against the held-out split. Writes eval.json and samples.png.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--ckpt", metavar="CKPT",
                      help="run directory of opd train, either run.mode (its config.yaml and newest "
                           "complete checkpoint), a "
                           "checkpoints/step_N directory, or a LlamaGen c2i_*.pt file")
    what.add_argument("--compare", nargs="+", metavar="RUN",
                      help="evaluate each run's final student (reusing a matching eval.json) "
                           "and print a Markdown table")
    what.add_argument("--save-reference", metavar="FILE",
                      help="write the held-out split's features to FILE (for --reference) and exit")
    p.add_argument("--engine", choices=get_args(EngineName), help="rollout engine for the samples "
                   "(eval.engine; default: the run's rollout.engine)")
    p.add_argument("--decoding", choices=get_args(Decoding),
                   help="eval.decoding (default sample; greedy gives one image per class; "
                        "speculative: speculative sampling)")
    p.add_argument("--num-samples", type=int, metavar="N", help="images to generate (eval.num_samples)")
    p.add_argument("--reference", metavar="FILE",
                   help="reference statistics file (eval.reference; default: held-out images)")
    p.add_argument("--out", metavar="PATH", help="--ckpt: output directory (default <run>/eval-<engine>/ "
                   "or eval-out/); --compare: table file, written as .json and .md "
                   "(default eval-out/compare)")
    p.add_argument("--kl-rows", type=int, metavar="N",
                   help="--compare: held-out rows for KL(teacher||student) (default: all)")
    p.add_argument("--fresh", action="store_true", help="--compare: re-evaluate even if eval.json matches")
    add_config_args(p)
    return p


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """The config overrides the shorthand flags stand for."""
    pairs = [("eval.engine", args.engine), ("eval.decoding", args.decoding),
             ("eval.num_samples", args.num_samples), ("eval.reference", args.reference)]
    return [f"{k}={v}" for k, v in pairs if v is not None]


def split_runs(items: list[str]) -> tuple[list[str], list[str]]:
    """(runs, overrides): argparse hands trailing key=value overrides to --compare's nargs="+"."""
    runs = [c for c in items if "=" not in c or Path(c).exists()]
    return runs, [c for c in items if c not in runs]


def run(args: argparse.Namespace) -> int:
    from opd.config.schema import load_config
    from opd.eval.run import (compare, evaluate_checkpoint, format_table, resolve_checkpoint,
                              save_heldout_reference, write_compare)

    overrides = [*args.overrides, *flag_overrides(args)]
    if args.save_reference:
        path = save_heldout_reference(load_config(args.config, overrides), args.save_reference)
        print(f"wrote {path}")
        return 0
    if args.compare:
        runs, extra = split_runs(args.compare)
        rows = compare(runs, config=args.config, overrides=[*overrides, *extra], reuse=not args.fresh,
                       kl_rows=args.kl_rows, progress=True)
        print(format_table(rows))
        for path in write_compare(rows, args.out or "eval-out/compare"):
            print(f"wrote {path}")
        return 0
    ck = resolve_checkpoint(args.ckpt, config=args.config, overrides=overrides)
    report = evaluate_checkpoint(ck, out_dir=args.out, progress=True)
    m = report["metrics"]
    r = report["rollout"]
    print(f"opd eval: {ck.weights} (step {report['step']}), {report['num_samples']} samples, "
          f"{report['engine']} / {report['decoding']}")
    print(f"  FID {m['fid']:.4f}  IS {m['isc']:.4f} ± {m['isc_std']:.4f}  precision "
          f"{m['precision']:.4f}  recall {m['recall']:.4f}")
    print(f"  rollout: {r['rounds']} rounds, {r['mean_committed']:.3f} tokens/round, "
          f"{r['tokens_per_s']:.0f} tokens/s; total {report['seconds']['total']:.1f} s")
    print(f"wrote {report['out_dir']}/eval.json and samples.png")
    return 0
