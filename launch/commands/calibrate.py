"""`opd calibrate`: measure Full vs Compact verifier latency and write gamma for Hybrid HB-SJD.

    opd calibrate --model GPT-B --grid-size 24 --batch 64 --window 16 --cfg-scale 2.0 --device cuda \
        --dtype bfloat16
    opd calibrate --config tiny            # every batch size of a run: its Ray sub-batches and
                                           # evaluation batches (opd.run.calibration.run_batch_sizes)

It writes the one calibration file, $OPD_CACHE/calibration.json (`rollout.calibrate.calibration_file`),
which training (reference loop and Ray rollout workers), evaluation and the benches read with
`gamma="auto"` at a fixed window (`--window auto`, the default config's, measures gamma at
W = 1, 2, 4, 8, 16 for a fixed window chosen later; `window: auto` itself measures its rounds
as it runs and reads no file, rollout/window.py) (key: model shape + dtype + device, batch, W,
CFG on/off).  Latency does not
depend on the weights, so no checkpoint is loaded.
"""
from __future__ import annotations

import argparse

from launch.commands import add_config_args


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _window(text: str) -> int | str:
    return "auto" if text == "auto" else _positive(text)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "calibrate", help="measure Full vs Compact verifier latency; write gamma (JSON)",
        description="Time the HB-SJD verifier forward with Full and Compact execution over active "
                    "counts, choose gamma (Compact below it) and add it to a JSON file that "
                    "engines read with gamma='auto'. Unset options come from the run config.")
    add_config_args(p)
    p.add_argument("--model", metavar="PRESET", help="model preset (default: the config's "
                   "student, with its vocab / classes / grid)")
    p.add_argument("--grid-size", type=_positive, help="grid side for --model (e.g. 24 = 576 "
                   "tokens for LlamaGen at 384 px)")
    p.add_argument("--batch", type=_positive, help="images per batch (default: every batch size "
                   "the run config's rollouts and evaluation use)")
    p.add_argument("--window", type=_window, help="window W, or auto: every window the "
                   "policy chooses from, 1 2 4 8 16 (gamma for each, for a fixed window chosen later; default rollout.window)")
    p.add_argument("--cfg-scale", type=float, metavar="SCALE",
                   help="CFG scale; only on/off matters (default rollout.cfg_scale)")
    p.add_argument("--device", help="cpu or cuda (default: with --model cuda if available, else "
                   "the run's rollout device)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"],
                   help="model dtype (default model.dtype)")
    p.add_argument("--repeats", type=_positive, default=5, help="timed forwards per point")
    p.add_argument("--threads", type=_positive, help="torch intra-op threads (CPU; a table "
                   "is kept per thread count; default: a ray run's rollout workers', else this "
                   "process's)")
    p.add_argument("--out", metavar="FILE", help="another JSON file to add the entries to "
                   "(default, and the only file runs read: $OPD_CACHE/calibration.json)")
    return p


def run_threads(cfg) -> int | None:
    """The torch threads the run's rollouts use on a CPU, which a CPU table is keyed by
    (rollout/calibrate.py `model_signature`): a ray run's rollout workers run their CPU share
    (actors/workers/base.py `cpu_threads`); None for the reference loop (this process's own)
    and for rollouts on a GPU."""
    from actors.workers.base import cpu_threads
    if cfg.run.mode != "ray" or cfg.rollout.num_gpus > 0:
        return None
    return cpu_threads(cfg.rollout.num_cpus)


def run(args: argparse.Namespace) -> int:
    import torch

    from rollout.calibrate import calibration_file
    from opd.run.calibration import run_batch_sizes
    from opd.models import create_model
    from rollout.calibrate import calibrate_windows, save_calibration
    from rollout.window import WINDOWS

    cfg = args.cfg
    threads = args.threads or run_threads(cfg)
    if threads:
        torch.set_num_threads(threads)
    if args.model:
        preset, overrides = args.model, ({"grid_size": args.grid_size} if args.grid_size else {})
        default_device = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        m = cfg.model
        preset = m.student
        overrides = dict(vocab_size=m.vocab_size, num_classes=m.num_classes,
                         grid_size=args.grid_size or m.grid_size)
        on_gpu = cfg.run.mode == "ray" and cfg.rollout.num_gpus > 0
        default_device = "cuda" if on_gpu and torch.cuda.is_available() else "cpu"
    device = args.device or default_device
    dtype = getattr(torch, args.dtype or cfg.model.dtype)
    model = create_model(preset, **overrides).to(device=device, dtype=dtype).eval()
    batches = [args.batch] if args.batch else run_batch_sizes(cfg)
    window = args.window or cfg.rollout.window
    windows = list(WINDOWS) if window == "auto" else [window]
    scale = cfg.rollout.cfg_scale if args.cfg_scale is None else args.cfg_scale
    out = args.out or calibration_file()
    for batch in batches:
        entries = calibrate_windows(model, batch, windows, cfg=scale != 1.0, preset=preset,
                                    repeats=args.repeats)            # interleaved over W
        for W, entry in entries.items():
            save_calibration(out, entry)
            print(f"{'active':>6}  {'full ms':>8}  {'compact ms':>10}")
            for a, f, c in zip(entry["active"], entry["full_s"], entry["compact_s"]):
                print(f"{a:>6}  {f * 1e3:>8.3f}  {c * 1e3:>10.3f}")
            print(f"opd calibrate: {preset} batch {batch} W {W} cfg {scale != 1.0} on "
                  f"{device} ({torch.get_num_threads()} threads): gamma = {entry['gamma']} "
                  f"(Compact below {entry['gamma']} active images) -> {out}")
    return 0
