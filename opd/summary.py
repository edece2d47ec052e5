"""The table `opd train` prints at the end of a run."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def summarize(rows: list[dict]) -> dict:
    """Aggregate per-step rows: first/last loss, mean step time split, rollout speed."""
    if not rows:
        return {}
    col = lambda k: np.array([r.get(k) or 0.0 for r in rows], dtype=float)  # noqa: E731
    gen, roll = col("generated_tokens"), col("rollout_s")
    student = np.array([r.get("source") == "student" for r in rows])
    n = max(1, len(rows) // 10)
    return {
        "steps": len(rows),
        "loss_first": float(col("loss")[:n].mean()), "loss_last": float(col("loss")[-n:].mean()),
        "rollout_s": float(roll.mean()), "teacher_s": float(col("teacher_s").mean()),
        "learner_s": float(col("learner_s").mean()), "step_s": float(col("step_s").mean()),
        "rollout_tokens_per_s": float(gen[student].sum() / max(roll[student].sum(), 1e-9)),
        "mean_committed": float(col("mean_committed")[student].mean()) if student.any() else 0.0,
        "total_s": float(col("step_s").sum()),
    }


def print_summary(rows: list[dict], run_dir: str | Path) -> dict:
    s = summarize(rows)
    if not s:
        print("opd: no steps were run")
        return s
    width = max(len(k) for k in s)
    print(f"\nopd run summary ({run_dir})")
    for k, v in s.items():
        print(f"  {k:<{width}}  {v:.4f}" if isinstance(v, float) else f"  {k:<{width}}  {v}")
    return s
