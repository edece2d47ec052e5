"""`opd bench table1`: the paper's Table 1 rollout rows, Cached AR against HB-SJD, eager and
compiled, for the rollout shapes of run presets (the GKD and VarKD LlamaGen presets, the digits
student pretrained on the spot).

A preset (configs/bench/table1_*.yaml) lists workloads; each is a run config whose student and
`rollout` / `data` sections are the rollout measured, exactly as `opd train` would build them
(`opd.distill.steps.build_engine`):

    workloads:
      - {name: GKD B, config: llamagen_b_gkd, weights: random}
      - {name: digits 16x16, config: default, weights: pretrained,
         overrides: [model.grid_size=16, data.data_dir=data/digits16, rollout.window=16]}
    device: cuda          modes: [eager, compiled]     compile: true (or a backend, e.g. eager)
    repeats: 5            warmup: 1                    budget_s: 300

Per workload and mode, Cached AR and the run's engine roll out the same labels and prefixes
(`data.batch_size` images, `data.prefix_ratio` of each image given, not `prefix_ratios`)
`warmup` times, then `repeats` times interleaved (one engine grid, launch/bench/grid.py).  A row
reports the mean and P95 of those rollout times, the speedup (Cached AR's mean over the row's, same
mode), rounds, tokens per round (all images' generated tokens / rounds), tokens per image-round,
the aten operators of one verification step (`rollout.roundcost`, Jacobi engines) and the first
call's time (the compile, in compiled mode) and whether the tokens equal Cached AR's (greedy
and keyed sampling).  Compiled mode sets `rollout.compile` and turns
`rollout.candidates` off (the compiled verifier has no tree window), so eager mode also runs the
run's engine without candidates where it has them: that row and the compiled one differ only in
the compile.  Workloads whose rollouts are identical (GKD and VarKD presets differ only in the
objective) are measured once and their rows say so.

Where the preset's device is cuda and no CUDA device is present, every measured cell is
"unmeasured: no GPU" (nothing is built or trained) so the table's shape still shows.
"""
from __future__ import annotations

import dataclasses
import json
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Annotated, Callable, Literal

import torch
from pydantic import Field

from launch.bench import common, grid
from launch.bench.grid import check_device
from opd.config.schema import RunConfig, load_config
from opd.config.loader import ConfigError, strict_schema

NO_GPU = "unmeasured: no GPU"
MODES = ("eager", "compiled")
ROLLOUT_KEYS = ("engine", "window", "history_offset", "decoding", "refresh", "slots",
                "candidates", "execution", "gamma", "cfg_scale", "temperature", "top_k", "top_p")
"""The `rollout` keys that decide a rollout (the rest place workers)."""


@dataclass
class Workload:
    """One rollout shape: a run config's student and rollout settings."""

    name: str = ""
    """Row label (e.g. "GKD B")."""
    config: str = "default"
    """Run preset (configs/) or YAML path."""
    overrides: list[str] = field(default_factory=list)
    """Dotted run-config overrides (e.g. model.grid_size=16)."""
    weights: Literal["random", "pretrained"] = "random"
    """random: normal(0, random_init_std) init; pretrained: the student `opd pretrain` caches
    for this run config (trained on first use, `pretrain.student_steps` steps).  The run
    config's model.student_ckpt is not read."""


@strict_schema
@dataclass
class Table1Bench:
    """A preset of `opd bench table1` (configs/bench/table1_*.yaml)."""

    workloads: list[Workload] = field(default_factory=list)
    """Rollout shapes, in row order."""
    device: str = "cuda"
    """cpu or cuda[:N]; cuda without a CUDA device prints placeholders."""
    threads: Annotated[int, Field(ge=0)] | None = None
    """torch intra-op threads; null or 0 = torch's default."""
    random_init_std: Annotated[float, Field(gt=0.0)] = 0.02
    """Std of the random init (weights: random)."""
    modes: list[Literal["eager", "compiled"]] = field(default_factory=lambda: list(MODES))
    """eager and / or compiled (`rollout.compile`)."""
    compile: bool | Literal["inductor", "aot_eager", "eager"] = True
    """torch.compile backend of compiled mode (True = inductor; "eager" for CPU tests)."""
    repeats: Annotated[int, Field(ge=1)] = 5
    """Timed rollouts per engine and mode (interleaved)."""
    warmup: Annotated[int, Field(ge=0)] = 1
    """Untimed rollouts first (compiled mode compiles in the first)."""
    seed: int = 0
    """Seed of the inputs, the random init and sampling."""
    budget_s: Annotated[float, Field(gt=0.0)] | None = None
    """Workload-modes not started by this many seconds are skipped (listed); null = no budget."""


def load_table1_bench(name: str, overrides: dict | None = None) -> Table1Bench:
    """Read and validate a table1 preset; ConfigError naming the key."""
    b = common.load_preset(Table1Bench, name, overrides)
    if not b.workloads or not b.modes:
        raise ConfigError("bench preset keys workloads and modes must be non-empty lists",
                          "workloads" if not b.workloads else "modes")
    names = [w.name for w in b.workloads]
    if len(set(names)) != len(names) or not all(names):
        raise ConfigError(f"bench preset key workloads: every workload needs its own name, got "
                          f"{names}", "workloads")
    check_device(b.device)
    return b


# ---- one workload ----------------------------------------------------------------------------

@dataclass
class Shape:
    """A workload resolved: its run config and what the rows print without measuring."""
    workload: Workload
    cfg: RunConfig
    batch: int            # images per rollout
    prefix_len: int       # P
    new_tokens: int       # N per image
    key: str              # equal keys: identical rollouts


def resolve(w: Workload) -> Shape:
    cfg = load_config(w.config, w.overrides)
    T = cfg.model.grid_size ** 2
    P = min(int(round(cfg.data.prefix_ratio * T)), T - 1)      # as common.make_inputs
    r = asdict(cfg.rollout)
    key = json.dumps([cfg.model.student, cfg.model.vocab_size, cfg.model.num_classes,
                      cfg.model.grid_size, cfg.model.dtype, w.weights,
                      asdict(cfg.pretrain) if w.weights == "pretrained" else None,
                      cfg.data.data_dir if w.weights == "pretrained" else None,
                      {k: r[k] for k in ROLLOUT_KEYS}, P, cfg.data.batch_size], default=str)
    return Shape(w, cfg, cfg.data.batch_size, P, T - P, key)


def variants(cfg: RunConfig, mode: str, backend) -> list[tuple[str, RunConfig]]:
    """(engine name, run config) of a mode's rows: Cached AR, then the run's engine; compiled
    mode sets rollout.compile and candidates 0 (no tree window when compiled), so eager mode
    adds the run's engine without candidates when it has them (the row compiled mode compiles)."""
    r = cfg.rollout
    eager = dataclasses.replace(cfg, rollout=dataclasses.replace(r, compile=False))
    no_k = dataclasses.replace(cfg, rollout=dataclasses.replace(r, compile=False, candidates=0))
    if mode == "compiled":
        c = dataclasses.replace(cfg, rollout=dataclasses.replace(r, compile=backend, candidates=0))
        return [("cached_ar", c), (r.engine, c)]
    out = [("cached_ar", eager), (r.engine, eager)]
    if r.candidates and r.engine != "cached_ar":
        out.append((r.engine, no_k))
    return out


def engine_label(name: str, cfg: RunConfig) -> str:
    r = cfg.rollout
    if name == "cached_ar":
        return "Cached AR"
    k = f" K={r.candidates}" if r.candidates else ""
    return f"{name} W={r.window}{k}"


def measure(b: Table1Bench, s: Shape, model, mode: str) -> list[dict]:
    """Cached AR and the run's engine on one workload in one mode -> a row of numbers each."""
    from opd.distill.steps import build_engine
    from rollout.roundcost import round_costs

    configs = variants(s.cfg, mode, b.compile)
    r = s.cfg.rollout
    source = "data" if s.workload.weights == "pretrained" else "random"
    labels, prefix = common.make_inputs(model, s.batch, s.cfg.data.prefix_ratio, source, b.seed,
                                        b.device)
    engines = [build_engine(cfg, name) for name, cfg in configs]
    kwargs = dict(cfg_scale=r.cfg_scale, temperature=r.temperature, top_k=r.top_k or None,
                  top_p=r.top_p, seed=b.seed, slots=r.slots or None)
    cells = grid.measure([grid.Call(name, engine, model, labels, prefix, s.new_tokens, kwargs,
                                    decoding=r.decoding)
                          for (name, _), engine in zip(configs, engines)], b.repeats, b.warmup)
    rows = []
    for (name, cfg), engine, m in zip(configs, engines, cells):
        ops = None
        if name != "cached_ar" and s.new_tokens >= 2:
            ops = round_costs(model, engine, labels, prefix, s.new_tokens,
                              **{k: v for k, v in kwargs.items() if k != "slots"})["verify_ops"]
        rows.append({"engine": engine_label(name, cfg), "times_s": m.times,
                     **common.spread(m.times), "rounds": m.result.rounds,
                     "tokens_per_round": s.batch * s.new_tokens / m.result.rounds,
                     "tokens_per_image_round": m.result.mean_committed, "verify_ops": ops,
                     "first_call_s": m.first_s, "equal_ar": m.equal_ar})
    for row in rows:
        row["speedup"] = rows[0]["mean_ms"] / row["mean_ms"]
    return rows


def build_student(b: Table1Bench, s: Shape):
    from opd.models.factory import model_overrides
    return common.build_model(
        s.cfg.model.student, model_overrides(s.cfg),
        "pretrained" if s.workload.weights == "pretrained" else None,
        random_init_std=b.random_init_std, seed=b.seed, device=b.device, dtype=s.cfg.model.dtype,
        run_config=s.workload.config, run_overrides=s.workload.overrides)


# ---- the table -------------------------------------------------------------------------------

def run_table1(b: Table1Bench, log: Callable = print) -> dict:
    """{"config", "environment", "measured" (False: placeholders), "workloads", "rows",
    "notes"}; a row per (workload, mode, engine), its numbers or a `status` ("unmeasured: no
    GPU", "skipped: ...", "failed: ..." with the traceback on stderr)."""
    if b.threads:
        torch.set_num_threads(b.threads)
    measured = b.device == "cpu" or torch.cuda.is_available()
    shapes = [resolve(w) for w in b.workloads]
    first = {s.key: s.workload.name for s in reversed(shapes)}    # key -> first workload
    start, done, models, rows = time.perf_counter(), {}, {}, []
    for mode in b.modes:                  # every eager row first: budget_s cuts compiled ones
        for s in shapes:
            w, same = s.workload, first[s.key]
            configs = variants(s.cfg, mode, b.compile)
            base = {"workload": w.name, "config": w.config, "student": s.cfg.model.student,
                    "weights": w.weights, "mode": mode, "batch": s.batch,
                    "prefix_len": s.prefix_len, "new_tokens": s.new_tokens,
                    "cfg_scale": s.cfg.rollout.cfg_scale, "decoding": s.cfg.rollout.decoding,
                    "same_as": same if same != w.name else None}
            elapsed = time.perf_counter() - start
            if not measured:
                done[same, mode] = NO_GPU
            elif (same, mode) not in done and b.budget_s and elapsed > b.budget_s:
                done[same, mode] = f"skipped: {elapsed:.0f} s > budget_s={b.budget_s:g}"
            elif (same, mode) not in done:
                log(f"[{elapsed:5.0f} s] {w.name}, {mode}")
                try:                      # one failing workload-mode must not lose the others
                    if s.key not in models:
                        models[s.key] = build_student(b, s)
                    done[same, mode] = measure(b, s, models[s.key], mode)
                except Exception as e:    # noqa: BLE001  (reported in its rows, exit code 1)
                    traceback.print_exc()
                    first_line = (str(e).splitlines() or [""])[0]
                    done[same, mode] = f"failed: {type(e).__name__}: {first_line}"
            got = done[same, mode]
            for i, (name, cfg) in enumerate(configs):
                row = dict(base, engine=engine_label(name, cfg))
                rows.append(dict(row, status=got) if isinstance(got, str) else
                            dict(row, status=None, **got[i]))
    order = {s.workload.name: i for i, s in enumerate(shapes)}
    rows.sort(key=lambda r: (order[r["workload"]], b.modes.index(r["mode"])))   # stable
    notes = [f"{s.workload.name}: the same rollout as {first[s.key]} (the run configs differ "
             f"only outside it): measured once, its rows repeat those"
             for s in shapes if first[s.key] != s.workload.name]
    notes += [f"{s.workload.name}: student pretrained on the spot, {s.cfg.pretrain.student_steps} "
              f"steps of batch {s.cfg.pretrain.batch_size} (`opd pretrain`, cached under "
              f"OPD_CACHE)" for s in shapes if s.workload.weights == "pretrained" and measured]
    env = (common.environment(b.device) if measured else
           dict(common.environment("cpu"), device=b.device, gpu=NO_GPU))
    return {"config": asdict(b), "environment": env,
            "measured": measured, "seconds": time.perf_counter() - start,
            "workloads": [{"name": s.workload.name, "config": s.workload.config,
                           "key": json.loads(s.key)} for s in shapes],
            "rows": rows, "notes": notes}


COLUMNS = [("mean_ms", "mean ms", "{:.1f}"), ("p95_ms", "P95 ms", "{:.1f}"),
           ("speedup", "speedup", "{:.2f}×"), ("rounds", "rounds", "{}"),
           ("tokens_per_round", "tok/rnd", "{:.2f}"),
           ("tokens_per_image_round", "tok/img-rnd", "{:.2f}"),
           ("verify_ops", "ops/rnd", "{}"), ("first_call_s", "1st call s", "{:.1f}"),
           ("equal_ar", "=AR", "{}")]


def _cell(v, fmt: str) -> str:
    if v is None:
        return "-"
    return ("yes" if v else "NO") if isinstance(v, bool) else fmt.format(v)


def format_markdown(report: dict) -> str:
    """The rows as a Markdown table, then the notes."""
    head = ["workload", "student", "P+N × B", "mode", "engine"] + [h for _, h, _ in COLUMNS]
    body = []
    for r in report["rows"]:
        cells = [r["workload"], r["student"], f"{r['prefix_len']}+{r['new_tokens']} × "
                 f"{r['batch']}", r["mode"], r["engine"]]
        if r["status"]:
            cells += [r["status"]] + [""] * (len(COLUMNS) - 1)
        else:
            cells += [_cell(r[k], f) for k, _, f in COLUMNS]
        body.append(cells)
    env = report["environment"]
    lines = [f"Rollout time per batch (mean and P95 of {report['config']['repeats']} rollouts "
             f"after {report['config']['warmup']} warm-up), {env.get('gpu', env['device'])}, "
             f"torch {env['torch']}", "", common.markdown_table(head, body), ""]
    lines += [f"- {n}" for n in report["notes"]]
    lines.append("- speedup: Cached AR's mean time over the row's, same workload and mode; "
                 "tok/rnd: all images' generated tokens / rounds; ops/rnd: aten operators of "
                 "one verification step (rollout/roundcost.py); =AR: the tokens equal Cached AR's "
                 "(greedy and keyed sampling); compiled rows run without "
                 "candidates (no tree window when compiled), as the eager row without K does")
    return "\n".join(lines) + "\n"


__all__ = ["Table1Bench", "Workload", "load_table1_bench", "run_table1", "format_markdown",
           "NO_GPU"]
