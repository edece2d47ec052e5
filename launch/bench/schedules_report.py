"""What `opd bench schedules` prints and writes as schedules.md: the table of the final students
(mean ± sd over seeds per arm), what each arm ran, and the plateau and crossing figures of the
curves (launch/bench/schedules_curves.py, which also draws schedules.png).

    text = format_markdown(report)      # report = launch.bench.schedules.run_schedules(...)
"""
from __future__ import annotations

from launch.bench.common import markdown_table
from launch.bench.schedules_curves import format_curves

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
    lines += ["", *format_curves(report)]
    return "\n".join(lines).rstrip() + "\n"
