"""`opd bench step`: one OPD step's time split into rollout, teacher scoring, learner update and
weight sync, for Cached AR vs HB-SJD rollouts, in the reference loop and on Ray.

    report = run_step_bench(cfg, out_dir, {"reference": run_ref, "ray": run_ray},
                            engines=["cached_ar", "hbsjd"], modes=["reference", "ray"],
                            compiles=[False, True])

A runner is `fn(cfg, run_dir) -> per-step rows`: opd.run.reference.run_reference, or
actors.bench.io.run_with_io on a connected cluster, chosen by `opd bench step`
(launch/commands/bench.py); tests pass their own.  Every
(mode, compile, engine) runs warmup_steps + steps OPD steps per repeat, the runs interleaved
round-robin (launch.bench.common.interleave); a run's first warmup_steps rows are dropped (gamma
calibration, first-call allocations, the compile; the first one's rollout time is kept as
`first_rollout_s`).  `compiles` are values of rollout.compile
(False = eager; compiled runs turn candidate drafting off, which compile excludes); speedups
compare engines of the same mode and compile.  A row has rollout_s, teacher_s, learner_s and step_s;
Ray rows also weight_sync_s (the reference loop's learner updates the rollout model in place:
nothing travels, 0) and, from actors.bench.io.run_with_io, the step's bytes by role, peak memory
and object-store use (launch/bench/step_io.py).  Steps of two engines see the same prefix batches (seeded order), so
their per-step ratios pair up.  KD and GKD configs run as on-policy GKD here (lambda 1): a
step without student rollouts has nothing for the engines to differ in.
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from launch.bench import common
from launch.bench.step_io import format_io_markdown, io_summary
from opd.config.schema import RunConfig, apply_overrides
from opd.config.loader import ConfigError
from rollout.options import DECODINGS

PARTS = ("rollout_s", "teacher_s", "learner_s", "weight_sync_s")
STAGE_KEYS = ("rollout_busy_s", "teacher_busy_s", "learner_busy_s", "cpu_s")
"""Ray rows: each stage's worker-busy seconds on the step's pieces, and the CPU seconds the
whole run (driver, raylet, every worker) used during the step (actors/bench/io.py)."""
MODES = ("reference", "ray")
ENGINES = ("cached_ar", "sjd_sync", "sjd_independent", "hbsjd")
Runner = Callable[[RunConfig, Path], list]


COMPILES = {"false": False, "true": True, "inductor": "inductor", "aot_eager": "aot_eager",
            "eager": "eager"}


OBJECTIVES = ("gkd", "kd")
"""Bench arms by what a step trains on: "gkd" = on-policy GKD at lambda 1 (every step on
student rollouts; VarKD and SeqKD configs keep their own objective), "kd" = KD on data (no
rollout, the step an on-policy step is compared with)."""


def parse_pieces(pieces: str) -> list[int]:
    """Comma-separated distill.pieces values (0 = auto); ConfigError naming the bad value."""
    try:
        out = [int(x) for x in pieces.split(",") if x]
    except ValueError:
        out = []
    if not out or any(x < 0 for x in out):
        raise ConfigError(f"--pieces {pieces!r}: must be comma-separated values of "
                          f"distill.pieces (0 = auto, 1 = no streaming)", "pieces")
    return out


def _engine_arm(arm: str) -> bool:
    """An --engines entry: an engine name, or a Jacobi engine and its window (hbsjd:16,
    hbsjd:auto), either optionally with a decoding after "@" (hbsjd:auto@speculative: the two
    sampling rules side by side; `engine_overrides`)."""
    arm, _, decoding = arm.partition("@")
    name, _, W = arm.partition(":")
    return name in ENGINES and (not decoding or decoding in DECODINGS) and (
        not W or (name != "cached_ar" and (W == "auto" and name == "hbsjd"
                                           or W.isdigit() and int(W) >= 1)))


def engine_overrides(arm: str) -> list[str]:
    """--engines entry -> its config overrides: rollout.engine, and rollout.window and
    rollout.decoding when given."""
    arm, _, decoding = arm.partition("@")
    name, _, W = arm.partition(":")
    return ([f"rollout.engine={name}"] + ([f"rollout.window={W}"] if W else [])
            + ([f"rollout.decoding={decoding}"] if decoding else []))


def check_step_args(engines: str, modes: str, steps: int, warmup_steps: int, repeats: int,
                    compiles: str = "false", objectives: str = "gkd"
                    ) -> tuple[list[str], list[str], list, list[str]]:
    """Parse comma-separated engines, modes, rollout.compile values and objectives; ConfigError
    naming the bad option."""
    e = [x for x in engines.split(",") if x]
    m = [x for x in modes.split(",") if x]
    c = [x for x in compiles.split(",") if x]
    o = [x for x in objectives.split(",") if x]
    if not o or any(x not in OBJECTIVES for x in o):
        raise ConfigError(f"--objectives {objectives!r}: must be comma-separated names from "
                          f"{', '.join(OBJECTIVES)}", "objectives")
    if not c or any(x not in COMPILES for x in c):
        raise ConfigError(f"--compile {compiles!r}: must be comma-separated values of "
                          f"rollout.compile from {', '.join(COMPILES)}", "compile")
    if not e or any(not _engine_arm(x) for x in e):
        raise ConfigError(f"--engines {engines!r}: must be comma-separated names from "
                          f"{', '.join(ENGINES)}, a Jacobi engine optionally with its window "
                          f"as NAME:W or NAME:auto, either optionally with @DECODING (e.g. "
                          f"hbsjd:4,hbsjd:auto,hbsjd:auto@speculative)", "engines")
    if not m or any(x not in MODES for x in m):
        raise ConfigError(f"--modes {modes!r}: must be reference, ray or both, "
                          f"comma-separated", "modes")
    for name, v, lo in (("--steps", steps, 1), ("--warmup-steps", warmup_steps, 0),
                        ("--repeats", repeats, 1)):
        if v < lo:
            raise ConfigError(f"{name} must be >= {lo}, got {v}", name)
    return e, m, [COMPILES[x] for x in c], o


def run_step_bench(cfg: RunConfig, out_dir: str | Path, runners: dict[str, Runner], *,
                   engines: list[str], modes: list[str], steps: int = 3, warmup_steps: int = 1,
                   repeats: int = 1, compiles: list | None = None,
                   pieces: list[int] | None = None, objectives: list[str] | None = None,
                   log: Callable = print) -> dict:
    """Per (mode, compile, pieces, objective, engine): the measured steps' rows and the mean
    split of a step.  `pieces`: values of distill.pieces (None: the config's); `objectives`:
    OBJECTIVES arms ("kd" runs once per (mode, pieces), with no engine)."""
    missing = [m for m in modes if m not in runners]
    if missing:
        raise ConfigError(f"no runner for mode(s) {missing}", "modes")
    out = Path(out_dir)
    compiles = [False] if compiles is None else compiles
    pieces = [cfg.distill.pieces] if pieces is None else pieces
    objectives = ["gkd"] if objectives is None else objectives
    combos = [(m, c, p, o, e) for m in modes for c in compiles for p in pieces
              for o in objectives for e in (engines if o == "gkd" else ["-"])
              if o == "gkd" or c is compiles[0]]
    count = {c: 0 for c in combos}

    def call(mode: str, compile, piece: int, objective: str, engine: str):
        key = (mode, compile, piece, objective, engine)
        count[key] += 1
        tag = "" if compile is False else f"-compile_{compile}"
        arm = engine if objective == "gkd" else objective
        run_dir = (out / "runs" / f"{mode}-{arm.replace(':', '_W').replace('@', '_')}{tag}"
                                  f"-p{piece}-{count[key]}")
        # On-policy GKD (lambda 1) unless the objective rolls out itself (VarKD, SeqKD): the
        # bench measures rollouts inside the step, which the digits default (KD on data) has not.
        if objective == "kd":
            on_policy = ["distill.objective=kd"]
        else:
            on_policy = ([] if cfg.distill.objective in ("varkd", "seqkd")
                         else ["distill.objective=gkd", "distill.lam=1"])
        engine = cfg.rollout.engine if engine == "-" else engine
        # engines that draft no candidates compare with candidate drafting off
        plain = ([] if engine.partition("@")[0].partition(":")[0] in ("hbsjd", "sjd_independent")
                 and compile is False else ["rollout.candidates=0"])
        run_cfg = apply_overrides(cfg, [*engine_overrides(engine), f"run.mode={mode}",
                                        f"rollout.compile={str(compile is not False).lower()}",
                                        *on_policy, *plain,
                                        f"distill.steps={warmup_steps + steps}",
                                        f"distill.pieces={piece}",
                                        "run.checkpoint_every=0", "eval.track=false",
                                        f"run.dir={run_dir}"])
        if compile not in (False, True):         # a backend name (e.g. "eager" in tests)
            run_cfg = dataclasses.replace(run_cfg, rollout=dataclasses.replace(run_cfg.rollout,
                                                                               compile=compile))
        if run_dir.exists():                        # this bench's own output of an earlier run
            shutil.rmtree(run_dir)
        log(f"bench step: {mode} {arm} compile={compile} pieces={piece} run "
            f"{count[key]} -> {run_dir}")
        rows = runners[mode](run_cfg, run_dir)
        # the run's final checkpoint is not the bench's output (2 GB at the scale preset)
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        return 0.0, ([float(r.get("rollout_s", 0.0)) for r in rows[:warmup_steps]],
                     [dict(r) for r in rows[warmup_steps:]])

    samples = common.interleave([lambda k=k: call(*k) for k in combos], repeats, 0)
    results = []
    for (mode, compile, piece, objective, engine), runs in zip(combos, samples):
        rows = [r for _, (_, run) in runs for r in run]
        first = [w[0] for _, (w, _) in runs if w]      # each run's first rollout (the compile)
        results.append({"mode": mode, "compile": compile, "pieces": piece,
                        "objective": objective, "engine": engine, **summarize(rows),
                        "first_rollout_s": first, "rows": rows})
    for r in results:      # the first engine of a (mode, compile, pieces) is the base
        if r["objective"] != "gkd":
            r["baseline"], r["rollout_speedup"], r["step_speedup"] = None, None, None
            continue
        base = next(x for x in results if x["objective"] == "gkd" and all(
            x[k] == r[k] for k in ("mode", "compile", "pieces")))
        r["baseline"] = None if base is r else base["engine"]
        for part in ("rollout_s", "step_s"):
            key = part.replace("_s", "_speedup")
            r[key] = (None if base is r else
                      common.ratio([x[part] for x in base["rows"]], [x[part] for x in r["rows"]]))
        kd = next((x for x in results if x["objective"] == "kd" and x["mode"] == r["mode"]
                   and x["pieces"] == r["pieces"]), None)
        r["kd_ratio"] = (None if kd is None else      # an on-policy step over a KD step
                         r["step_s"]["mean"] / kd["step_s"]["mean"])
    return {"config": _plain(cfg), "environment": common.environment("cpu"),
            "engines": engines, "modes": modes, "compiles": compiles, "pieces": pieces,
            "objectives": objectives, "steps": steps, "warmup_steps": warmup_steps,
            "repeats": repeats, "results": results}


def summarize(rows: list[dict]) -> dict:
    """Mean and std (seconds) of each part of a step and of the step, plus rollout stats."""
    def stat(key):
        v = np.asarray([float(r.get(key, 0.0)) for r in rows])
        return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0}
    out = {k: stat(k) for k in (*PARTS, "step_s")}
    out["weight_sync_measured"] = any("weight_sync_s" in r for r in rows)
    out["other_s"] = out["step_s"]["mean"] - sum(out[k]["mean"] for k in PARTS)
    out["rounds"] = float(np.mean([r.get("rounds", 0) for r in rows]))
    out["mean_committed"] = float(np.mean([r.get("mean_committed", 0.0) for r in rows]))
    out["generated_tokens"] = float(np.mean([r.get("generated_tokens", 0) for r in rows]))
    out["steps_measured"] = len(rows)
    for k in STAGE_KEYS:                     # ray rows (actors/driver/core.py step_metrics)
        out[k] = stat(k) if all(k in r for r in rows) and rows else None
    out["io"] = io_summary(rows)           # ray rows from actors.bench.io.run_with_io, else None
    return out


def _plain(cfg: RunConfig) -> dict:
    from opd.config.files import config_to_dict
    return config_to_dict(cfg)


def format_step_markdown(report: dict) -> str:
    """One table per mode: the mean split of a step (ms), shares and speedups."""
    heads = ["engine", "compile", "rollout ms", "teacher ms", "learner ms", "weight sync ms",
             "other ms", "step ms", "rollout share", "rounds", "tok/rnd", "ms/round",
             "1st rollout s", "rollout time / base", "rollout speedup", "step speedup"]
    c = report["config"]
    out = ["# One OPD step: rollout, teacher, learner, weight sync", "",
           f"Run config: students {c['model']['student']} / teacher {c['model']['teacher']}, "
           f"batch {c['data']['batch_size']}, prefix ratio {c['data']['prefix_ratio']}, W "
           f"{c['rollout']['window']}, {c['rollout']['decoding']} decoding, objective "
           f"{c['distill']['objective']}; {report['steps']} measured steps after "
           f"{report['warmup_steps']} warm-up step(s) per run, {report['repeats']} run(s) per "
           f"(mode, compile, engine), interleaved; mean ± std over measured steps; base = the "
           f"first engine of the same compile; speedup = ratio of means [min–max of per-step "
           f"ratios]; compiled = rollout.compile (one graph per round); 1st rollout = the first "
           f"warm-up step's rollout of each run (compiled: the compile, in the first run of the "
           f"process). Paper (H200): rollout 1.46–1.65× faster with "
           f"HB-SJD; rollout is the bottleneck of a step.", ""]
    for mode in report["modes"]:
        body = []
        for r in (x for x in report["results"] if x["mode"] == mode):
            def ms(k):
                return f"{1e3 * r[k]['mean']:.0f} ± {1e3 * r[k]['std']:.0f}"
            sync = ms("weight_sync_s") if r["weight_sync_measured"] else "0 (in process)"
            share = r["rollout_s"]["mean"] / r["step_s"]["mean"] if r["step_s"]["mean"] else 0
            body.append([r["engine"], _compile_name(r.get("compile", False)), ms("rollout_s"),
                         ms("teacher_s"), ms("learner_s"), sync,
                         str(round(1e3 * r["other_s"]) or 0), ms("step_s"), f"{100 * share:.0f}%",
                         f"{r['rounds']:.1f}", f"{r['mean_committed']:.3f}",
                         f"{1e3 * r['rollout_s']['mean'] / max(r['rounds'], 1):.2f}",
                         " / ".join(f"{x:.1f}" for x in r.get("first_rollout_s", [])) or "-",
                         _time_ratio(r),
                         _speedup(r, "rollout_speedup"), _speedup(r, "step_speedup")])
        note = ("" if mode == "reference" else
                " On Ray the parts overlap (scoring and sync run beside other work), so "
                "'other' can be negative; step ms is the wall time between learner steps.")
        step = "the sum of the parts" if mode == "reference" else "wall time per step"
        out += [f"## mode={mode}", "", f"Step ms = {step}.{note}", "",
                common.markdown_table(heads, body), ""]
    return "\n".join(out) + "\n" + format_stages_markdown(report) + format_io_markdown(report)


def format_stages_markdown(report: dict) -> str:
    """Ray: what bounds a step.  Per arm, each stage's busy seconds, their sum, the step's wall
    time (the critical path: the stages overlap on pieces), the cores the run kept busy (CPU
    seconds of every process of the run over wall seconds) and an on-policy step over a KD step."""
    res = [r for r in report["results"] if r["mode"] == "ray" and r.get("rollout_busy_s")]
    if not res:
        return ""
    heads = ["arm", "compile", "pieces", "rollout busy ms", "teacher busy ms", "learner busy ms",
             "busy sum ms", "step (critical path) ms", "overlap", "cores busy", "bound by",
             "step / KD step"]
    body = []
    for r in res:
        m = {k: 1e3 * r[k]["mean"] for k in STAGE_KEYS[:3]}
        busy, step = sum(m.values()), 1e3 * r["step_s"]["mean"]
        cores = r["cpu_s"]["mean"] / r["step_s"]["mean"] if r.get("cpu_s") else float("nan")
        bound = max(m, key=m.get).split("_")[0] if busy else "-"
        arm = r["engine"] if r["objective"] == "gkd" else "KD on data"
        body.append([arm, _compile_name(r.get("compile", False)),
                     str(r["pieces"]) if r["pieces"] else "auto",
                     *(f"{m[k]:.0f}" for k in STAGE_KEYS[:3]), f"{busy:.0f}",
                     f"{step:.0f} ± {1e3 * r['step_s']['std']:.0f}", f"{busy / step:.2f}",
                     f"{cores:.2f}", bound,
                     "1" if r["objective"] == "kd" else
                     (f"{r['kd_ratio']:.2f}×" if r.get("kd_ratio") else "-")])
    return "\n".join(["## Stages on Ray (what bounds a step)", "",
                      "Busy = the workers' own seconds on the step's pieces; the step's wall time "
                      "is its critical path (stages overlap on pieces: docs/STREAMING.md); overlap "
                      "= busy sum / step; cores busy = CPU seconds of every process of the run "
                      "(driver, raylet, workers) during the step / step wall time.", "",
                      common.markdown_table(heads, body), "", ""])


def _compile_name(compile) -> str:
    return {False: "eager", True: "compiled"}.get(compile, f"compiled ({compile})")


def _time_ratio(r: dict) -> str:
    """Rollout time over the base engine's (same mode and compile): 1 / speedup of means."""
    s = r.get("rollout_speedup")
    return "1 (base)" if not s else f"{1 / s['speedup']:.3f}"


def _speedup(r: dict, key: str) -> str:
    s = r.get(key)
    if not s:
        return "1 (base)"
    return common.fmt_speedup({"baseline": r["baseline"], **s})


def save_step_plot(report: dict, out_dir: str | Path) -> Path:
    """step.png: stacked bars of the mean step split per (mode, engine)."""
    plt = common.pyplot()
    res = report["results"]
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(res) + 1.5))
    y = np.arange(len(res))
    left = np.zeros(len(res))
    for part, color in zip(PARTS, ("C0", "C1", "C2", "C3")):
        w = np.asarray([1e3 * r[part]["mean"] for r in res])
        ax.barh(y, w, left=left, color=color, label=part[:-2].replace("_", " "))
        left += w
    ax.set_yticks(y, [f"{r['mode']} / {r['engine']}" for r in res])
    ax.set(xlabel="ms per OPD step (mean)", title="One OPD step, split by role")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "step.png", dpi=110)
    plt.close(fig)
    return out / "step.png"
