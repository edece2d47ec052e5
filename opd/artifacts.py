"""What a run leaves for a person to look at besides its tables: `training.png`.

- `training.png`: loss and rollout speed (generated tokens / s) over steps, and — when the run
  tracked quality (quality.parquet, opd/eval/tracking.py) — the student's FID and class
  accuracy over steps with the teacher's levels as horizontal lines.
- The sample grids (`samples/teacher.png` once, `samples/student_step_<n>.png` at every
  evaluation) are drawn by the evaluation itself, from its fixed-key sample set.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np


def _column(rows: list[dict], key: str) -> np.ndarray:
    return np.array([np.nan if r.get(key) is None else r[key] for r in rows], dtype=float)


def plot_training(rows: list[dict], path: Path, *, quality: list[dict] | None = None) -> Path | None:
    """Loss and rollout tokens/s over steps (two panels); with `quality` rows (quality.parquet)
    a third panel: student FID (left axis) and class accuracy (right axis) over steps, the
    teacher's as dashed horizontal lines."""
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    students = sorted((r for r in quality or () if r.get("role") == "student"), key=lambda r: r["step"])
    teacher = next((r for r in quality or () if r.get("role") == "teacher"), None)
    steps = np.array([r["step"] for r in rows])
    loss = np.array([r.get("loss") or np.nan for r in rows], dtype=float)
    speed = np.array([r.get("rollout_tokens_per_s") or np.nan for r in rows], dtype=float)
    panels = 3 if students else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.5))
    a, b = axes[0], axes[1]
    a.plot(steps, loss, lw=1)
    a.set(xlabel="step", ylabel="loss", title="distillation loss")
    b.plot(steps, speed, lw=1, color="tab:green")
    b.set(xlabel="step", ylabel="generated tokens / s", title="rollout speed")
    if np.isnan(speed).all():
        b.text(0.5, 0.5, "no student rollouts\n(data batches: distill.lam=0)", ha="center",
               va="center", transform=b.transAxes, color="0.4")
    if students:
        _quality_panel(axes[2], students, teacher)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _quality_panel(ax, students: list[dict], teacher: dict | None) -> None:
    """Student FID (left) and class accuracy (right) over steps; teacher levels dashed."""
    steps = np.array([r["step"] for r in students])
    fid, acc = _column(students, "fid"), _column(students, "class_acc")
    ax.plot(steps, fid, marker="o", lw=1, color="tab:blue", label="student FID")
    if teacher is not None and teacher.get("fid") is not None:
        ax.axhline(teacher["fid"], ls="--", lw=1, color="tab:blue", label="teacher FID")
    ax.set(xlabel="step", ylabel="FID ↓", title="sample quality")
    handles, labels = ax.get_legend_handles_labels()
    if np.isfinite(acc).any():
        right = ax.twinx()
        right.plot(steps, acc, marker="s", lw=1, color="tab:orange", label="student class acc")
        if teacher is not None and teacher.get("class_acc") is not None:
            right.axhline(teacher["class_acc"], ls="--", lw=1, color="tab:orange",
                          label="teacher class acc")
        right.set(ylabel="class accuracy ↑", ylim=(0, 1))
        more = right.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, fontsize=7, loc="best")
