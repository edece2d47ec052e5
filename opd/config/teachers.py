"""The teachers of a run config: `teachers:`, a list of sections, one per teacher.

    cfg.teachers[0].name, cfg.teachers[0].transport     # "default", "full"

A `teacher:` section (and `teacher.KEY=VALUE`) is read as the list of its one entry, named
"default" (`one_teacher`).  A section of the run config's schema (opd/config/root.py joins
them; opd/config/schema.py loads them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field

from opd.config.loader import ConfigError

ONE_TEACHER = "default"
"""The name of the teacher a `teacher:` section gives (`one_teacher`)."""


@dataclass
class TeacherConfig:
    """One teacher and its workers, which score the student-visited states: an entry of
    `teachers:` (opd/distill/teachers.py; a `teacher:` section is read as the list of that one
    entry, named "default"), where a key left unset (null) takes the run's value."""

    name: str = ""
    """The teacher's name (its worker pool is opd/teacher/<name>/<i>, its metrics
    `teacher_*/<name>`); "default" for a `teacher:` section."""
    model: str | None = None
    """Model preset; null = model.teacher."""
    ckpt: str | None = None
    """Weights; null = model.teacher_ckpt (null there too: pretrained here, on `classes` only
    when it owns some)."""
    classes: tuple[Annotated[int, Field(ge=0)], ...] = ()
    """Routing (`teachers:`): the class labels this teacher owns; each row of a step is scored
    by the teacher that owns its class."""
    weight: Annotated[float, Field(ge=0.0)] | None = None
    """Mixing (`teachers:`): this teacher's weight w_i in the target log sum_i w_i p_i / sum w."""
    num_workers: Annotated[int, Field(ge=1)] = 1
    """Teacher workers."""
    transport: Literal["full", "topk"] = "full"
    """Scores sent to the learner: full-vocabulary log-probs (exact) or top-k log-probs + ids."""
    topk: Annotated[int, Field(ge=0)] = 0
    """k for transport=topk (1 <= k <= model.vocab_size); unused for full."""
    guided: bool = False
    """Score with CFG-guided teacher logits (scale rollout.cfg_scale) instead of conditional ones."""
    num_cpus: Annotated[float, Field(ge=0.0)] = 0.5
    """Ray CPUs per teacher worker."""
    num_gpus: Annotated[float, Field(ge=0.0)] = 0.0
    """Ray GPUs per teacher worker."""


def one_teacher(tree: dict[str, Any]) -> None:
    """Read a `teacher:` section of `tree` as `teachers: [{name: default, ...}]`, the list of its
    one entry, when `teachers:` is absent or empty; beside `teachers:` entries it is dropped (a
    preset's `teacher:` under an extending preset's `teachers:`, or an earlier version's
    config.yaml, which saved both)."""
    section = tree.pop("teacher", None)
    if section is not None and not isinstance(section, dict):
        raise ConfigError(f"'teacher' must be a mapping of keys, got {section!r}", "teacher")
    if not tree.get("teachers"):
        entry = dict(section or {})
        entry["name"] = entry.get("name") or ONE_TEACHER      # an earlier version saved name: ''
        tree["teachers"] = [entry]
