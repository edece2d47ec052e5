"""Quality against training time in `opd bench schedules`: each arm's tracked evaluations
(quality.parquet, every eval.every steps) as mean ± sd over seeds, against training time and
against steps; whether the KD-only reference has reached its plateau; and when each on-policy arm
crosses below it.

    figures = curve_figures(report)    # report["curves"] (schedules.json), the table's lines
    save_curves(report, out)           # out/schedules.png

Training time of an evaluation at step s: the run's step seconds summed over steps 0..s-1
(metrics.parquet: `step_cpu_s`, the process's CPU seconds, in reference mode; `step_s`, the steps'
wall seconds, in ray mode; evaluations excluded), so it is the time equal-time arms are matched on.

Seeds are averaged on a common axis: each seed's curve is linear between its evaluations
(`np.interp`), and the mean and sample sd are taken over seeds where every seed has a point (up to
the shortest seed's end).  Between consecutive knots of all seeds every interpolant is linear, so
the mean is too, and the crossing below is exact on those piecewise-linear curves.

- Plateau (the reference arm, on-policy KL, against steps): the relative improvement of its mean
  over the last quarter of the budget, (m(3S/4) − m(S)) / m(3S/4); plateaued when < 2 %.
- Crossing (each arm with student-rollout steps, on-policy KL, against training time): the time
  from which on the arm's mean stays below the reference's, within the time both reached: the
  last sign change of (arm − reference), linearly interpolated; None when the arm is not below
  at the end of that span ("not within the budget").
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from launch.bench.common import markdown_table, pyplot

CLOCKS = {"reference": "step_cpu_s", "ray": "step_s"}
"""run.mode -> the metrics.parquet column summed into training time."""
PANELS = [("kl_samples", "on-policy KL (nats/token) ↓"), ("kl_data", "held-out KL (nats/token) ↓"),
          ("fid", "FID ↓"), ("class_acc", "class accuracy ↑")]
"""(quality.parquet column, title) of the figure's columns."""
PLATEAU = 0.02
"""The plateau criterion: relative improvement over the last quarter of the budget below it."""
KEY = "kl_samples"
"""The quality the plateau and the crossings are stated on."""

Curve = tuple[np.ndarray, np.ndarray]
"""(x, y) of one seed: x increasing (steps or seconds), y the quality at x."""


def run_curves(run_dir: str | Path, clock: str) -> dict:
    """One run's tracked evaluations: {"steps": (E,), "seconds": (E,), "teacher": {key: value},
    key: (E,) for every PANELS key (NaN where not measured)}; E = 0 when nothing was tracked."""
    from opd.eval.tracking import read_quality
    from opd.run.metrics_log import read_metrics

    rows = read_quality(run_dir)
    student = sorted((r for r in rows if r["role"] == "student"), key=lambda r: r["step"])
    teacher = next((r for r in rows if r["role"] == "teacher"), {})
    per_step = sorted(read_metrics(run_dir), key=lambda r: r["step"])
    elapsed = np.concatenate([[0.0], np.cumsum([float(r.get(clock, 0.0)) for r in per_step])])
    steps = np.asarray([r["step"] for r in student], dtype=float)
    out = {"steps": steps, "seconds": elapsed[steps.astype(int)] if len(steps) else steps,
           "teacher": {k: teacher.get(k) for k, _ in PANELS}}
    for k, _ in PANELS:
        out[k] = np.asarray([np.nan if r.get(k) is None else r[k] for r in student], dtype=float)
    return out


def seed_curves(runs: list[dict], x: str, key: str) -> list[Curve]:
    """(x, y) per seed of `runs` (each `run_curves`'s) with the points where `key` was
    measured; seeds without any are left out."""
    out = []
    for r in runs:
        ok = np.isfinite(r[key])
        if ok.any():
            out.append((r[x][ok], r[key][ok]))
    return out


def common_grid(curves: list[Curve], end: float | None = None) -> np.ndarray:
    """Every seed's knots up to `end` (default: the shortest seed's last x), and `end`."""
    end = min(c[0][-1] for c in curves) if end is None else end
    knots = np.concatenate([c[0] for c in curves] + [[end]])
    return np.unique(knots[knots <= end])


def band(curves: list[Curve], grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean, sample sd) over seeds of the curves interpolated at `grid` (sd 0 for one seed)."""
    ys = np.stack([np.interp(grid, x, y) for x, y in curves])
    return ys.mean(0), ys.std(0, ddof=1) if len(ys) > 1 else np.zeros(len(grid))


def relative_improvement(curves: list[Curve], quarter: float = 0.25) -> dict:
    """The mean curve's improvement over the last `quarter` of its budget S (the shortest
    seed's last x): {"from": (1 − quarter)·S, "to": S, "value_from", "value_to", "relative":
    (m(from) − m(to)) / m(from)}."""
    to = min(c[0][-1] for c in curves)
    start = (1 - quarter) * to
    m, _ = band(curves, np.asarray([start, to]))
    return {"from": float(start), "to": float(to), "value_from": float(m[0]),
            "value_to": float(m[1]), "relative": float((m[0] - m[1]) / m[0])}


def crossing(arm: list[Curve], reference: list[Curve]) -> dict:
    """When the arm's mean goes below the reference's for good, within the span both reached
    (module docstring): {"seconds": x or None, "span": the span's end}."""
    end = min(min(c[0][-1] for c in arm), min(c[0][-1] for c in reference))
    grid = common_grid(arm + reference, end)
    d = band(arm, grid)[0] - band(reference, grid)[0]
    if d[-1] >= 0:
        return {"seconds": None, "span": float(end)}
    above = np.nonzero(d >= 0)[0]
    if not len(above):
        return {"seconds": float(grid[0]), "span": float(end)}
    i = int(above[-1])
    t = grid[i] + d[i] / (d[i] - d[i + 1]) * (grid[i + 1] - grid[i])
    return {"seconds": float(t), "span": float(end)}


def arm_runs(report: dict, clock: str) -> dict[str, list[dict]]:
    """{arm: [run_curves of each seed]} in table order, arms without tracked points left out."""
    out: dict[str, list[dict]] = {}
    for arm in report["summary"]:
        runs = [run_curves(r["run_dir"], clock) for r in report["runs"] if r["arm"] == arm]
        if any(len(r["steps"]) for r in runs):
            out[arm] = runs
    return out


def curve_figures(report: dict) -> dict:
    """report["curves"]: the clock, the reference arm, its plateau figures and each on-policy
    arm's crossing (module docstring); {} without a reference arm with tracked points."""
    b = report["bench"]
    clock = CLOCKS[b.get("mode", "reference")]
    ref = b.get("reference")
    curves = arm_runs(report, clock)
    if ref not in curves:
        return {}
    ref_time = seed_curves(curves[ref], "seconds", KEY)
    plateau = relative_improvement(seed_curves(curves[ref], "steps", KEY))
    plateau["plateaued"] = plateau["relative"] < PLATEAU
    crossings = {}
    for arm, runs in curves.items():
        share = report["summary"][arm]["student_share"]["mean"]
        if arm != ref and share:
            crossings[arm] = crossing(seed_curves(runs, "seconds", KEY), ref_time)
    return {"clock": clock, "key": KEY, "reference": ref, "plateau": plateau,
            "crossings": crossings}


def format_curves(report: dict) -> list[str]:
    """The Markdown lines of report["curves"] (none when it is empty)."""
    c = report.get("curves")
    if not c:
        return []
    p, ref = c["plateau"], c["reference"]
    verdict = "plateaued" if p["plateaued"] else "still improving"
    lines = ["## Quality against training time", "",
             f"Training time: the runs' summed `{c['clock']}` (evaluations excluded); curves: "
             f"mean ± sd over seeds in schedules.png.", "",
             f"Plateau: `{ref}`'s mean on-policy KL went from {p['value_from']:.4g} at step "
             f"{p['from']:.0f} to {p['value_to']:.4g} at step {p['to']:.0f}, "
             f"{100 * p['relative']:.1f} % over the last quarter of its budget: {verdict} "
             f"(criterion < {100 * PLATEAU:.0f} %).", ""]
    if c["crossings"]:
        rows = [[arm, "not within the budget" if x["seconds"] is None else f"{x['seconds']:.1f} s",
                 f"0–{x['span']:.1f} s"] for arm, x in c["crossings"].items()]
        lines += [markdown_table(["arm", f"on-policy KL below `{ref}`'s from", "time compared"],
                                 rows), "",
                  "From: the training time after which the arm's mean on-policy KL stays below "
                  "the reference's (linear between evaluations), within the time both arms "
                  "reached.", ""]
    return lines


def save_curves(report: dict, out: str | Path) -> Path:
    """out/schedules.png: PANELS against training time (top) and steps (bottom), per arm its
    mean over seeds and a ± sd band; the teacher's FID and class accuracy dashed, each crossing
    dotted on the on-policy KL panel."""
    plt = pyplot()
    b = report["bench"]
    clock = CLOCKS[b.get("mode", "reference")]
    curves = arm_runs(report, clock)
    fig, axes = plt.subplots(2, len(PANELS), figsize=(4.6 * len(PANELS), 7.2), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    teacher = next((r["teacher"] for runs in curves.values() for r in runs), {})
    for n, (arm, runs) in enumerate(curves.items()):
        colour = colours[n % len(colours)]
        for row, x in enumerate(("seconds", "steps")):
            for ax, (key, _) in zip(axes[row], PANELS):
                seeds = seed_curves(runs, x, key)
                if not seeds:
                    continue
                grid = common_grid(seeds)
                m, sd = band(seeds, grid)
                ax.plot(grid, m, color=colour, lw=1.4,
                        label=f"{arm} ({len(seeds)})" if key == KEY else None)
                ax.fill_between(grid, m - sd, m + sd, color=colour, alpha=0.18, lw=0)
        cross = report.get("curves", {}).get("crossings", {}).get(arm)
        if cross and cross["seconds"] is not None:
            axes[0][0].axvline(cross["seconds"], color=colour, ls=":", lw=1.2)
    for row, xlabel in enumerate((f"training time (s, summed {clock})", "step")):
        for ax, (key, title) in zip(axes[row], PANELS):
            if teacher.get(key) is not None and not key.startswith("kl"):   # KL(T‖T) = 0
                ax.axhline(teacher[key], color="grey", ls="--", lw=1, label="teacher")
            ax.set(xlabel=xlabel, title=title)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, title="arm (seeds)", title_fontsize=7)
    p = report.get("curves", {}).get("plateau")
    note = (f"; {report['curves']['reference']}'s on-policy KL fell {100 * p['relative']:.1f} % "
            f"over its last quarter" if p else "")
    fig.suptitle(f"quality during training, mean ± sd over seeds {b['seeds']}; dotted: where an "
                 f"arm's on-policy KL crosses below the reference's{note}", fontsize=9)
    fig.tight_layout()
    path = Path(out) / "schedules.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["curve_figures", "format_curves", "save_curves", "crossing", "relative_improvement",
           "band", "common_grid", "run_curves", "PLATEAU"]
