"""`opd bench <what>`: benchmarks.  Each benchmark is a sub-command registered in BENCHES.

    opd bench rollout --config digits [--json OUT] [--out DIR] [key=value ...]
    opd bench paper --config digits_paper [--out DIR] [key=value ...]
    opd bench table1 --config table1_gpu [--out DIR] [key=value ...]
    opd bench step [--config RUN_PRESET] [--modes reference,ray] [--compile false,true]
                   [--out DIR] [--synthetic] [key=value ...]
    opd bench schedules --config schedules_digits8 [--out DIR] [key=value ...]
    opd bench teachers --config digits_two_teachers [--samples N] [--out DIR] [key=value ...]
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


def _preset_args(r: argparse.ArgumentParser, default: str, example: str) -> None:
    """--config PRESET (a bench preset), key=value overrides and --out DIR."""
    r.add_argument("--config", default=default, metavar="PRESET",
                   help=f"bench preset: a name in configs/bench/ or a YAML path (default {default})")
    r.add_argument("overrides", nargs="*", metavar="key=value",
                   help=f"preset overrides, values parsed as YAML (e.g. {example})")
    r.add_argument("--out", metavar="DIR", help="output directory (default runs/bench/<preset>)")


def add_paper(which: argparse._SubParsersAction) -> None:
    r = which.add_parser(
        "paper", help="the paper's ablations side by side: tables, JSON and plots",
        description="Each of the paper's ablations (engines, execution, rollout length, batch, "
                    "window, history offset, gamma, checkpoints, verification) on one preset, "
                    "its variants measured interleaved in this process; writes paper.json, "
                    "paper.md (a table per ablation with the paper's figure beside ours) and "
                    "one PNG per ablation.")
    _preset_args(r, "digits_paper", "repeats=1 ablations=[engines,window] device=cpu")
    r.set_defaults(bench_run=run_paper)


def add_table1(which: argparse._SubParsersAction) -> None:
    r = which.add_parser(
        "table1", help="the paper's Table 1 rollout rows: Cached AR vs HB-SJD, eager and compiled",
        description="Cached AR and HB-SJD rollouts of run presets' shapes (GKD / VarKD LlamaGen "
                    "presets, the digits student pretrained on the spot), eager and compiled: "
                    "time mean and P95, speedup, rounds, tokens and operators per round; "
                    "placeholders where the preset wants a GPU and none is present. Writes "
                    "table1.md and table1.json.")
    _preset_args(r, "table1_gpu", "repeats=3 modes=[eager]")
    r.set_defaults(bench_run=run_table1)


def add_step(which: argparse._SubParsersAction) -> None:
    from launch.commands import add_config_args
    r = which.add_parser(
        "step", help="one OPD step's time: rollout, teacher, learner, weight sync",
        description="Runs a few OPD steps per (mode, engine), interleaved, and splits a step's "
                    "time into rollout, teacher scoring, learner update and weight sync: Cached "
                    "AR vs HB-SJD rollouts, in the reference loop and on Ray. Takes a run "
                    "config like `opd train`.")
    r.add_argument("--engines", default="cached_ar,hbsjd", metavar="E1,E2",
                   help="rollout engines, comma-separated (default cached_ar,hbsjd); an "
                        "entry may set the window and the decoding: hbsjd:4, hbsjd:auto, "
                        "hbsjd:auto@speculative")
    r.add_argument("--modes", default="reference,ray", metavar="M1,M2",
                   help="reference and/or ray, comma-separated (default both)")
    r.add_argument("--steps", type=int, default=3, help="measured steps per run (default 3)")
    r.add_argument("--warmup-steps", type=int, default=1,
                   help="steps dropped at the start of each run (default 1)")
    r.add_argument("--repeats", type=int, default=1,
                   help="runs per (mode, compile, engine), interleaved (default 1)")
    r.add_argument("--compile", default="false", metavar="C1,C2",
                   help="rollout.compile values, comma-separated: false,true runs every engine "
                        "eager and compiled side by side (default false)")
    r.add_argument("--pieces", default=None, metavar="P1,P2",
                   help="distill.pieces values, comma-separated (0 = auto, 1 = no streaming; "
                        "default the config's)")
    r.add_argument("--objectives", default="gkd", metavar="O1,O2",
                   help="gkd (on-policy, every step on student rollouts) and/or kd (KD on data: "
                        "the step an on-policy step is compared with), comma-separated "
                        "(default gkd)")
    r.add_argument("--out", metavar="DIR", help="output directory (default runs/bench/step)")
    r.add_argument("--synthetic", action="store_true",
                   help="write random-token Parquet data and random-weight student and teacher "
                        "checkpoints of the config's shapes into OUT/synthetic and run on them "
                        "(a dry run at model scale, nothing downloaded; e.g. --config "
                        "llamagen_scale_cpu)")
    add_config_args(r)
    r.set_defaults(bench_run=run_step)


def add_schedules(which: argparse._SubParsersAction) -> None:
    r = which.add_parser(
        "schedules", help="distillation schedules over seeds: equal steps and equal time",
        description="Trains every arm of the preset (a name and run overrides, e.g. KD-only, "
                    "on-policy GKD, warm-start-then-on-policy phases) for every seed in the "
                    "reference loop, plus KD-only arms given the steps that fit in another "
                    "arm's time; evaluates each final student on many samples; writes "
                    "schedules.json (every run), schedules.md (mean ± sd per arm) and "
                    "schedules.png (the seeds' curves). A finished run is reused.")
    _preset_args(r, "schedules_digits8", "seeds=[0] steps=300")
    r.set_defaults(bench_run=run_schedules)


def add_teachers(which: argparse._SubParsersAction) -> None:
    from launch.commands import add_config_args
    r = which.add_parser(
        "teachers", help="several specialist teachers against one: class accuracy per class",
        description="Trains a student from the config's routed teachers (each scoring the rows "
                    "of its classes) and one from the single teacher of all classes, the same "
                    "steps from the same start, then measures each class's accuracy of both "
                    "students, each specialist and the single teacher; writes teachers.md and "
                    "teachers.json. Takes a run config like `opd train` (e.g. --config "
                    "digits_two_teachers).")
    r.add_argument("--samples", type=int, default=1000,
                   help="class-balanced samples per model (default 1000)")
    r.add_argument("--out", metavar="DIR", help="output directory (default runs/bench/teachers)")
    add_config_args(r)
    r.set_defaults(bench_run=run_teachers)


BENCHES = [add_rollout, add_paper, add_table1, add_step, add_schedules, add_teachers]
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

    from opd.config.loader import ConfigError
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"bench override {item!r} must look like key=value")
        out[key] = yaml.safe_load(raw)
    return out


def _preset_out(args: argparse.Namespace) -> Path:
    """--out, else runs/bench/<preset name>."""
    from launch.bench.common import resolve_bench_preset
    return Path(args.out or Path("runs") / "bench" / resolve_bench_preset(args.config).stem)


def run_rollout(args: argparse.Namespace) -> int:
    from launch.bench.rollout import format_table, load_bench, run_bench, save_figures

    bench = load_bench(args.config, _overrides(args.overrides))
    report = run_bench(bench)
    print(format_table(report["rows"]))
    for path in save_figures(report, _preset_out(args)):
        print(f"wrote {path}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def run_paper(args: argparse.Namespace) -> int:
    from launch.bench.paper import load_paper_bench, run_paper
    from launch.bench.paper_report import format_markdown, save_plots

    bench = load_paper_bench(args.config, _overrides(args.overrides))
    out = _preset_out(args)
    report = run_paper(bench)
    out.mkdir(parents=True, exist_ok=True)
    text = format_markdown(report)
    print(text)
    (out / "paper.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "paper.md").write_text(text)
    for path in [out / "paper.json", out / "paper.md", *save_plots(report, out)]:
        print(f"wrote {path}")
    return 0


def run_table1(args: argparse.Namespace) -> int:
    from launch.bench.table1 import format_markdown, load_table1_bench, run_table1

    bench = load_table1_bench(args.config, _overrides(args.overrides))
    out = _preset_out(args)
    report = run_table1(bench)
    out.mkdir(parents=True, exist_ok=True)
    text = format_markdown(report)
    print(text)
    (out / "table1.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "table1.md").write_text(text)
    print(f"wrote {out / 'table1.md'}, {out / 'table1.json'}")
    return int(any((r["status"] or "").startswith("failed") for r in report["rows"]))


def _ray_runner(cfg):
    """run_distributed on one Ray session that this command starts (or joins) once."""
    try:
        from actors.bench.io import run_with_io
        from actors.driver.cluster import connect
    except ImportError as e:
        from opd.config.loader import ConfigError
        raise ConfigError(f"--modes ray needs actors.driver.pipeline.run_distributed, which does not "
                          f"import here ({e}); run --modes reference") from None
    started = connect(cfg)

    def run(cfg, run_dir):        # run_distributed's rows plus bytes by role, memory, store
        return run_with_io(cfg, run_dir)

    def close():
        if started:
            import ray
            ray.shutdown()
    return run, close


def run_step(args: argparse.Namespace) -> int:
    from launch.bench.step import (check_step_args, format_step_markdown, parse_pieces,
                                run_step_bench, save_step_plot)
    from opd.run.reference import run_reference

    engines, modes, compiles, objectives = check_step_args(
        args.engines, args.modes, args.steps, args.warmup_steps, args.repeats, args.compile,
        args.objectives)
    pieces = None if args.pieces is None else parse_pieces(args.pieces)
    out = Path(args.out or Path("runs") / "bench" / "step")
    if args.synthetic:
        from launch.bench.synthetic import prepare_synthetic
        from opd.config.schema import apply_overrides
        args.cfg = apply_overrides(args.cfg, prepare_synthetic(args.cfg, out / "synthetic"))
    runners, closers = {}, []
    if "reference" in modes:
        runners["reference"] = lambda cfg, run_dir: run_reference(cfg, run_dir, progress=False)
    try:
        if "ray" in modes:
            runners["ray"], close = _ray_runner(args.cfg)
            closers.append(close)
        report = run_step_bench(args.cfg, out, runners, engines=engines, modes=modes,
                                steps=args.steps, warmup_steps=args.warmup_steps,
                                repeats=args.repeats, compiles=compiles, pieces=pieces,
                                objectives=objectives)
    finally:
        for close in closers:
            close()
    text = format_step_markdown(report)
    print(text)
    (out / "step.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "step.md").write_text(text)
    for path in [out / "step.json", out / "step.md", save_step_plot(report, out)]:
        print(f"wrote {path}")
    return 0


def run_schedules(args: argparse.Namespace) -> int:
    from launch.bench.common import resolve_bench_preset
    from launch.bench.schedules import load_schedules_bench, run_schedules as run
    from launch.bench.schedules_curves import save_curves
    from launch.bench.schedules_report import format_markdown

    bench = load_schedules_bench(args.config, _overrides(args.overrides))
    out = Path(args.out or Path("runs") / "bench" / resolve_bench_preset(args.config).stem)
    runner = None
    if bench.mode == "ray":
        from actors.driver.pipeline import run_distributed
        runner = lambda cfg, run_dir: run_distributed(cfg, run_dir, progress=False)  # noqa: E731
    report = run(bench, out, runner=runner)
    out.mkdir(parents=True, exist_ok=True)
    text = format_markdown(report)
    print(text)
    (out / "schedules.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "schedules.md").write_text(text)
    for path in [out / "schedules.json", out / "schedules.md", save_curves(report, out)]:
        print(f"wrote {path}")
    return 0


def run_teachers(args: argparse.Namespace) -> int:
    from launch.bench.teachers import format_markdown, run_teachers_bench

    out = Path(args.out or Path("runs") / "bench" / "teachers")
    out.mkdir(parents=True, exist_ok=True)
    report = run_teachers_bench(args.cfg, out, args.samples)
    text = format_markdown(report)
    print(text)
    (out / "teachers.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "teachers.md").write_text(text)
    print(f"wrote {out / 'teachers.md'}, {out / 'teachers.json'}")
    return 0
