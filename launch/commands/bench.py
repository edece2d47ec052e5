"""`opd bench <what>`: benchmarks.  Each benchmark is a sub-command registered in BENCHES.

    opd bench rollout --config digits [--json OUT] [--out DIR] [key=value ...]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_rollout(which: argparse._SubParsersAction) -> None:
    r = which.add_parser(
        "rollout", help="all rollout engines on one model: rounds, latency, speedup",
        description="Cached AR, Batch-Synchronous SJD, Independent Batched SJD and HB-SJD "
                    "(Full / Compact / Hybrid) on the same model, labels, prefixes and seed; "
                    "prints a table and saves progress and verifier-latency figures.")
    r.add_argument("--config", default="digits", metavar="PRESET",
                   help="bench preset: a name in configs/bench/ or a YAML path (default digits)")
    r.add_argument("overrides", nargs="*", metavar="key=value",
                   help="preset overrides, values parsed as YAML (e.g. repeats=1 "
                        "batch_sizes=[1])")
    r.add_argument("--json", metavar="OUT", help="also write the full report as JSON")
    r.add_argument("--out", metavar="DIR", help="figure directory (default runs/bench/<preset>)")
    r.set_defaults(bench_run=run_rollout)


BENCHES = [add_rollout]
"""Adders of `opd bench` sub-commands; each sets `bench_run` on its parser."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmarks (rollout engines, ...)",
                              description="Benchmarks; see `opd bench <what> --help`.")
    which = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for add in BENCHES:
        add(which)
    return p


def run(args: argparse.Namespace) -> int:
    return args.bench_run(args) or 0


def _overrides(items: list[str]) -> dict:
    import yaml

    from opd.config import ConfigError
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"bench override {item!r} must look like key=value")
        out[key] = yaml.safe_load(raw)
    return out


def run_rollout(args: argparse.Namespace) -> int:
    from opd.bench.rollout import format_table, load_bench, resolve_bench_preset, run_bench, \
        save_figures

    bench = load_bench(args.config, _overrides(args.overrides))
    report = run_bench(bench)
    print(format_table(report["rows"]))
    out = Path(args.out or Path("runs") / "bench" / resolve_bench_preset(args.config).stem)
    for path in save_figures(report, out):
        print(f"wrote {path}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0
