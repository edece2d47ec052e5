"""What `opd bench schedules` writes besides schedules.json: the Markdown table (mean ± sd over
seeds per arm) and the figure of the seeds' curves (quality.parquet of every run).

    text = format_markdown(report)      # report = launch.bench.schedules.run_schedules(...)
    save_curves(report, out)            # out/schedules.png
"""
from __future__ import annotations

from pathlib import Path

from launch.bench.common import markdown_table, pyplot

COLUMNS = [("FID ↓", "fid", 1), ("precision ↑", "precision", 3), ("recall ↑", "recall", 3),
           ("class acc ↑", "class_acc", 3), ("KL(T‖S) held-out ↓", "kl_data", 4),
           ("on-policy KL ↓", "kl_samples", 4), ("exposure gap", "exposure_gap", 4),
           ("steps", "steps", 0), ("distill CPU s", "cpu_s", 1),
           ("student-rollout steps", "student_share", 2)]
"""(header, METRICS key, decimals) of the table, after the arm's name."""


def cell(stat: dict, decimals: int) -> str:
    """'m ± sd' (just 'm' for one seed or an sd that rounds to 0), '—' when nothing was
    measured."""
    if stat["mean"] is None:
        return "—"
    if stat["n"] < 2 or round(stat["sd"], decimals) == 0:
        return f"{stat['mean']:.{decimals}f}"
    return f"{stat['mean']:.{decimals}f} ± {stat['sd']:.{decimals}f}"


def arm_label(report: dict, arm: str) -> str:
    """The arm's name, with what an equal-time arm matches."""
    et = report["bench"]["equal_time"].get(arm)
    return f"{arm} (= {et['match']}'s time)" if et else arm


RAY_COLUMNS = [("wall s", "wall_s", 1), ("rollout busy s", "rollout_busy_s", 1),
               ("teacher busy s", "teacher_busy_s", 1), ("learner busy s", "learner_busy_s", 1)]
"""Ray mode's columns instead of `distill CPU s`: the steps' wall seconds (what equal time is
matched on) and each stage's busy seconds."""


def format_markdown(report: dict) -> str:
    """The table (one row per arm, mean ± sd over seeds) and what each arm ran."""
    b = report["bench"]
    seeds = ", ".join(str(s) for s in b["seeds"])
    cols = (COLUMNS if b.get("mode", "reference") == "reference" else
            [c for c in COLUMNS if c[1] != "cpu_s"][:-1] + RAY_COLUMNS + COLUMNS[-1:])
    rows = [[arm_label(report, arm), *(cell(stat[k], d) for _, k, d in cols)]
            for arm, stat in report["summary"].items()]
    lines = [f"# Distillation schedules: {len(b['seeds'])} seed(s) ({seeds}), "
             f"{b['steps']} steps (equal steps) or the matched arm's time (equal time)", ""]
    if b.get("note"):
        lines += [b["note"], ""]
    lines += [markdown_table(["arm", *(h for h, _, _ in cols)], rows), "",
              f"Mean ± sd (sample sd) over seeds. Final students: {b['final_samples']} "
              f"class-balanced samples each (FID / precision / recall against the held-out "
              f"images, digits-CNN features; class accuracy: the digits CNN's agreement with the "
              f"sampled class); KL per token in nats on the held-out split (on-policy KL: on "
              f"the student's own completions of held-out prefixes; exposure gap = on-policy "
              f"KL − held-out KL). distill CPU s: the CPU seconds of the run's process over its "
              f"steps' rollout + teacher + learner (evaluations excluded; with one torch thread "
              f"the wall time on an idle machine, and what equal time is matched on in reference "
              f"mode; in ray mode: wall s, the sum of the steps' wall seconds, and each stage's "
              f"busy seconds). Mode: {b.get('mode', 'reference')}. Run preset: {b['config'] or 'the default'}, "
              f"overrides: {' '.join(b['overrides']) or 'none'}.", "", "Arms:", ""]
    shown = report["summary"]
    for arm, ov in b["arms"].items():
        if arm in shown:
            lines.append(f"- `{arm}`: `{' '.join(ov) or '(the preset)'}`")
    for arm, et in b["equal_time"].items():
        if arm not in shown:
            continue
        runs = [r for r in report["runs"] if r["arm"] == arm]
        per_seed = runs[0].get("equal_time", {}).get("per_seed_steps")
        lines.append(f"- `{arm}`: `{et['base']}`'s overrides for as many steps as "
                     f"`{et['match']}` took seconds: {runs[0]['steps']} steps, the median "
                     f"over seeds of {per_seed}")
    return "\n".join(lines) + "\n"


def save_curves(report: dict, out: str | Path) -> Path:
    """out/schedules.png: class accuracy, on-policy KL and FID of the tracked evaluations over
    steps, one line per (arm, seed), one colour per arm; the teacher's class accuracy dashed."""
    from opd.eval.tracking import read_quality

    plt = pyplot()
    panels = [("class_acc", "class accuracy ↑"), ("kl_samples", "on-policy KL (nats/token) ↓"),
              ("fid", "FID ↓")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    arms = list(report["summary"])
    teacher = None
    for run in report["runs"]:
        rows = read_quality(run["run_dir"])
        teacher = teacher or next((r for r in rows if r["role"] == "teacher"), None)
        student = sorted((r for r in rows if r["role"] == "student"), key=lambda r: r["step"])
        colour = colours[arms.index(run["arm"]) % len(colours)]
        first = run is next(r for r in report["runs"] if r["arm"] == run["arm"])
        for ax, (key, _) in zip(axes, panels):
            pts = [(r["step"], r[key]) for r in student if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), color=colour, lw=1, alpha=0.8,
                        label=arm_label(report, run["arm"]) if first else None)
    for ax, (key, title) in zip(axes, panels):
        if teacher is not None and key == "class_acc" and teacher.get(key) is not None:
            ax.axhline(teacher[key], color="grey", ls="--", lw=1, label="teacher")
        ax.set(xlabel="step", title=title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right")
    n = report["bench"]["seeds"]
    fig.suptitle(f"tracked during training: one line per seed ({len(n)}), one colour per arm",
                 fontsize=9)
    fig.tight_layout()
    path = Path(out) / "schedules.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
