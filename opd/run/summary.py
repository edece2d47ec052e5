"""The tables `opd train` prints at the end of a run: losses and speeds, and quality (student
before / after against the teacher, quality.md)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np


def summarize(rows: list[dict]) -> dict:
    """Aggregate per-step rows: first/last loss, mean step time split and, for runs with
    student rollouts, the share of steps on fresh ones, their speed and the rounds they took
    against the rounds Cached AR needs for the same tokens (`rounds_vs_ar`) and, over the calls
    Cached AR ran in the engine's place (`rollout.compare_every`), the engine's seconds
    against Cached AR's for calls of the same shapes (`rollout_vs_ar`, measured: below 1, the
    engine rolled out faster; `seconds_vs_ar`); with rollout reuse, the
    steps on reused rollouts and their largest policy lag; with steps on data too, what an
    update on student rollouts (fresh or reused) costs against one on data (`onpolicy_vs_data`,
    mean step seconds); with rollout.span, the share of the teacher's seconds on fresh rollouts
    that ran while their calls still decoded (`teacher_in_rollout`)."""
    if not rows:
        return {}
    col = lambda k: np.array([r.get(k) or 0.0 for r in rows], dtype=float)  # noqa: E731
    gen, roll = col("generated_tokens"), col("rollout_s")
    reused = np.array([bool(r.get("reused")) for r in rows])
    student = np.array([r.get("source") == "student" for r in rows]) & ~reused   # fresh rollouts
    n = max(1, len(rows) // 10)
    out = {
        "steps": len(rows),
        "loss_first": float(col("loss")[:n].mean()), "loss_last": float(col("loss")[-n:].mean()),
        "teacher_s": float(col("teacher_s").mean()),
        "learner_s": float(col("learner_s").mean()), "step_s": float(col("step_s").mean()),
        "total_s": float(col("step_s").sum()),
    }
    if student.any():
        timed = student & (col("ar_rollout_s") > 0)            # calls Cached AR ran, timed
        own = student & ~timed if (student & ~timed).any() else student
        ar = col("ar_rounds")[own].sum()
        out.update({
            "student_steps": int(student.sum()),
            "rollout_s": float(roll[student].mean()),
            "rollout_tokens_per_s": float(gen[student].sum() / max(roll[student].sum(), 1e-9)),
            "mean_committed": float(col("mean_committed")[own].mean()),
            "rounds_vs_ar": float(col("rounds")[own].sum() / ar) if ar > 0 else float("nan"),
        })
        out.update(seconds_vs_ar(rows, timed, own))
    onpolicy = np.array([r.get("source") == "student" for r in rows])
    if onpolicy.any() and (~onpolicy).any():
        step = col("step_s")
        out["onpolicy_vs_data"] = float(step[onpolicy].mean() / max(step[~onpolicy].mean(), 1e-9))
    early = col("teacher_in_rollout_s")[student].sum()
    if early > 0:                        # rollout.span: the Ray rows' busy seconds, else teacher_s
        busy = col("teacher_busy_s") if any("teacher_busy_s" in r for r in rows) else col("teacher_s")
        out["teacher_in_rollout"] = float(early / max(busy[student].sum(), 1e-9))
    if reused.any():                     # rollout reuse (opd/distill/reuse.py): steps, their lag
        out.update({"reused_steps": int(reused.sum()),
                    "reused_lag_max": int(col("policy_lag")[reused].max())})
    return out


def seconds_vs_ar(rows: list[dict], timed: np.ndarray, own: np.ndarray) -> dict:
    """`rollout_vs_ar`: the engine's seconds over its calls (`own`) against what Cached AR
    takes for calls of their shapes (prefix length, tokens generated), priced by the calls
    Cached AR ran in the engine's place (`timed`, `rollout.compare_every`: its seconds depend
    on a call's shape, not its tokens); calls of a shape Cached AR never ran are left out.
    `rollout_vs_ar_calls`: the calls Cached AR ran; `rollout_vs_ar_priced`: the engine's calls
    priced.  `rollout_vs_ar_cpu`: the same on the calls' CPU seconds, where the rollout ran on
    one CPU thread (the window policy's clock, rollout/window.py `policy_clock`): the seconds
    a call waited while the teacher or the learner held the cores are left out (in the
    default Ray run a Jacobi call's first pieces reach the teacher before the call ends, and
    it scores them beside the call; docs/WINDOW_POLICY.md).  Nothing where Cached AR ran no
    call."""
    out = {}
    for column, key in (("rollout_s", "rollout_vs_ar"), ("rollout_cpu_s", "rollout_vs_ar_cpu")):
        ratio = priced_ratio(rows, timed, own, "ar_" + column, "engine_" + column)
        if ratio is not None:
            out[key], priced = ratio
            out.setdefault("rollout_vs_ar_calls", int(timed.sum()))
            out.setdefault("rollout_vs_ar_priced", priced)
    return out


def priced_ratio(rows: list[dict], timed: np.ndarray, own: np.ndarray, ar_key: str,
                 engine_key: str) -> tuple[float, int] | None:
    """(the engine's seconds `engine_key` over its calls `own` against Cached AR's mean
    `ar_key` for calls of their shape, the calls priced) for `seconds_vs_ar`; None where no
    call could be priced."""
    shape = [(r.get("prefix_len"), r.get("generated_tokens")) for r in rows]
    price: dict = {}
    for i in np.flatnonzero(timed):
        if (rows[i].get(ar_key) or 0.0) > 0:
            price.setdefault(shape[i], []).append(float(rows[i][ar_key]))
    priced = [i for i in np.flatnonzero(own) if shape[i] in price
              and (rows[i].get(engine_key) or 0.0) > 0]
    if not priced:
        return None
    engine = sum(float(rows[i][engine_key]) for i in priced)
    cached_ar = sum(float(np.mean(price[shape[i]])) for i in priced)
    return engine / cached_ar, len(priced)


def window_lines(rows: list[dict]) -> list[str]:
    """The windows HB-SJD's verifier rounds ran at over the run's student rollouts (metrics
    column window_hist: entry W - 1 counts the rounds at window W), e.g. "rollout windows
    (W: rounds): 1: 20, 4: 310"; nothing for engines that record none."""
    hists = [r["window_hist"] for r in rows
             if r.get("source") == "student" and r.get("window_hist")]
    total = [sum(col) for col in zip(*hists)]
    if not any(total):
        return []
    return ["rollout windows (W: rounds): "
            + ", ".join(f"{w}: {n}" for w, n in enumerate(total, 1) if n)]


STAGES = ("rollout", "teacher", "learner")


def stage_lines(rows: list[dict]) -> list[str]:
    """How a Ray run's stages overlapped, per kind of step (on fresh or reused student rollouts,
    on data): the median busy seconds of each stage (rollout_busy_s, ...), their sum, and the
    step's wall time, its critical path; a step whose wall time is below the busy sum ran its
    stages at once.  Nothing for the reference loop, which records no busy time."""
    lines = []
    kinds = (("on student rollouts", lambda r: r.get("source") == "student" and not r.get("reused")),
             ("on reused rollouts", lambda r: bool(r.get("reused"))),       # opd/distill/reuse.py
             ("on data", lambda r: r.get("source") != "student"))
    for label, kind in kinds:
        rs = [r for r in rows if kind(r) and any(r.get(f"{st}_busy_s") for st in STAGES)]
        if not rs:
            continue
        busy = {st: float(np.median([r.get(f"{st}_busy_s") or 0.0 for r in rs])) for st in STAGES}
        total = float(np.median([sum(r.get(f"{st}_busy_s") or 0.0 for st in STAGES) for r in rs]))
        wall = float(np.median([r["step_s"] for r in rs]))
        pieces = int(np.median([r.get("pieces") or 1 for r in rs]))
        used = [st for st in STAGES if busy[st] > 0]
        ratio = wall / max(total, 1e-9)
        lines.append(f"steps {label} ({len(rs)}, {pieces} piece{'s' * (pieces != 1)}): "
                     f"{' + '.join(used)} busy "
                     f"{' + '.join(f'{busy[st]:.3f}' for st in used)} = {total:.3f} s; "
                     f"a step took {wall:.3f} s, {ratio:.2f}x the busy sum: the stages "
                     f"{'overlapped' if ratio < 0.95 else 'ran one after another'} (medians)")
    return lines


def phase_spans(rows: list[dict]) -> list[tuple[str, int, int, int]]:
    """(phase name, first step, last step, steps on student rollouts) of each run of rows of
    one phase, in step order."""
    spans: list[list] = []
    for r in sorted(rows, key=lambda r: r["step"]):
        name = r.get("phase") or ""
        if not spans or spans[-1][0] != name:
            spans.append([name, r["step"], r["step"], 0])
        spans[-1][2] = r["step"]
        spans[-1][3] += r.get("source") == "student"
    return [tuple(s) for s in spans]


def print_summary(rows: list[dict], run_dir: str | Path) -> dict:
    s = summarize(rows)
    if not s:
        print("opd: no steps were run")
        return s
    width = max(len(k) for k in s)
    print(f"\nopd run summary ({run_dir})")
    for name, first, last, on in phase_spans(rows):
        print(f"  phase {name}: steps {first}-{last} ({last - first + 1}), "
              f"{on} on student rollouts")
    for k, v in s.items():
        print(f"  {k:<{width}}  {v:.4f}" if isinstance(v, float) else f"  {k:<{width}}  {v}")
    for line in window_lines(rows) + stage_lines(rows) + node_lines(run_dir):
        print(f"  {line}")
    return s


def node_lines(run_dir: str | Path) -> list[str]:
    """What a Ray run's consumed.json says of its nodes: the nodes each role ran on, and each
    node lost or added (actors/driver/nodes.py); nothing for a run without that record."""
    path = Path(run_dir) / "consumed.json"
    record = json.loads(path.read_text()) if path.is_file() else {}
    name = lambda n: f"{n['ip']} ({n['node'][:8]})" if n.get("ip") else n["node"][:8]  # noqa: E731
    lines = [f"{role} ran on {len(nodes)} node{'s' * (len(nodes) != 1)}: "
             + ", ".join(name(n) for n in nodes)
             for role, nodes in record.get("nodes", {}).items()]
    for e in record.get("node_events", []):
        if e["event"] == "lost":
            remade = ", ".join(f"{w} on {r['node'][:8]} after {r['after_s']:.1f} s"
                               for w, r in e["remade"].items())
            lines.append(f"node {name(e)} lost at step {e['step']}: held "
                         f"{', '.join(e['workers']) or 'no worker'}"
                         + (f"; re-made {remade}" if remade else "")
                         + (f"; next step trained {e['next_step_s']:.1f} s later"
                            if e.get("next_step_s") is not None else ""))
        else:
            lines.append(f"node {name(e)} added at step {e['step']}")
    return lines


# ---------------------------------------------------------------------------------------------
# Quality: did the student approach the teacher?

GAP_ROWS = (("FID ↓", "fid"), ("precision ↑", "precision"), ("recall ↑", "recall"),
            ("class accuracy ↑", "class_acc"), ("held-out KL(T‖S) ↓", "kl_data"),
            ("on-policy KL(T‖S) ↓", "kl_samples"))
"""(label, quality.parquet column) of the rows of `gap_table`: the held-out KL is teacher-forced
on data, the on-policy KL on the student's own completions of held-out prefixes (what on-policy
distillation trains on); both are 0 for the teacher by definition."""
KL_KEYS = ("kl_data", "kl_samples")
QUALITY_TABLE = "quality.md"


def gap_share(teacher: float | None, before: float | None, after: float | None) -> float | None:
    """Share of the gap to the teacher the student closed: (before − after) / (before − teacher);
    1 = reached the teacher, 0 = no change, < 0 = moved away.  None when a value is missing or
    the student started at the teacher's level."""
    values = (teacher, before, after)
    if any(v is None or not math.isfinite(v) for v in values) or before == teacher:
        return None
    return (before - after) / (before - teacher)


def _number(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "—"
    return f"{value:.4f}" if abs(value) < 10 else f"{value:.2f}"


def _count(row: dict, before: str, after: str = "") -> str:
    """", 1,000 samples" (with the given brackets) of a row that records its sample count."""
    return f"{before}{row['samples']:,} samples{after}" if row.get("samples") else ""


def gap_table(rows: list[dict]) -> str:
    """Markdown table `teacher | student before | student after | share of the gap closed` of
    quality.parquet rows: before = the first student evaluation, after = the last, each header
    with the sample count of its FID, precision, recall and class accuracy (rows that record
    one); the teacher's KL(T‖S), held-out and on-policy, is 0 by definition.  "" when there is
    no student row."""
    students = sorted((r for r in rows if r.get("role") == "student"), key=lambda r: r["step"])
    if not students:
        return ""
    teacher = next((r for r in rows if r.get("role") == "teacher"), {})
    before, after = students[0], students[-1]
    lines = [f"| | teacher{_count(teacher, ' (', ')')} | student before (step {before['step']}"
             f"{_count(before, ', ')}) | student after (step {after['step']}{_count(after, ', ')}) "
             f"| share of the gap closed |",
             "|---|---:|---:|---:|---:|"]
    for label, key in GAP_ROWS:
        t = 0.0 if key in KL_KEYS else teacher.get(key)
        b, a = before.get(key), after.get(key)
        share = gap_share(t, b, a)
        lines.append(f"| {label} | {_number(t)} | {_number(b)} | {_number(a)} | "
                     f"{'—' if share is None else f'{share:.1%}'} |")
    return "\n".join(lines) + "\n"


def write_quality_summary(run_dir: str | Path) -> str:
    """`gap_table` of the run's quality.parquet, written to <run_dir>/quality.md and returned
    ("" and nothing written when the run tracked no quality)."""
    from opd.eval.tracking import read_quality

    table = gap_table(read_quality(run_dir))
    if table:
        (Path(run_dir) / QUALITY_TABLE).write_text(
            "# Quality: student vs teacher\n\n" + table
            + "\nFID / precision / recall / class accuracy of the class-balanced samples each "
              "header counts (fixed keys); KL per token in nats: held-out = teacher-forced on "
              "held-out sequences, on-policy = on the student's own completions of held-out "
              "prefixes.\n")
    return table
