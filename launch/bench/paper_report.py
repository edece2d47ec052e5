"""Reports of `opd bench paper`: one Markdown table per ablation (the paper's figure beside
ours), the memory-bandwidth floor table, and PNG plots."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from launch.bench import common
from launch.bench.grid import AR

COLUMNS = ["variant", "B", "P+N", "W", "H", "exec", "verify", "rounds", "image rounds",
           "tok/rnd", "rej %", "mean ± std ms", "min–max ms", "P95 ms", "speedup [min–max]",
           "=AR", "paper"]


def _cells(r: dict) -> list[str]:
    dash = "-"
    return [r["variant"], str(r["batch"]), f"{r['prefix_len']}+{r['new_tokens']}",
            dash if r["W"] is None else str(r["W"]), dash if r["H"] is None else str(r["H"]),
            r["execution"], r["decoding"],
            str(r["rounds"]) if isinstance(r["rounds"], int) else f"{r['rounds']:.1f}",
            "/".join(str(int(x)) for x in np.percentile(sum(r["image_rounds"], []), [0, 50, 100])),
            f"{r['mean_committed']:.3f}",
            dash if r["rejection_rate"] is None else f"{100 * r['rejection_rate']:.1f}",
            common.fmt_latency(r), f"{r['min_ms']:.1f}–{r['max_ms']:.1f}", f"{r['p95_ms']:.1f}",
            common.fmt_speedup(r), {True: "yes", False: "NO", None: dash}[r["equal_ar"]],
            r["paper"]]


def setup_line(report: dict, o: dict) -> str:
    b, m, env = report["config"], report["model"], report["environment"]
    P = min(int(round(b["prefix_ratio"] * m["block_size"])), m["block_size"] - 1)
    weights = "random weights" if not b["checkpoint"] else f"weights: {b['checkpoint']}"
    cfg = b["cfg_scale"] if b["cfg_scale"] not in (None, 1.0) else "off"
    return (f"{b['model']} ({m['params'] / 1e6:.2f}M params, {weights}) on {env['device']} "
            f"{b['dtype']}, {env['threads']} thread(s){', ' + env['gpu'] if 'gpu' in env else ''}"
            f"; unless a row says otherwise: batch {o['batch']}, {P} prefix + "
            f"{m['block_size'] - P} generated tokens, W {b['W']}, H {m['H']}, CFG {cfg}, "
            f"{b['decoding']} verification; {o['repeats']} "
            f"repeats x {o['workloads']} workload(s) after {o['warmup']} warm-up, interleaved "
            f"round-robin; latency mean ± std, min–max and P95 over repeats x workloads; image "
            f"rounds = min/median/max of the rounds each image was active (the batch's rounds "
            f"are its slowest image's).")


def floor_table(report: dict) -> str | None:
    """Bytes per verifier round and the memory-bandwidth floor next to the measured time, for
    the rows of the engines ablation (else the execution ablation)."""
    a = report["ablations"].get("engines") or report["ablations"].get("execution")
    rows = [r for r in (a["rows"] if a else []) if r.get("floor")]
    if not rows:
        return None
    body = []
    for r in rows:
        f = r["floor"]
        w = f["weights_mb"]
        body.append([r["variant"], r["execution"], str(r["rounds"]), f"{w:.1f}",
                     f"{f['need_mb'] - w:.2f}", f"{f['reads_mb'] - w:.2f}", f"{f['need_mb']:.1f}",
                     f"{f['floor_ms']:.3f}", f"{f['measured_ms']:.3f}",
                     f"{f['measured_ms'] / f['floor_ms']:.1f}×"])
    bw = rows[0]["floor"]["bandwidth_gbs"]
    head = (f"### Cost of a round against the memory-bandwidth floor ({bw:g} GB/s)\n\n"
            f"A verifier forward must read the weights (embedding tables excluded: only looked-up "
            f"rows are read) and the KV cache of every active image up to its context (two rows "
            f"per image with CFG; {report['model']['kv_bytes_per_position']} bytes per position "
            f"and row). Floor = needed bytes / bandwidth, per decode round (mean over rounds); "
            f"'KV read' is what our attention reads (all forwarded rows up to the longest "
            f"context). Measured ms/round: Jacobi engines time each round; Cached AR is wall "
            f"time / rounds.\n\n")
    return head + common.markdown_table(
        ["variant", "exec", "rounds", "weights MB", "KV needed MB", "KV read MB",
         "bytes/round MB", "floor ms/round", "measured ms/round", "measured/floor"], body)


def format_markdown(report: dict) -> str:
    """One Markdown section per ablation (setup, paper's finding, table), plus the floor."""
    b = report["config"]
    out = [f"# The paper's ablations on `{b['model']}` ({report['environment']['device']})",
           ""]
    if b["note"]:
        out += [f"Scaled against the paper: {b['note'].strip()}", ""]
    for key, a in report["ablations"].items():
        out += [f"## {a['number']}. {a['title']}", "", setup_line(report, a["options"]), "",
                f"Reading: {a['note']} Paper: {a['paper']}", "",
                common.markdown_table(COLUMNS, [_cells(r) for r in a["rows"]]), ""]
        best = [r for r in a["rows"] if r.get("baseline") and r.get("speedup")]
        if best:
            r = max(best, key=lambda r: r["speedup"])
            out += [f"Fastest against its baseline: {r['variant']} {common.fmt_speedup(r)} "
                    f"({a['seconds']:.0f} s for this ablation).", ""]
    for s in report["skipped"]:
        out += [f"Skipped {s['ablation']}: budget_s={b['budget_s']} (elapsed "
                f"{s['elapsed_s']:.0f} s, estimate {s['estimate_s']:.0f} s).", ""]
    floor = floor_table(report)
    if floor:
        out += [floor, ""]
    out.append(f"Total {report['seconds']:.0f} s.")
    return "\n".join(out) + "\n"


def save_plots(report: dict, out_dir: str | Path) -> list[Path]:
    """<number>_<ablation>.png per ablation: latency (mean ± std), tokens per image-round and
    the speedup against the row's baseline beside the paper's."""
    plt = common.pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, a in report["ablations"].items():
        rows = a["rows"]
        x = np.arange(len(rows))
        names = [r["variant"] for r in rows]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        colors = ["0.6" if r["engine"] == AR else "C0" for r in rows]
        axes[0].bar(x, [r["mean_ms"] for r in rows], yerr=[r["std_ms"] for r in rows],
                    color=colors, capsize=3)
        axes[0].set(ylabel="latency per rollout (ms)", title="latency (mean ± std)")
        axes[1].bar(x, [r["mean_committed"] for r in rows], color=colors)
        given = [(i, r["paper_committed"]) for i, r in enumerate(rows) if r.get("paper_committed")]
        if given:
            axes[1].plot(*zip(*given), "o", color="C1", label="paper (H200)")
            axes[1].legend(fontsize=7)
        axes[1].set(ylabel="tokens per image-round", title="mean committed tokens")
        sp = [i for i, r in enumerate(rows) if r.get("baseline")]
        ours = [rows[i]["speedup"] for i in sp]
        lo = [rows[i]["speedup"] - (rows[i]["speedup_min"] or rows[i]["speedup"]) for i in sp]
        hi = [(rows[i]["speedup_max"] or rows[i]["speedup"]) - rows[i]["speedup"] for i in sp]
        xs = np.arange(len(sp))
        axes[2].bar(xs - 0.2, ours, 0.4, yerr=[lo, hi], capsize=3, label="ours (min–max)")
        axes[2].bar(xs + 0.2, [rows[i]["paper_speedup"] or 0 for i in sp], 0.4, color="C1",
                    label="paper (H200)")
        axes[2].axhline(1.0, color="k", lw=0.8, ls=":")
        axes[2].set(ylabel="speedup over baseline", title="speedup: ours vs paper")
        axes[2].set_xticks(xs, [names[i] for i in sp], rotation=30, ha="right", fontsize=7)
        axes[2].legend(fontsize=7)
        for ax in axes[:2]:
            ax.set_xticks(x, names, rotation=30, ha="right", fontsize=7)
        fig.suptitle(f"{a['number']}. {a['title']} — {report['config']['model']} on "
                     f"{report['environment']['device']}", fontsize=10)
        fig.tight_layout()
        paths.append(out / f"{a['number']}_{key}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
