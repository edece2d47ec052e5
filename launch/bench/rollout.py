"""`opd bench rollout`: every rollout engine on the same model, labels, prefixes and seed.

A preset (configs/bench/*.yaml) names a model and the grid to sweep:

    model: GPT-digits-S          # opd.models preset
    overrides: {}                # ModelArgs overrides (e.g. grid_size: 24)
    checkpoint: null             # weights file, run or checkpoints/step_N directory (its
                                 # student.pt), "pretrained" (opd pretrain's cached digits
                                 # student) or null (random init, see random_init_std)
    pretrain_overrides: []       # run-config overrides of checkpoint: pretrained (the 16x16
                                 # student: [model.grid_size=16, data.data_dir=data/digits16])
    device: cpu | cuda           dtype: float32 | bfloat16 | float16 | float64
    prefix: data | random        # data: real digits prefixes (digits-shaped models only)
    prefix_ratio: 0.25           batch_sizes: [1, 4, 16]     windows: [2, 4, 8, 16]
    engines: [sjd_sync, sjd_independent, hbsjd-full, hbsjd-compact, hbsjd-hybrid]
    decodings: [greedy]          gamma: measure | <int>     repeats: 3    warmup: 1
                                 # greedy, sample (keyed Gumbel-max), speculative; [sample,
                                 # speculative] compares the two sampling rules side by side
    refreshes: [coupled]         # speculative drafts: coupled and/or resample (rollout/jacobi.py)
    candidates: [0]              # candidate drafting K (0 = off; rollout/candidates.py), every
                                 # value a row of sjd_independent and hbsjd-* engines
    slots: null                  # physical rows per call (continuous batching); every engine,
                                 # Cached AR included, runs the batch's images through them

Per batch size, Cached AR and every (engine, W, decoding) run once per warm-up round, then
`repeats` rounds in a rotating order (interleaved, so drift hits all alike).  Every row reports
rounds, their ratio to Cached AR's rounds for the same images and rows, prefill forwards of
images admitted into freed rows, tokens per image-round, latency mean, median and P95, the
median over the repeats of its call's ratio to the Cached AR call of the same round (time/AR,
`paired`: the machine's drift cancels) and the speedup over Cached AR with the same decoding
and batch (its inverse; medians: a W "auto" engine learns over its calls, the first ones
explore), and (greedy, sample) whether the tokens equal Cached AR's; the JSON keeps each
call's milliseconds (`times_ms`, in repeat order).  Where W "auto" runs, the table ends with
its time over the fastest of Cached AR and the fixed windows, paired alike, and, where a
window runs twice, the sweep's floor: one copy's time over the other's (`auto_lines`).
Jacobi rows also report one round's cost from one more rollout of the same images with Full
execution (`rollout.roundcost`): the aten operators the verification step calls per round and
its time per round, measured side by side with the verifier forward's.
Full vs Compact verifier latency per (physical rows, W) is the calibration file's entry
($OPD_CACHE/calibration.json, what `opd calibrate` writes and training reads), measured and
saved when it has none (delete the file to measure again); `gamma: measure` uses its gamma.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
from pydantic import Field

from launch.bench import common
from launch.bench.grid import (Call, ModelPreset, check_model_preset, fail, measure, preset_model,
                               sampling)
from opd.config.loader import strict_schema
from rollout import make_engine
from rollout.calibrate import ensure_calibration
from rollout.options import DECODINGS
from rollout.roundcost import round_costs
from rollout.window import WINDOWS

VARIANTS = {
    "sjd_sync": ("sjd_sync", {}),
    "sjd_independent": ("sjd_independent", {}),
    "hbsjd-full": ("hbsjd", {"execution": "full"}),
    "hbsjd-compact": ("hbsjd", {"execution": "compact"}),
    "hbsjd-hybrid": ("hbsjd", {"execution": "hybrid"}),
}
"""Benchmarked engine variants (name -> make_engine name and options); Cached AR is the
baseline and always runs."""

@strict_schema
@dataclass
class RolloutBench(ModelPreset):
    """A preset of `opd bench rollout` (configs/bench/*.yaml): the shared keys of
    `launch.bench.grid.ModelPreset` and the sweep."""

    batch_sizes: list[Annotated[int, Field(ge=1)]] = field(default_factory=lambda: [1, 4, 16])
    """Batch sizes swept (images per engine call)."""
    windows: list[int | Literal["auto"]] = field(default_factory=lambda: [2, 4, 8, 16])
    """Jacobi windows W swept; auto: HB-SJD's window policy (rollout/window.py), its rows
    report the chosen windows (`windows` column: W:rounds)."""
    engines: list[str] = field(default_factory=lambda: list(VARIANTS))
    """Engine variants (VARIANTS); Cached AR is the baseline and always runs."""
    decodings: list[str] = field(default_factory=lambda: ["greedy"])
    """Decodings (rollout/options.py DECODINGS): greedy, sample (the keyed Gumbel-max rule)
    and / or speculative (speculative sampling)."""
    refreshes: list[str] = field(default_factory=lambda: ["coupled"])
    """Speculative drafts after the commit point: coupled and / or resample (rollout/jacobi.py)."""
    candidates: list[int] = field(default_factory=lambda: [0])
    """Rows of the independent engines once per candidate count K (0 = off, >= 2 on;
    rollout/candidates.py), greedy and sampled; sjd_sync runs without."""
    slots: Annotated[int, Field(ge=1)] | None = None
    """Physical rows per call (continuous batching), every engine, Cached AR included; null =
    all of the batch's images at once."""


def check_bench(b: RolloutBench) -> RolloutBench:
    """What the schema's types and ranges do not say; ConfigError naming the key."""
    for key in ("batch_sizes", "windows"):
        if not getattr(b, key):
            raise fail(key, getattr(b, key), "must be a non-empty list of ints >= 1")
    if any(W != "auto" and (not isinstance(W, int) or W < 1) for W in b.windows):
        raise fail("windows", b.windows, "must be ints >= 1 or auto")
    if "auto" in b.windows and any(e in ("sjd_sync", "sjd_independent") for e in b.engines):
        raise fail("windows", b.windows, "auto is HB-SJD's policy: drop sjd_sync and "
                   "sjd_independent from engines, or auto from windows")
    for key, allowed in (("engines", VARIANTS), ("decodings", DECODINGS),
                         ("refreshes", ("coupled", "resample"))):
        v = getattr(b, key)
        if not v or any(x not in allowed for x in v):
            raise fail(key, v, f"must be a non-empty list of {', '.join(allowed)}")
    if not b.candidates or any(k < 0 or k == 1 for k in b.candidates):
        raise fail("candidates", b.candidates, "must be a non-empty list of 0 (off) or ints "
                   ">= 2")
    check_model_preset(b)
    if b.checkpoint == "pretrained" and b.overrides and not b.pretrain_overrides:
        raise fail("overrides", b.overrides, "does not reach checkpoint: pretrained (the "
                   "run config's student); set pretrain_overrides too, e.g. "
                   "[model.grid_size=16,data.data_dir=data/digits16]")
    if (b.pretrain_overrides or b.pretrain_config) and b.checkpoint != "pretrained":
        raise fail("pretrain_overrides", b.pretrain_overrides, "applies to checkpoint: "
                   "pretrained only")
    return b


resolve_bench_preset = common.resolve_bench_preset


def load_bench(path: str | Path, overrides: dict | None = None) -> RolloutBench:
    """Read and validate a bench preset (unknown keys are named, with a suggestion)."""
    return check_bench(common.load_preset(RolloutBench, path, overrides))


# ---- model and inputs ------------------------------------------------------------------------

build_model = preset_model


def make_inputs(model, b: RolloutBench, B: int) -> tuple[torch.Tensor, torch.Tensor]:
    """labels (B,), prefix (B, P) with P = round(prefix_ratio * block_size)."""
    return common.make_inputs(model, B, b.prefix_ratio, b.prefix, b.seed + B, b.device)


# ---- the sweep -------------------------------------------------------------------------------

def _engines(b: RolloutBench, B: int, gammas: dict) -> list[tuple[str, str, int | None, dict]]:
    """(label, decoding, W, make_engine kwargs) of every configuration at batch B."""
    out = [("cached_ar", d, None, dict(name="cached_ar", decoding=d)) for d in b.decodings]
    for d in b.decodings:
        for W in b.windows:
            for label in b.engines:
                for refresh in (b.refreshes if d == "speculative" else ["coupled"]):
                    for K in (b.candidates if label != "sjd_sync" else [0]):
                        name, opts = VARIANTS[label]
                        opts = dict(opts, window=W, history_offset=b.H, decoding=d, refresh=refresh)
                        if K:
                            opts["candidates"] = K
                        if label == "hbsjd-hybrid" and W != "auto":
                            opts["gamma"] = gammas[B, W]
                        out.append((label, d, W, dict(name=name, **opts)))
    return out


def run_bench(b: RolloutBench, log=print) -> dict:
    """Run the sweep; returns {"config", "environment", "rows", "curves", "progress"}."""
    if b.threads:
        torch.set_num_threads(b.threads)
    model = build_model(b)
    cfg_on = b.cfg_scale is not None and b.cfg_scale != 1.0
    rows, curves, progress = [], [], {}
    for B in b.batch_sizes:
        gammas = {}
        R = B if b.slots is None else min(b.slots, B)             # physical rows
        for W in (W for W in b.windows if W != "auto"):
            e = ensure_calibration(model, [R], W, cfg=cfg_on, preset=b.model,
                                   repeats=b.calibration_repeats)[R]
            c = {k: e[k] for k in ("active", "full_s", "compact_s")}
            gammas[B, W] = int(e["gamma"]) if b.gamma == "measure" else b.gamma
            curves.append({"batch": B, "W": W, "gamma": gammas[B, W], **c})
        labels, prefix = make_inputs(model, b, B)
        N = model.block_size - prefix.shape[1]
        configs = _engines(b, B, gammas)
        engines = [make_engine(**kw) for *_, kw in configs]
        grid = measure([Call(kw["name"], e, model, labels, prefix, N,
                             dict(sampling(b), slots=b.slots), decoding=d)
                        for (_, d, _, kw), e in zip(configs, engines)], b.repeats, b.warmup)
        base = {d: (np.asarray(m.times), m.result.rounds) for (lab, d, _, _), m in
                zip(configs, grid) if lab == "cached_ar"}
        for i, (label, d, W, kw) in enumerate(configs):
            res, t = grid[i].result, np.asarray(grid[i].times)
            time_ratio = paired(t, base[d][0])
            cost = ({} if label == "cached_ar" or N < 2 or W == "auto" else
                    round_costs(model, engines[i], labels, prefix, N, **sampling(b)))
            rows.append({
                "batch": B, "engine": label, "verification": d, "W": W,
                "execution": kw.get("execution", "sync" if label == "sjd_sync" else "full"),
                "gamma": kw.get("gamma"),
                "refresh": kw.get("refresh") if d == "speculative" else None,
                "candidates": (kw.get("candidates", 0) if label not in ("cached_ar", "sjd_sync")
                               else None),
                "slots": b.slots, "rounds": res.rounds,
                "round_ratio": res.rounds / base[d][1], "prefills": res.prefills,
                "longest_single_run": int(res.longest_single_run.max()),
                "mean_committed": round(res.mean_committed, 3),
                "latency_ms": float(t.mean() * 1e3),
                "median_ms": float(np.median(t) * 1e3),
                "p95_ms": float(np.percentile(t, 95) * 1e3),
                "time_ratio": time_ratio,
                "speedup": 1 / time_ratio,
                "times_ms": [float(x * 1e3) for x in t],
                "equal_ar": grid[i].equal_ar,
                "compact_rounds": sum(m == "compact" for m in res.modes),
                "verify_ops": cost.get("verify_ops"), "forward_ms": cost.get("forward_ms"),
                "verify_ms": cost.get("verify_ms"),
                "windows": (None if label == "cached_ar" else
                            " ".join(f"{w}:{n}" for w, n in
                                     enumerate(res.window_histogram(max(WINDOWS)), 1) if n)),
            })
            if label == "hbsjd-hybrid" and W != "auto":
                progress[B, W, d, kw.get("candidates", 0)] = res.progress.cpu().tolist()
        log(f"batch {B}: {len(configs)} configurations x {b.repeats} repeats done")
    env = common.environment(b.device)
    best = best_progress(rows, progress)
    return {"config": asdict(b), "environment": env, "block_size": model.block_size,
            "prefix_len": prefix.shape[1], "rows": rows, "curves": curves,
            "progress": best}


def paired(times, base) -> float:
    """The median over repeats of a call's seconds over the base call's of the same rotating
    round.  Calls of one round run within a second of each other, and this machine's speed
    drifts in phases tens of calls long (identical calls took 44-52 ms in one phase and 75-90
    in the next), so the median of each call's own list moves with where its calls fell: in
    six traced sweeps, two copies of one window read up to 1.19 apart by their medians and at
    most 1.04 apart paired (docs/WINDOW_POLICY.md).  (`common.ratio` pairs the same way, base
    over other, for the paper benches' speedups.)"""
    return float(np.median(np.asarray(times) / np.asarray(base)))


def auto_lines(rows: list[dict]) -> list[str]:
    """Per batch and decoding with a W "auto" row: auto over the fastest of Cached AR and the
    fixed windows of its engine (the one it reads slowest against, `paired`), and over Cached
    AR; a window run twice gives the sweep's floor (one copy over the other)."""
    lines = []
    for a in (r for r in rows if r["W"] == "auto"):
        same = [r for r in rows if r["batch"] == a["batch"]
                and r["verification"] == a["verification"] and r["W"] != "auto"
                and r["engine"] in ("cached_ar", a["engine"])]
        over = {i: paired(a["times_ms"], r["times_ms"]) for i, r in enumerate(same)}
        i = max(over, key=over.get)
        ar = next(j for j, r in enumerate(same) if r["engine"] == "cached_ar")
        line = (f"auto at batch {a['batch']} ({a['verification']}): {over[i]:.3f} of the "
                f"fastest ({'Cached AR' if i == ar else 'W ' + str(same[i]['W'])}), "
                f"{over[ar]:.3f} of Cached AR")
        seen, floor = {}, []
        for r in same:
            if r["W"] in seen:
                floor.append(paired(r["times_ms"], seen[r["W"]]["times_ms"]))
            seen.setdefault(r["W"], r)
        if floor:
            span = f"{min(floor):.3f}" + (f"-{max(floor):.3f}" if len(floor) > 1 else "")
            line += f"; floor (a window's copy over it) {span}"
        lines.append(line)
    return lines


def best_progress(rows: list[dict], progress: dict) -> dict | None:
    """The fastest hbsjd-hybrid run at the largest batch: its per-image progress."""
    cand = [r for r in rows if r["engine"] == "hbsjd-hybrid" and r["W"] != "auto"]
    if not cand:
        return None
    B = max(r["batch"] for r in cand)
    r = min((r for r in cand if r["batch"] == B), key=lambda r: r["latency_ms"])
    return {"batch": B, "W": r["W"], "verification": r["verification"],
            "progress": progress[B, r["W"], r["verification"], r["candidates"] or 0]}


# ---- reporting -------------------------------------------------------------------------------

COLUMNS = [("batch", "B", "{}"), ("engine", "engine", "{}"), ("verification", "verify", "{}"),
           ("execution", "exec", "{}"), ("refresh", "refresh", "{}"), ("W", "W", "{}"),
           ("candidates", "K", "{}"),
           ("gamma", "γ", "{}"), ("slots", "slots", "{}"), ("rounds", "rounds", "{}"),
           ("round_ratio", "rnd/AR", "{:.3f}"), ("prefills", "prefills", "{}"),
           ("longest_single_run", "stall", "{}"), ("mean_committed", "tok/rnd", "{:.2f}"),
           ("latency_ms", "mean ms", "{:.1f}"), ("median_ms", "median ms", "{:.1f}"),
           ("p95_ms", "P95 ms", "{:.1f}"),
           ("time_ratio", "time/AR", "{:.3f}"), ("speedup", "speedup", "{:.2f}x"), ("equal_ar", "=AR", "{}"),
           ("verify_ops", "ops/rnd", "{}"), ("forward_ms", "fwd ms/rnd", "{:.2f}"),
           ("verify_ms", "verify ms/rnd", "{:.2f}"), ("windows", "windows W:rounds", "{}")]


def format_table(rows: list[dict]) -> str:
    """A fixed-width text table of the result rows, plus the best speedup per batch."""
    def cell(r, key, fmt):
        v = r[key]
        if v is None:
            return "-"
        if key == "equal_ar":
            return "yes" if v else "NO"
        return fmt.format(v)
    body = [[h for _, h, _ in COLUMNS]] + [[cell(r, k, f) for k, _, f in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in body) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for B in sorted({r["batch"] for r in rows}):
        for d in sorted({r["verification"] for r in rows}):
            cand = [r for r in rows if r["batch"] == B and r["verification"] == d
                    and r["engine"] != "cached_ar"]
            if cand:
                r = max(cand, key=lambda r: r["speedup"])
                refresh = f" {r['refresh']}" if r.get("refresh") else ""
                refresh += f" K={r['candidates']}" if r.get("candidates") else ""
                lines.append(f"best at batch {B} ({d}): {r['engine']}{refresh} W={r['W']} "
                             f"{r['speedup']:.2f}x over Cached AR")
    return "\n".join(lines + auto_lines(rows))


def save_figures(report: dict, out_dir: str | Path) -> list[Path]:
    """progress.png (committed length vs round, one line per image) and
    verifier_latency.png (Full vs Compact forward latency over active count)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    best = report.get("progress")
    if best:
        prog = np.asarray(best["progress"])                     # (R + 1, B)
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(np.arange(prog.shape[0]), prog, lw=1)
        ax.axhline(report["block_size"], color="k", ls=":", lw=0.8)
        ax.plot([0, report["block_size"] - report["prefix_len"]],
                [report["prefix_len"], report["block_size"]], "k--", lw=0.8, label="Cached AR")
        ax.set(xlabel="round (verifier forward)", ylabel="committed tokens",
               title=f"HB-SJD hybrid per-image progress (batch {best['batch']}, W={best['W']}, "
                     f"{best['verification']})")
        ax.legend(loc="lower right")
        paths.append(out / "progress.png")
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    B = max(c["batch"] for c in report["curves"])
    for c in (c for c in report["curves"] if c["batch"] == B):
        line, = ax.plot(c["active"], np.asarray(c["full_s"]) * 1e3, "-", label=f"Full W={c['W']}")
        ax.plot(c["active"], np.asarray(c["compact_s"]) * 1e3, "--", color=line.get_color(),
                label=f"Compact W={c['W']} (γ={c['gamma']})")
    ax.set(xlabel="active images", ylabel="verifier forward (ms)",
           title=f"Full vs Compact verifier latency, batch {B}")
    ax.legend(fontsize=7, loc="best", ncol=2)
    paths.append(out / "verifier_latency.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
