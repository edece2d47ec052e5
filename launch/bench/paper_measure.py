"""Measuring the variants of one `opd bench paper` ablation: the preset's models and gamma
calibrations (`Context`), every variant on every workload measured as one engine grid
(launch/bench/grid.py), one row each (rounds, commit lengths, latency spread, speedup over the
row's baseline), and the memory-bandwidth floor of a verifier round.

    rows = measure(context, variants, options)     # options: batch, repeats, warmup, workloads
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from launch.bench import common, grid
from launch.bench.common import make_inputs
from launch.bench.grid import AR, preset_model
from rollout import make_engine
from rollout.calibrate import ensure_calibration

JACOBI = ("sjd_sync", "sjd_independent", "hbsjd")


@dataclass
class Variant:
    """One row of an ablation: an engine with its options on one workload shape."""
    label: str
    engine: str
    options: dict                      # make_engine options, decoding included
    batch: int
    prefix_ratio: float
    model: str = "main"                # "main", "pretrain:<steps>" or a checkpoint path
    baseline: str | None = None        # label of the row the speedup is measured against
    paper: str = "—"
    paper_speedup: float | None = None
    paper_committed: float | None = None     # the paper's mean committed tokens, where given


class Context:
    """The preset's models (loaded on first use) and gamma calibrations (per batch and W); `b`
    is the preset (launch.bench.paper.PaperBench)."""

    def __init__(self, b):
        self.b = b
        self.cfg = b.cfg_scale is not None and b.cfg_scale != 1.0
        self.models = {"main": self._load(b.checkpoint)}
        self.calibrations: dict[tuple[int, int], dict] = {}
        self.H = b.H or self.models["main"].grid_size

    def _load(self, checkpoint: str | None, overrides: tuple = ()):
        return preset_model(self.b, checkpoint, overrides)

    def model(self, key: str):
        if key not in self.models:
            if key.startswith("pretrain:"):
                steps = key.split(":", 1)[1]
                self.models[key] = self._load("pretrained", (f"pretrain.student_steps={steps}",))
            else:
                self.models[key] = self._load(key)      # a file or a run's checkpoint directory
        return self.models[key]

    def gamma(self, B: int, W: int) -> int:
        """The preset's gamma, or the calibrated one for (batch B, window W): the entry of the
        calibration file ($OPD_CACHE/calibration.json), measured and saved if it has none."""
        if self.b.gamma != "measure":
            return int(self.b.gamma)
        if (B, W) not in self.calibrations:
            self.calibrations[B, W] = ensure_calibration(
                self.models["main"], [B], W, cfg=self.cfg,
                repeats=self.b.calibration_repeats)[B]
        return int(self.calibrations[B, W]["gamma"])

    def variant(self, label: str, engine: str, *, B: int, ratio: float | None = None,
                decoding: str | None = None, W: int | None = None, H: int | None = None,
                execution: str = "hybrid", gamma: int | None = None, **row) -> Variant:
        options = {"decoding": decoding or self.b.decoding}
        if engine in JACOBI:
            options.update(window=W or self.b.W, history_offset=H or self.H)
        if engine == "hbsjd":
            options["execution"] = execution
            if execution == "hybrid":
                options["gamma"] = self.gamma(B, options["window"]) if gamma is None else gamma
        ratio = self.b.prefix_ratio if ratio is None else ratio
        return Variant(label, engine, options, B, ratio, **row)


# ---- measuring -------------------------------------------------------------------------------

def measure(c: Context, variants: list[Variant], o: dict) -> list[dict]:
    """Every variant on every workload, interleaved (one grid); one row per variant."""
    b, nw = c.b, o["workloads"]
    inputs: dict[tuple, tuple] = {}
    calls = []
    for v in variants:
        model = c.model(v.model)
        engine = make_engine(v.engine, **v.options)
        for w in range(nw):
            key = (v.model, v.batch, v.prefix_ratio, w)
            if key not in inputs:
                inputs[key] = make_inputs(model, v.batch, v.prefix_ratio, b.prefix,
                                          b.seed + v.batch + 1000 * w, b.device)
            labels, prefix = inputs[key]
            calls.append(grid.Call(v.engine, engine, model, labels, prefix,
                                   model.block_size - prefix.shape[1],
                                   grid.sampling(b, seed=b.seed + w), inputs=key,
                                   decoding=v.options["decoding"]))
    cells = grid.measure(calls, o["repeats"], o["warmup"], exact=("greedy",))
    by_label = {v.label: i for i, v in enumerate(variants)}
    times = [[cells[i * nw + w].times[r] for r in range(o["repeats"]) for w in range(nw)]
             for i in range(len(variants))]
    rows = []
    for i, v in enumerate(variants):
        mine = cells[i * nw:(i + 1) * nw]
        checked = [m.equal_ar for m in mine]
        equal = None if v.engine == AR or None in checked else all(checked)
        base = by_label.get(v.baseline)
        rows.append(make_row(c, v, times[i], [m.result for m in mine],
                             None if base is None else times[base], equal))
    return rows


def make_row(c: Context, v: Variant, times: list[float], results: list, base: list[float] | None,
             equal_ar: bool | None) -> dict:
    committed = sum(int(r.committed.sum()) for r in results)
    image_rounds = sum(int(r.image_rounds.sum()) for r in results)
    acc = sum(int(r.accepted.sum()) for r in results)
    rej = sum(int(r.rejected.sum()) for r in results)
    digest = hashlib.sha1()
    for r in results:
        digest.update(r.committed.cpu().numpy().astype(np.int64).tobytes())
    rounds = [r.rounds for r in results]
    o = v.options
    row = {"variant": v.label, "engine": v.engine, "decoding": o["decoding"], "batch": v.batch,
           "prefix_len": results[0].prefix_len, "new_tokens": results[0].num_new_tokens,
           "W": o.get("window"), "H": o.get("history_offset"), "execution": _execution_label(v),
           "gamma": o.get("gamma"), "model": v.model,
           "rounds": rounds[0] if len(rounds) == 1 else float(np.mean(rounds)),
           "rounds_each": rounds, "image_rounds": [r.image_rounds.tolist() for r in results],
           "mean_committed": committed / max(1, image_rounds),
           "accepted": acc, "rejected": rej,
           "rejection_rate": rej / (acc + rej) if v.engine != AR and acc + rej else None,
           "compact_rounds": sum(m == "compact" for r in results for m in r.modes),
           "committed_digest": digest.hexdigest(), **common.spread(times),
           "times_ms": [t * 1e3 for t in times], "baseline": v.baseline,
           "equal_ar": equal_ar, "paper": v.paper, "paper_speedup": v.paper_speedup,
           "paper_committed": v.paper_committed}
    if base is not None:
        row.update(common.ratio(base, times))
    elif v.baseline is None:
        row.update(speedup=1.0, speedup_min=None, speedup_max=None)
    if c.b.bandwidth_gbs:
        row["floor"] = round_floor(c.model(v.model), results[0], v, c.cfg, c.b.bandwidth_gbs)
    return row


def _execution_label(v: Variant) -> str:
    if v.engine == AR:
        return "-"
    if v.engine == "sjd_sync":
        return "sync"
    if v.engine == "sjd_independent":
        return "full"
    e = v.options["execution"]
    return f"hybrid γ={v.options['gamma']}" if e == "hybrid" else e


# ---- the memory-bandwidth floor of a verifier round ------------------------------------------

def verifier_bytes(model) -> tuple[int, int]:
    """(weight bytes a forward reads, KV-cache bytes per cached position per physical row).
    Embedding tables are left out: a forward reads only the looked-up rows."""
    skip = {id(p) for m in (model.tok_embeddings, model.cls_embedding) for p in m.parameters()}
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)
    a = model.args
    p = next(model.parameters())
    kv = 2 * a.n_layer * a.kv_heads * a.head_dim * p.element_size()
    return weights, kv


def round_floor(model, res, v: Variant, cfg: bool, bandwidth_gbs: float) -> dict | None:
    """Per decode round (the prefill excluded): the bytes a verifier forward must read (weights
    + the KV cache of each active image up to its context; 2 rows per image with CFG), the
    bytes our attention reads (every forwarded row up to the longest forwarded context: Full
    rounds forward finished rows too), the floor = needed bytes / bandwidth, and the measured
    milliseconds per round (Cached AR: wall time / rounds, prefill included)."""
    if res.rounds < 2:
        return None
    weights, kv = verifier_bytes(model)
    B, T, N = res.tokens.shape[0], res.tokens.shape[1], res.num_new_tokens
    W = 1 if v.engine == AR else min(v.options["window"], max(1, N - 1))
    per_image = kv * (2 if cfg else 1)
    cur = res.progress[1:-1].cpu()                       # (R - 1, B) committed before round r
    live = res.committed[1:].cpu() > 0
    ctx = torch.clamp(cur, max=T - W) + W                # keys each row's window attends to
    need = weights + per_image * (ctx * live).sum(1)
    full = torch.tensor([m == "full" for m in res.modes[1:]])
    rows = torch.where(full, B, torch.tensor(res.active[1:]))
    longest = torch.where(full, ctx.amax(1), (ctx * live).amax(1))
    reads = weights + per_image * rows * longest
    measured = (res.wall_time / res.rounds if v.engine == AR or not res.round_times
                else float(np.mean(res.round_times[1:])))
    mean_need = float(need.double().mean())
    return {"weights_mb": weights / 1e6, "kv_bytes_per_position": kv,
            "need_mb": mean_need / 1e6, "reads_mb": float(reads.double().mean()) / 1e6,
            "floor_ms": mean_need / (bandwidth_gbs * 1e9) * 1e3, "measured_ms": measured * 1e3,
            "bandwidth_gbs": bandwidth_gbs}
