"""`opd bench teachers`: what distilling from several specialist teachers gives, per class.

    opd bench teachers --config digits_two_teachers [--samples 1000] [--out DIR] [key=value ...]

Trains two students from the same start with the run preset's settings, in this process (the
reference loop, which a Ray run equals: invariant 5): one from the preset's routed `teachers:`
(each row scored by the specialist that owns its class), one from the default single teacher of
all classes (`teachers=[]`).  Then draws `--samples` class-balanced images from each student,
each specialist and the single teacher, and measures each class's accuracy (the digits CNN's
agreement with the class it was drawn for).  Writes teachers.md (a row per class: its owner, the
owner's accuracy on it, the two students', the single teacher's) and teachers.json.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

from opd.config.schema import RunConfig, apply_overrides
from opd.distill.teachers import ROUTE, run_teachers
from opd.eval.run import per_class_accuracy
from opd.eval.sample import sample_images
from opd.models.factory import load_role_model
from opd.run.checkpoints import latest_checkpoint
from opd.run.reference import run_reference


def _student(cfg: RunConfig, run_dir: Path):
    from opd.eval.run import load_student, resolve_checkpoint
    return load_student(resolve_checkpoint(latest_checkpoint(run_dir), overrides=()))


def _accuracy(model, cfg: RunConfig, samples: int) -> list[float]:
    s = sample_images(model, cfg, samples)
    return per_class_accuracy(s.images, s.labels, cfg.model.num_classes)


def run_teachers_bench(cfg: RunConfig, out: Path, samples: int, progress: bool = True) -> dict:
    """The per-class table's figures (module docstring); `cfg` a run config with routed
    teachers."""
    teachers = run_teachers(cfg)
    if teachers.rule != ROUTE:
        raise ValueError("opd bench teachers compares specialists: the config's teachers: must "
                         "route by class (each entry with its classes)")
    quiet = ["eval.track=false", f"distill.steps={cfg.distill.steps}"]
    runs = {"two": apply_overrides(cfg, quiet + [f"run.dir={out / 'two'}"]),
            "one": apply_overrides(cfg, quiet + ["teachers=[]", f"run.dir={out / 'one'}"])}
    seconds, acc = {}, {}
    for name, c in runs.items():
        t0 = time.perf_counter()
        rows = run_reference(c, c.run.dir, progress=progress)
        seconds[name] = time.perf_counter() - t0
        acc[f"student_{name}"] = _accuracy(_student(c, Path(c.run.dir)), cfg, samples)
        acc[f"loss_{name}"] = rows[-1]["loss"]
    for t in teachers.entries:
        acc[f"teacher_{t.name}"] = _accuracy(
            load_role_model(cfg, "teacher", teacher=t, progress=progress), cfg, samples)
    one = runs["one"]
    acc["teacher_one"] = _accuracy(
        load_role_model(one, "teacher", teacher=one.teachers[0], progress=progress), cfg, samples)
    owner = teachers.owners_of_classes(cfg.model.num_classes)
    return {"samples": samples, "steps": cfg.distill.steps, "seconds": seconds,
            "owners": [teachers.names[o] for o in owner], "accuracy": acc}


def format_markdown(report: dict) -> str:
    a, owners = report["accuracy"], report["owners"]

    def cell(x: float) -> str:
        return "—" if x is None or math.isnan(x) else f"{x:.3f}"

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)
    lines = ["| class | owner | owner's accuracy | student of the two specialists | "
             "student of one teacher | the one teacher |", "|---|---|---:|---:|---:|---:|"]
    own = [a[f"teacher_{o}"][c] for c, o in enumerate(owners)]
    for c, o in enumerate(owners):
        lines.append(f"| {c} | {o} | {cell(own[c])} | {cell(a['student_two'][c])} | "
                     f"{cell(a['student_one'][c])} | {cell(a['teacher_one'][c])} |")
    lines.append(f"| all | | {cell(mean(own))} | {cell(mean(a['student_two']))} | "
                 f"{cell(mean(a['student_one']))} | {cell(mean(a['teacher_one']))} |")
    s = report["seconds"]
    lines.append("")
    lines.append(f"{report['samples']} class-balanced samples per model; {report['steps']} "
                 f"steps per student ({s['two']:.0f} s from the specialists, {s['one']:.0f} s "
                 f"from one teacher).")
    return "\n".join(lines) + "\n"
