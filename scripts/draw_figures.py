"""Draw README's two pictures: the roles and data flow of a Ray run (docs/images/system.png) and
HB-SJD's rounds (docs/images/hbsjd.png).  Schematics, not measurements: nothing here is run.

    python scripts/draw_figures.py            # writes docs/images/system.png, docs/images/hbsjd.png
    python scripts/draw_figures.py --out DIR  # the same two files into DIR

system.png: the control plane (the driver's calls to every worker, their reports back), the data
plane (rollout workers -> teacher workers -> trajectory queue -> learner ranks) and the weights
(learner rank 0 -> rollout workers and the evaluation worker), as docs/ARCHITECTURE.md "Roles"
describes them.  hbsjd.png: one HB-SJD round (every image its own cursor and draft window, all
windows verified in one batched forward), and Full against Compact execution at the threshold
gamma (rollout/hbsjd.py)."""
from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONTROL, DATA, WEIGHTS = "#666666", "#1f5fa8", "#d9730d"
COMMITTED, ACCEPT, REJECT, UNVERIFIED = "#9e9e9e", "#4caf50", "#e53935", "#fff3c4"
DPI = 150


def box(ax, x, y, w, h, title, lines=(), color="#eef3fa", edge="#33415c", stack=0):
    """A role's box centred at (x, y); stack > 0 draws that many shadow boxes behind it (× N)."""
    for i in range(stack, 0, -1):
        ax.add_patch(FancyBboxPatch((x - w / 2 + 0.06 * i, y - h / 2 - 0.06 * i), w, h,
                                    boxstyle="round,pad=0.02,rounding_size=0.08",
                                    fc=color, ec=edge, lw=1.0, zorder=1))
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h,
                                boxstyle="round,pad=0.02,rounding_size=0.08",
                                fc=color, ec=edge, lw=1.4, zorder=2))
    ax.text(x, y + (0.12 * len(lines) if lines else 0), title, ha="center", va="center",
            fontsize=11, weight="bold", zorder=3)
    for i, line in enumerate(lines):
        ax.text(x, y + 0.12 * len(lines) - 0.27 * (i + 1), line, ha="center", va="center",
                fontsize=8.5, color="#333333", zorder=3)


def arrow(ax, a, b, color, label=None, label_at=None, style="-|>", ls="-", lw=1.8, rad=0.0,
          fontsize=8.5, ha="center"):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=14, color=color, lw=lw,
                                 linestyle=ls, connectionstyle=f"arc3,rad={rad}", zorder=4,
                                 shrinkA=0, shrinkB=0))
    if label:
        x, y = label_at or ((a[0] + b[0]) / 2, (a[1] + b[1]) / 2)
        ax.text(x, y, label, ha=ha, va="center", fontsize=fontsize, color=color, zorder=5,
                bbox=dict(fc="white", ec="none", pad=1.0))


def draw_system(path: Path) -> None:
    fig, ax = plt.subplots(figsize=(13, 7.2))
    ax.set_xlim(0, 13)
    ax.set_ylim(0, 7.2)
    ax.axis("off")

    # Bands: control plane on top, data plane in the middle, weights at the bottom.
    for y0, h, name, color in ((5.35, 1.75, "control plane", CONTROL),
                               (2.05, 3.1, "data plane", DATA),
                               (0.05, 1.85, "weights", WEIGHTS)):
        ax.add_patch(Rectangle((0.05, y0), 12.9, h, fc=color, alpha=0.05, ec="none", zorder=0))
        ax.text(0.15, y0 + h - 0.18, name, fontsize=10, color=color, weight="bold", va="top")

    box(ax, 6.5, 6.35, 4.4, 0.95, "driver  (opd train)",
        ["plans steps, issues jobs, seals steps in the queue,",
         "tells the learner which step to train"], color="#f2f2f2", edge="#444444")
    box(ax, 1.25, 6.35, 1.7, 0.75, "data", ["Parquet VQ codes"], color="#f7f7f7", edge="#777777")
    arrow(ax, (2.12, 6.35), (4.28, 6.35), CONTROL, "prefix batches\n(driver owns the cursor)",
          (3.2, 6.62), fontsize=8)

    roles = {"rollout": (2.0, 3.6), "teacher": (5.2, 3.6), "queue": (8.2, 3.6),
             "learner": (11.3, 3.6)}
    box(ax, *roles["rollout"], 2.5, 1.25, "RolloutWorker × N",
        ["student copy, version k", "HB-SJD engine"], stack=2)
    box(ax, *roles["teacher"], 2.3, 1.25, "TeacherWorker × M",
        ["frozen teacher", "scores suffix positions"], stack=2)
    box(ax, *roles["queue"], 2.3, 1.25, "TrajectoryQueue",
        ["refs only, one item per step", "version-aware, bounded"])
    box(ax, *roles["learner"], 2.5, 1.25, "learner ranks 0..R−1",
        ["DeepSpeed (ZeRO)", "rank r: its rows only"], stack=2)

    # Control plane: one bus under the driver, a drop to every role (calls down, reports up).
    bus_y = 5.55
    ax.plot([2.0, 11.3], [bus_y, bus_y], color=CONTROL, lw=1.2, ls=(0, (4, 3)), zorder=3)
    ax.plot([6.5, 6.5], [5.88, bus_y], color=CONTROL, lw=1.2, ls=(0, (4, 3)), zorder=3)
    for x, _ in roles.values():
        arrow(ax, (x - 0.12, bus_y), (x - 0.12, 4.32), CONTROL, style="-|>", ls="--", lw=1.1)
        arrow(ax, (x + 0.12, 4.32), (x + 0.12, bus_y), CONTROL, style="-|>", ls="--", lw=1.1)
    for x, text in ((3.6, "calls ↓\ngenerate, score,\nseal, train_step"),
                    (6.7, "reports ↑\ncounts, stats,\nrefs"),
                    (9.75, "no trajectory and\nno weights pass\nthrough the driver")):
        ax.text(x, 4.85, text, ha="center", va="center", fontsize=8.5, color=CONTROL)

    # Data plane: the trajectory's path, object-store refs all the way.
    y = roles["rollout"][1]
    arrow(ax, (3.3, y), (4.0, y), DATA, lw=2.4)
    arrow(ax, (6.4, y), (7.0, y), DATA, lw=2.4)
    arrow(ax, (9.4, y), (10.0, y), DATA, lw=2.4)
    ax.text(3.65, 2.55, "generated parts\n(tokens, behaviour\nlog-probs)", ha="center",
            fontsize=8.5, color=DATA, va="center")
    ax.text(6.7, 2.55, "scored parts,\ncut into one piece\nper learner rank", ha="center",
            fontsize=8.5, color=DATA, va="center")
    ax.text(9.7, 2.55, "rank r takes\nits pieces of\nstep k", ha="center", fontsize=8.5,
            color=DATA, va="center")
    for x in (3.65, 6.7, 9.7):
        ax.plot([x, x], [2.95, y - 0.08], color=DATA, lw=0.6, ls=":")

    # Weights: learner rank 0 publishes version k+1 to the rollout workers (and evaluation).
    box(ax, 6.5, 0.75, 2.4, 0.8, "EvaluationWorker", ["quality.parquet, sample grids"],
        color="#fbf1e8", edge="#9a5a1a")
    for a, b in (((11.3, 2.95), (11.3, 1.45)), ((11.3, 1.45), (2.0, 1.45))):
        ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-", color=WEIGHTS, lw=2.2, zorder=4))
    arrow(ax, (2.0, 1.45), (2.0, 2.95), WEIGHTS, lw=2.2)
    arrow(ax, (6.5, 1.45), (6.5, 1.17), WEIGHTS, lw=1.6)
    ax.text(6.5, 1.7, "weights v(k+1) from learner rank 0: one object-store object per version "
            "(or a broadcast group), before any later job", ha="center", fontsize=8.5,
            color=WEIGHTS, bbox=dict(fc="white", ec="none", pad=1.0))
    ax.text(9.3, 0.75, "evaluation steps: the same\nweights object, while training goes on",
            ha="center", fontsize=8.5, color=WEIGHTS, va="center")
    fig.savefig(path, dpi=DPI, bbox_inches="tight", facecolor="white")
    plt.close(fig)


def draw_hbsjd(path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(13.5, 5.4),
                                      gridspec_kw={"width_ratios": [1.35, 1.0], "wspace": 0.25})
    # Left: one round (rollout/jacobi.py).  Each image has its own cursor (its committed
    # count) and feeds a window of W = 4 tokens: its last committed token and W - 1 drafts.
    # Column c predicts the token at cursor + c: drafts are accepted up to the first
    # rejection, which is replaced by the corrected token; with every draft accepted the last
    # column adds a bonus token.  A round commits 1 to W tokens of each image.
    L, W = 24, 4
    cursors = [3, 9, 14, 6, 19, 24]         # image 5 is complete: nothing to verify
    outcomes = ["aaab", "aru", "aar", "ruu", "aru", ""]
    fills = {"a": ACCEPT, "r": REJECT, "u": UNVERIFIED, "b": ACCEPT}
    for i, (cur, out) in enumerate(zip(cursors, outcomes)):
        yy = len(cursors) - 1 - i
        for t in range(L):
            color, ec, hatch = "white", "#cccccc", None
            if t < cur:
                color = COMMITTED
            elif t < cur + len(out):
                kind = out[t - cur]
                color, ec = fills[kind], "#333333"
                hatch = "...." if kind == "b" else None
            left.add_patch(Rectangle((t, yy + 0.1), 0.92, 0.8, fc=color, ec=ec, lw=0.8,
                                     hatch=hatch))
        if out:
            left.add_patch(Rectangle((cur - 1 - 0.08, yy + 0.02), W + 0.08, 0.96, fc="none",
                                     ec="#1f5fa8", lw=2.0))
            left.annotate("", xy=(cur + 0.46, yy + 0.92), xytext=(cur + 0.46, yy + 1.22),
                          arrowprops=dict(arrowstyle="-|>", color="black", lw=1.2))
        left.text(-0.4, yy + 0.5, f"image {i}", ha="right", va="center", fontsize=9.5)
        committed = {"a": 1, "r": 1, "b": 1, "u": 0}
        note = (f"cursor {cur}: +{sum(committed[k] for k in out)}" if out else "complete")
        left.text(L + 0.4, yy + 0.5, note, ha="left", va="center", fontsize=8.5,
                  color="#555555")
    left.set_xlim(-2.6, L + 3.6)
    left.set_ylim(-1.9, len(cursors) + 0.55)
    left.axis("off")
    left.set_title("one round: every image its own cursor and window, all verified in "
                   "one batched forward", fontsize=10.5)
    handles = [Rectangle((0, 0), 1, 1, fc=c, ec="#333333", hatch=h) for c, h in
               ((COMMITTED, None), (ACCEPT, None), (REJECT, None), (UNVERIFIED, None),
                (ACCEPT, "...."))]
    left.legend(handles, ["committed", "draft accepted",
                          "first rejected draft: corrected token committed",
                          "drafts after it: the next round's drafts",
                          "bonus token (every draft accepted)"],
                loc="lower center", bbox_to_anchor=(0.47, -0.07), ncol=2, fontsize=8.5,
                frameon=False)
    left.text(L / 2, -0.5, "blue frame: the window fed to the forward, the last committed "
              "token + W − 1 drafts (W = 4); ▼ the cursor", ha="center", fontsize=8.5,
              color="#1f5fa8")

    # Right: the active count falls as images complete; Full while A >= gamma, Compact below.
    R, gamma = 32, 12
    active = [32, 32, 31, 30, 30, 28, 27, 25, 22, 20, 17, 14, 12, 11, 9, 7, 6, 4, 3, 2, 1, 1]
    rounds = list(range(1, len(active) + 1))
    switch = next(r for r, a in zip(rounds, active) if a < gamma)
    right.axvspan(0.5, switch - 0.5, color=DATA, alpha=0.08)
    right.axvspan(switch - 0.5, len(active) + 0.5, color=WEIGHTS, alpha=0.10)
    colors = [DATA if a >= gamma else WEIGHTS for a in active]
    right.bar(rounds, active, width=0.72, color=colors, alpha=0.85)
    padded = [R - a if a >= gamma else 0 for a in active]
    right.bar(rounds, padded, bottom=active, width=0.72, color="none", ec=DATA, hatch="///",
              lw=0.0, alpha=0.5)
    right.axhline(gamma, color="black", ls="--", lw=1.2)
    right.text(len(active) + 0.4, gamma + 0.6, "γ (calibrated: opd calibrate)", ha="right",
               fontsize=9)
    right.text((switch - 0.5) / 2 + 0.25, R + 2.2, "Full: all R rows in the forward\n"
               "(finished rows hatched)", ha="center", fontsize=9, color=DATA)
    right.text((switch + len(active)) / 2 + 0.5, R + 2.2, "Compact: only the\nactive rows "
               "(gathered)", ha="center", fontsize=9, color=WEIGHTS)
    right.set_xlim(0.5, len(active) + 0.5)
    right.set_ylim(0, R + 6.5)
    right.set_xlabel("round", fontsize=9.5)
    right.set_ylabel("rows in the verifier forward (R = 32)", fontsize=9.5)
    right.set_title("Full against Compact execution (Hybrid switches at γ)", fontsize=10.5)
    right.tick_params(labelsize=8.5)
    right.set_xticks([1, 5, 10, 15, 20])
    for side in ("top", "right"):
        right.spines[side].set_visible(False)
    right.text(18.0, 22, "same tokens in every mode:\nonly the speed changes",
               ha="center", fontsize=9, style="italic", color="#333333")
    fig.savefig(path, dpi=DPI, bbox_inches="tight", facecolor="white")
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images",
                        help="folder for system.png and hbsjd.png (default docs/images)")
    out = parser.parse_args(argv).out
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "system.png", out / "hbsjd.png"]
    draw_system(paths[0])
    draw_hbsjd(paths[1])
    for p in paths:
        print(p)
    return paths


if __name__ == "__main__":
    main()
