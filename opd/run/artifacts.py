"""What a run leaves for a person to look at besides its tables: `training.png`.

- `training.png`: loss over steps; for a run with student rollouts their speed (generated
  tokens / s) and rounds against Cached AR's for the same tokens; when the run tracked quality
  (quality.parquet, opd/eval/tracking.py) the student's FID and class accuracy over steps with
  the teacher's levels as horizontal lines.  Every panel marks the distill.phases boundaries.
- The sample grids (`samples/teacher.png` once, `samples/student_step_<n>.png` at every
  evaluation) are drawn by the evaluation itself, from its fixed-key sample set.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np


def _column(rows: list[dict], key: str) -> np.ndarray:
    return np.array([np.nan if r.get(key) is None else r[key] for r in rows], dtype=float)


def plot_training(rows: list[dict], path: Path, *, quality: list[dict] | None = None) -> Path | None:
    """Loss over steps; rollout tokens/s and rounds / Cached AR rounds over the steps on student
    rollouts (only if there are any); with `quality` rows (quality.parquet) student FID (left
    axis) and class accuracy (right axis) over steps, the teacher's as dashed horizontal lines.
    A dotted vertical line and the phase's name at each phase boundary."""
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    students = sorted((r for r in quality or () if r.get("role") == "student"), key=lambda r: r["step"])
    teacher = next((r for r in quality or () if r.get("role") == "teacher"), None)
    from opd.run.summary import phase_spans

    steps = np.array([r["step"] for r in rows])
    loss = np.array([r.get("loss") or np.nan for r in rows], dtype=float)
    rollouts = [r for r in rows if r.get("source") == "student"]
    panels = 1 + bool(rollouts) + bool(students)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.5), squeeze=False)
    axes = list(axes[0])
    a = axes[0]
    a.plot(steps, loss, lw=1)
    a.set(xlabel="step", ylabel="loss", title="distillation loss")
    if rollouts:
        _rollout_panel(axes[1], rollouts)
    if students:
        _quality_panel(axes[-1], students, teacher)
    spans = phase_spans(rows)
    if len(spans) > 1:
        for ax in axes:
            for name, first, _, _ in spans:
                ax.axvline(first, ls=":", lw=1, color="0.5")
                ax.text(first, 1.0, f" {name}", transform=ax.get_xaxis_transform(), fontsize=7,
                        va="top", color="0.3")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _rollout_panel(ax, rollouts: list[dict]) -> None:
    """Generated tokens / s (left) and rounds / Cached AR rounds (right) of the student steps."""
    steps = np.array([r["step"] for r in rollouts])
    ax.plot(steps, _column(rollouts, "rollout_tokens_per_s"), ".", ms=2, color="tab:green")
    ax.set(xlabel="step", ylabel="generated tokens / s", title="student rollouts")
    ar = _column(rollouts, "ar_rounds")
    ratio = np.where(ar > 0, _column(rollouts, "rounds") / np.where(ar > 0, ar, 1), np.nan)
    if np.isfinite(ratio).any():
        right = ax.twinx()
        right.plot(steps, ratio, ".", ms=2, color="tab:purple")
        right.set(ylabel="rounds / Cached AR rounds", ylim=(0, 1.05))


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
