"""`opd bench paper`: the paper's ablations (docs/FACTS.md §3) on one preset, every variant of an
ablation measured side by side in one process.

    opd bench paper --config digits_paper --out runs/bench/paper

A preset (configs/bench/*.yaml) fixes the model, the workload and which ablations run:

    model, overrides, checkpoint, random_init_std, device, dtype, threads   (as `bench rollout`)
    pretrain_config, pretrain_overrides   run config of checkpoint: pretrained (and of the
                                          pretrained snapshots of the checkpoints ablation)
    batch: 16  prefix: data | random  prefix_ratio: 0.5  W: 16  H: null (one grid row)
    decoding: greedy  cfg_scale: 2.0  temperature / top_k / top_p  gamma: measure | <int>
    repeats: 3  warmup: 1  workloads: 1 (distinct input batches)  calibration_repeats: 3
    bandwidth_gbs: null | 4800   memory bandwidth: print the floor of a verifier round
    budget_s: null | <s>         skip an ablation that would end past this many seconds
    note: "..."                  what is scaled down against the paper (every table header)
    ablations:                   which ablations run, in this order, with their options
      engines: {}
      execution: {workloads: 2}
      window: {values: [4, 8, 16, 24]}

Every ablation also takes batch, repeats, warmup and workloads.  Its variants on its workloads
are one engine grid (launch/bench/grid.py: interleaved, greedy tokens checked against Cached
AR's); a row has rounds, tokens per image-round, rejection rate,
latency mean, std, min, max and P95 over repeats x workloads, and the speedup over the row's
baseline: the ratio of means, with the min / max of the per-round paired ratios.  Rounds and
commit lengths do not depend on timing: two runs agree on them exactly (`committed_digest`).

It holds the paper's whole table of ablations, one short builder each, beside the preset schema
they read; its models and
measuring are in paper_measure.py (over launch/bench/grid.py), the report in
paper_report.py.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

import torch
from pydantic import Field

from launch.bench import common
from launch.bench.grid import AR, ModelPreset, check_model_preset, fail
from launch.bench.paper_measure import Context, Variant, measure, verifier_bytes
from opd.config.loader import strict_schema

@dataclass
class Ablation:
    key: str
    number: int
    title: str
    options: dict                      # its own options and their defaults
    build: Callable                    # (Context, options) -> list[Variant]
    note: str                          # what the speedup is measured against
    paper: str                         # the paper's finding (docs/FACTS.md §3)


ABLATIONS: dict[str, Ablation] = {}
"""The paper's ablations by preset key, in the paper's order."""
COMMON = ("batch", "repeats", "warmup", "workloads")


def ablation(key: str, number: int, title: str, *, note: str, paper: str, **options):
    def wrap(fn):
        ABLATIONS[key] = Ablation(key, number, title, options, fn, note, paper)
        return fn
    return wrap


@strict_schema
@dataclass
class PaperBench(ModelPreset):
    """A preset of `opd bench paper` (configs/bench/*.yaml; the module docstring shows one): the
    shared keys of `launch.bench.grid.ModelPreset` (pretrain_config and pretrain_overrides also
    make the snapshots of the checkpoints ablation) and the ablations."""

    prefix_ratio: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.5
    """Fraction of the sequence given as the prefix; the engines generate the rest."""
    batch: Annotated[int, Field(ge=1)] = 16
    """Images per engine call (every ablation's default)."""
    W: Annotated[int, Field(ge=1)] = 16
    """Jacobi window."""
    decoding: Literal["greedy", "sample"] = "greedy"
    """Verification of the Jacobi engines (and Cached AR's decoding)."""
    workloads: Annotated[int, Field(ge=1)] = 1
    """Distinct input batches per variant."""
    bandwidth_gbs: Annotated[float, Field(gt=0.0)] | None = None
    """Memory bandwidth (GB/s) for the floor of a verifier round; null = no floor table."""
    budget_s: Annotated[float, Field(gt=0.0)] | None = None
    """Skip an ablation that would end past this many seconds; null = no budget."""
    note: str = ""
    """What is scaled down against the paper (every table header)."""
    ablations: dict[str, Any] | list[str] | None = None
    """Ablations to run, in order, with their options ({key: {option: value}}, or a list of
    keys); null = all of them (ABLATIONS)."""


# ---- preset ----------------------------------------------------------------------------------

def _int(v, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def check_paper(b: PaperBench) -> PaperBench:
    """What the schema's types and ranges do not say; normalises ablations to an ordered
    {key: full options}.  ConfigError naming the key of the first bad value."""
    check_model_preset(b)
    abl = list(ABLATIONS) if b.ablations is None else b.ablations
    if isinstance(abl, list):
        abl = {k: {} for k in abl}
    if not abl:
        raise fail("ablations", b.ablations, f"must name some of {', '.join(ABLATIONS)}")
    common.check_known(abl, list(ABLATIONS), "ablations", "ablations.")
    out = {}
    for key, opts in abl.items():
        if not isinstance(opts, (dict, type(None))):
            raise fail(f"ablations.{key}", opts, "must be a mapping of options (or null)")
        opts = dict(opts or {})
        a = ABLATIONS[key]
        common.check_known(opts, [*COMMON, *a.options], f"ablation {key}", f"ablations.{key}.")
        full = {"batch": b.batch, "repeats": b.repeats, "warmup": b.warmup,
                "workloads": b.workloads, **a.options, **opts}
        for k, lo in (("batch", 1), ("repeats", 1), ("warmup", 0), ("workloads", 1)):
            if not _int(full[k], lo):
                raise fail(f"ablations.{key}.{k}", full[k], f"must be an int >= {lo}")
        v = full.get("values", [])
        if "values" in a.options and v is not None and not (isinstance(v, list) and v):
            raise fail(f"ablations.{key}.values", v, "must be a non-empty list (or null)")
        out[key] = full
    b.ablations = out
    return b


def load_paper_bench(path: str | Path, overrides: dict | None = None) -> PaperBench:
    """Read and validate a paper-bench preset (unknown keys named, with a suggestion)."""
    return check_paper(common.load_preset(PaperBench, path, overrides))


def _x(v: float) -> str:
    return f"{v:.3f}×"


# ---- the paper's ablations (docs/FACTS.md §3) ----------------------------------------------

@ablation("engines", 1, "Cached AR vs Batch-Synchronous SJD vs Independent Batched SJD",
          note="speedup over Cached AR. Batch-Synchronous SJD gets the same W and H as the "
               "independent engines, so only the cursor policy differs; HB-SJD (Hybrid) is "
               "added for reference.",
          paper="Cached AR 3982 ms; Batch-Synchronous SJD 241 rounds, 4239 ms; Independent "
                "(Full) 176 rounds, 3275 ms (1.216×).")
def _engines(c: Context, o: dict) -> list[Variant]:
    B, base = o["batch"], "Cached AR"
    return [c.variant(base, AR, B=B, paper="3982 ms"),
            c.variant("Batch-Synchronous SJD", "sjd_sync", B=B, baseline=base,
                      paper="241 rounds, 4239 ms", paper_speedup=3982 / 4239),
            c.variant("Independent Batched SJD", "sjd_independent", B=B, baseline=base,
                      paper="176 rounds, 3275 ms, 1.216×", paper_speedup=1.216),
            c.variant("HB-SJD (Hybrid)", "hbsjd", B=B, baseline=base,
                      paper="2784 ms (ablation 2)", paper_speedup=3982 / 2784)]


@ablation("execution", 2, "Full vs Compact vs Hybrid execution",
          note="speedup over Full; P95 over repeats x workloads.",
          paper="Full 3292 ms, Compact 3104 ms, Hybrid 2784 ms (1.182× over Full); P95 4714 → "
                "3969 ms.")
def _execution(c: Context, o: dict) -> list[Variant]:
    B = o["batch"]
    return [c.variant("Full", "hbsjd", B=B, execution="full", paper="3292 ms, P95 4714 ms"),
            c.variant("Compact", "hbsjd", B=B, execution="compact", baseline="Full",
                      paper="3104 ms", paper_speedup=3292 / 3104),
            c.variant("Hybrid", "hbsjd", B=B, baseline="Full", paper="2784 ms, P95 3969 ms",
                      paper_speedup=1.182)]


@ablation("prefix_ratio", 3, "Rollout length (prefix ratio)", values=[0.75, 0.5, 0.35, 0.2],
          note="speedup of HB-SJD (Hybrid) over Cached AR at the same prefix ratio.",
          paper="prefix 0.75 → 0.20 (suffix 144 → 461 tokens): 1.392× → 1.699×.")
def _prefix_ratio(c: Context, o: dict) -> list[Variant]:
    paper = {0.75: 1.392, 0.2: 1.699}
    out = []
    for r in o["values"]:
        if not (isinstance(r, (int, float)) and 0 <= r < 1):
            raise fail("ablations.prefix_ratio.values", r, "ratios must be in [0, 1)")
        base = f"Cached AR r={r}"
        out += [c.variant(base, AR, B=o["batch"], ratio=r),
                c.variant(f"HB-SJD r={r}", "hbsjd", B=o["batch"], ratio=r, baseline=base,
                          paper=_x(paper[r]) if r in paper else "—", paper_speedup=paper.get(r))]
    return out


@ablation("batch", 4, "Rollout batch size (gamma calibrated per batch)", values=[8, 16, 32, 64],
          note="speedup of HB-SJD (Hybrid, its own calibrated gamma) over Cached AR at the same "
               "batch.",
          paper="batch 8/16/32/64: 1.403/1.298/1.486/1.483×.")
def _batch(c: Context, o: dict) -> list[Variant]:
    paper = {8: 1.403, 16: 1.298, 32: 1.486, 64: 1.483}
    out = []
    for B in o["values"]:
        if not _int(B, 1):
            raise fail("ablations.batch.values", B, "batch sizes must be ints >= 1")
        base = f"Cached AR B={B}"
        out += [c.variant(base, AR, B=B),
                c.variant(f"HB-SJD B={B}", "hbsjd", B=B, baseline=base,
                          paper=_x(paper[B]) if B in paper else "—", paper_speedup=paper.get(B))]
    return out


@ablation("window", 5, "Jacobi window W", values=[4, 8, 16, 24],
          note="speedup of HB-SJD (Hybrid, gamma calibrated per W) over Cached AR; tok/rnd is "
               "the mean committed tokens per image-round.",
          paper="mean committed tokens 1.746 (W=4) → 2.951 (W=24); W=8 fastest (2912 ms, "
                "1.384×).")
def _window(c: Context, o: dict) -> list[Variant]:
    paper = {4: ("1.746 tok/rnd", None, 1.746), 8: ("2912 ms, 1.384× (fastest)", 1.384, None),
             24: ("2.951 tok/rnd", None, 2.951)}
    out = [c.variant("Cached AR", AR, B=o["batch"])]
    for W in o["values"]:
        if not _int(W, 1):
            raise fail("ablations.window.values", W, "windows must be ints >= 1")
        text, sp, tok = paper.get(W, ("—", None, None))
        out.append(c.variant(f"HB-SJD W={W}", "hbsjd", B=o["batch"], W=W, baseline="Cached AR",
                             paper=text, paper_speedup=sp, paper_committed=tok))
    return out


@ablation("history", 6, "History offset H of draft initialisation", values=None,
          note="speedup of HB-SJD (Hybrid) over Cached AR; values null = 2/3, 1 and 4/3 of a "
               "grid row.",
          paper="H 16–32 within 1% of each other (H = 24 = one row of the 24×24 grid).")
def _history(c: Context, o: dict) -> list[Variant]:
    g = c.models["main"].grid_size
    values = o["values"] or sorted({max(1, round(2 * g / 3)), g, round(4 * g / 3)})
    out = [c.variant("Cached AR", AR, B=o["batch"])]
    for H in values:
        if not _int(H, 1):
            raise fail("ablations.history.values", H, "offsets must be ints >= 1")
        text = "one row (H=24)" if H == g else ("within 1% of one row"
                                                if 2 * g / 3 <= H <= 4 * g / 3 else "—")
        out.append(c.variant(f"HB-SJD H={H}", "hbsjd", B=o["batch"], H=H, baseline="Cached AR",
                             paper=text))
    return out


@ablation("gamma", 7, "Hybrid threshold gamma around the calibrated value",
          scales=[0.75, 1.0, 1.25],
          note="speedup over Full; gamma = calibrated gamma x scale, clipped to [1, B + 1].",
          paper="gamma 30/38/46 all ≈ 1.18× over Full.")
def _gamma(c: Context, o: dict) -> list[Variant]:
    B = o["batch"]
    g0 = c.gamma(B, c.b.W)
    out = [c.variant("Full", "hbsjd", B=B, execution="full")]
    scales = o["scales"]
    for i, s in enumerate(scales):
        if not (isinstance(s, (int, float)) and s > 0):
            raise fail("ablations.gamma.scales", s, "scales must be numbers > 0")
        g = min(max(1, round(g0 * s)), B + 1)          # equal gammas stay: they show the noise
        paper = f"γ={(30, 38, 46)[i]}: ≈1.18×" if len(scales) == 3 else "≈1.18×"
        out.append(c.variant(f"Hybrid γ×{s}", "hbsjd", B=B, gamma=g, baseline="Full",
                             paper=paper, paper_speedup=1.18))
    return out


@ablation("checkpoints", 8, "Student checkpoints from early, middle and late training",
          values=None,
          note="speedup of HB-SJD (Hybrid) over Cached AR with the same weights. An int n is "
               "the digits student pretrained for n steps (cached; values null = 1/5, 1/2 and "
               "all of pretrain.student_steps); a string is a checkpoint file or a run's "
               "checkpoints/step_N directory.",
          paper="OPD checkpoints at 2K/12K/22K steps: 1.530/1.500/1.483×.")
def _checkpoints(c: Context, o: dict) -> list[Variant]:
    values = o["values"]
    if values is None:
        if c.b.checkpoint != "pretrained":
            raise fail("ablations.checkpoints.values", None, "give pretraining step counts "
                        "or checkpoint paths (null only works with checkpoint: pretrained)")
        from opd.config.schema import load_config
        n = load_config(c.b.pretrain_config, list(c.b.pretrain_overrides)).pretrain.student_steps
        values = sorted({max(1, n // 5), max(1, n // 2), n})
    paper = dict(zip(range(3), ((1.530, "2K steps"), (1.500, "12K steps"), (1.483, "22K steps"))))
    out = []
    for i, v in enumerate(values):
        if _int(v, 1):
            key, name = f"pretrain:{v}", f"{v} steps"
        elif isinstance(v, str) and Path(v).exists():
            key, name = v, Path(v).name if Path(v).is_dir() else Path(v).stem
        else:
            raise fail("ablations.checkpoints.values", v, "items must be pretraining step "
                        "counts (ints >= 1) or existing checkpoint paths")
        sp, text = paper.get(i, (None, "")) if len(values) == 3 else (None, "")
        base = f"Cached AR {name}"
        out += [c.variant(base, AR, B=o["batch"], model=key),
                c.variant(f"HB-SJD {name}", "hbsjd", B=o["batch"], model=key, baseline=base,
                          paper=f"{sp}× ({text})" if sp else "—", paper_speedup=sp)]
    return out


@ablation("verification", 9, "Greedy vs probabilistic verification",
          note="speedup of HB-SJD (Hybrid) over Cached AR with the same decoding; rej % = "
               "rejected / (accepted + rejected) draft decisions.",
          paper="greedy 1.613× vs probabilistic 1.500× (mean over B and L; probabilistic "
                "1.46–1.54×).")
def _verification(c: Context, o: dict) -> list[Variant]:
    B, out = o["batch"], []
    for d, sp in (("greedy", 1.613), ("sample", 1.500)):
        base = f"Cached AR {d}"
        out += [c.variant(base, AR, B=B, decoding=d),
                c.variant(f"HB-SJD {d}", "hbsjd", B=B, decoding=d, baseline=base,
                          paper=_x(sp), paper_speedup=sp)]
    return out


# ---- the run ---------------------------------------------------------------------------------

def describe(c: Context) -> dict:
    m = c.models["main"]
    weights, kv = verifier_bytes(m)
    return {"params": sum(p.numel() for p in m.parameters()), "weights_mb": weights / 1e6,
            "kv_bytes_per_position": kv, "block_size": m.block_size, "grid": m.grid_size,
            "vocab": m.vocab_size, "H": c.H}


def run_paper(b: PaperBench, log: Callable = print) -> dict:
    """Run the preset's ablations; returns the JSON-serialisable report."""
    if b.threads:
        torch.set_num_threads(b.threads)
    start = time.perf_counter()
    c = Context(b)
    report = {"config": asdict(b), "environment": common.environment(b.device),
              "model": describe(c), "ablations": {}, "skipped": []}
    spent, calls = 0.0, 0
    for key, o in b.ablations.items():
        a = ABLATIONS[key]
        variants = a.build(c, o)
        n = len(variants) * o["workloads"] * (o["warmup"] + o["repeats"])
        elapsed = time.perf_counter() - start
        estimate = n * spent / calls if calls else 0.0
        if b.budget_s and elapsed + estimate > b.budget_s:
            report["skipped"].append({"ablation": key, "elapsed_s": elapsed,
                                      "estimate_s": estimate})
            log(f"[{elapsed:5.0f} s] skip {a.number}. {key}: ~{estimate:.0f} s would pass "
                f"budget_s={b.budget_s}")
            continue
        log(f"[{elapsed:5.0f} s] {a.number}. {key}: {len(variants)} variants x "
            f"{o['workloads']} workload(s) x ({o['warmup']} warm-up + {o['repeats']} repeats)")
        t0 = time.perf_counter()
        rows = measure(c, variants, o)
        seconds = time.perf_counter() - t0
        spent, calls = spent + seconds, calls + n
        report["ablations"][key] = {"number": a.number, "title": a.title, "note": a.note,
                                    "paper": a.paper, "options": o, "rows": rows,
                                    "seconds": seconds}
    report["calibrations"] = [{"batch": B, "W": W, **e} for (B, W), e in c.calibrations.items()]
    report["seconds"] = time.perf_counter() - start
    return report

