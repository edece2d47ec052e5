"""Measuring the variants of one `opd bench paper` ablation: every variant on every workload,
interleaved, one row each (rounds, commit lengths, latency spread, speedup over the row's
baseline), and the memory-bandwidth floor of a verifier round.

    rows = measure(context, variants, options)     # options: batch, repeats, warmup, workloads
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from launch.bench import common
from launch.bench.common import interleave, make_inputs
from rollout import make_engine


class Models(Protocol):
    """What `measure` needs of `launch.bench.paper.Context` (which imports this module): the
    preset `b` and its models by key ("main", "pretrain:<steps>", a checkpoint)."""
    b: Any

    def model(self, key: str) -> torch.nn.Module: ...

AR = "cached_ar"


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



# ---- measuring -------------------------------------------------------------------------------

def measure(c: Models, variants: list[Variant], o: dict) -> list[dict]:
    """Every variant on every workload, interleaved; one row per variant."""
    b, nw = c.b, o["workloads"]
    engines = [make_engine(v.engine, **v.options) for v in variants]
    inputs: dict[tuple, tuple] = {}

    def call(i: int, w: int):
        v, model = variants[i], c.model(variants[i].model)
        key = (v.batch, v.prefix_ratio, w)
        if key not in inputs:
            inputs[key] = make_inputs(model, v.batch, v.prefix_ratio, b.prefix,
                                      b.seed + v.batch + 1000 * w, b.device)
        labels, prefix = inputs[key]
        res = engines[i].generate(model, labels, prefix, model.block_size - prefix.shape[1],
                                  cfg_scale=b.cfg_scale, temperature=b.temperature,
                                  top_k=b.top_k, top_p=b.top_p, seed=b.seed + w)
        return res.wall_time, res

    pairs = [(i, w) for i in range(len(variants)) for w in range(nw)]
    samples = interleave([lambda i=i, w=w: call(i, w) for i, w in pairs], o["repeats"],
                         o["warmup"])
    times = {i: [] for i in range(len(variants))}
    results = {i: [] for i in range(len(variants))}
    for r in range(o["repeats"]):
        for (i, w), s in zip(pairs, samples):
            times[i].append(s[r][0])
    for (i, w), s in zip(pairs, samples):
        results[i].append(s[-1][1])
    by_label = {v.label: i for i, v in enumerate(variants)}
    rows = []
    for i, v in enumerate(variants):
        ar = next((j for j, u in enumerate(variants) if u.engine == AR and u.model == v.model
                   and u.batch == v.batch and u.prefix_ratio == v.prefix_ratio
                   and u.options["decoding"] == "greedy"), None)
        equal = None
        if v.options["decoding"] == "greedy" and ar is not None and ar != i:
            equal = all(torch.equal(x.tokens, y.tokens) for x, y in zip(results[i], results[ar]))
        base = by_label.get(v.baseline)
        rows.append(make_row(c, v, times[i], results[i], None if base is None else times[base],
                             equal))
    return rows


def make_row(c: Models, v: Variant, times: list[float], results: list, base: list[float] | None,
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
