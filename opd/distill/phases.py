"""The distillation schedule: `distill.phases` resolved into step ranges.

    phase_at(cfg, 450)       # Phase(index=1, name="onpolicy", start=400, end=600, objective="gkd", ...)
    objective_at(cfg, 450)   # the GKD objective of step 450 (λ of the ramp at that step)

A run is a list of phases, each a range of learner steps [start, end) with its own objective
settings (objective, GKD's λ with an optional linear ramp, β, temperature, prefix ratios,
objective options, rollout reuse) and, optionally, a learning-rate schedule of its own.  What a
phase leaves unset is the run's value (distill.*, data.prefix_ratio(s), learner.*); `distill.phases: []`
is one phase with the run's values for every step.

Everything here is a function of (config, step) alone, so the reference loop, the driver's
planner and every learner rank agree on a step's objective, source, prefix and learning rate,
also after a resume (invariants 5 and 8, docs/ARCHITECTURE.md).  Why the default is a KD warm
start followed by on-policy GKD, and what it was measured against: docs/RESULTS.md, "Schedules over seeds".
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from opd.config.schema import RunConfig
from opd.distill.objectives import Objective, get_objective
from opd.config.objective_settings import OBJECTIVE_SETTINGS


@dataclass(frozen=True)
class Phase:
    """One resolved phase: steps [start, end) and every setting with the run's defaults filled in."""
    index: int
    name: str
    start: int
    end: int
    objective: str
    lam: float
    lam_end: float
    beta: float
    temperature: float
    prefix_ratios: tuple[float, ...]
    lr: float | None                   # the peak of the phase's own schedule; None = the run's
    warmup_steps: int
    options: dict[str, Any] = field(default_factory=dict)
    reuse: int = 1                     # rollout reuse (opd/distill/reuse.py)
    reuse_buffer: int = 1
    reuse_fresh: float = 1.0

    @property
    def steps(self) -> int:
        return self.end - self.start

    def lam_at(self, step: int) -> float:
        """λ at `step`: linear from `lam` at the first step to `lam_end` at the last."""
        if self.lam_end == self.lam or self.steps <= 1:
            return self.lam
        frac = min(max(step - self.start, 0), self.steps - 1) / (self.steps - 1)
        return self.lam + (self.lam_end - self.lam) * frac

    def describe(self) -> str:
        """One line for the summary: name, steps and what the phase trains on."""
        what = self.objective
        if self.objective == "gkd":
            lam = (f"λ {self.lam:g}" if self.lam_end == self.lam
                   else f"λ {self.lam:g}→{self.lam_end:g}")
            what += f" ({lam}, β {self.beta:g})"
        return f"{self.name}: steps {self.start}-{self.end - 1} ({self.steps}), {what}"


def phases(cfg: RunConfig) -> tuple[Phase, ...]:
    """The run's phases in order, covering steps 0..distill.steps-1."""
    d, lr = cfg.distill, cfg.learner
    run_ratios = cfg.data.prefix_ratios or (cfg.data.prefix_ratio,)
    specs = d.phases or [None]
    out, start = [], 0
    for i, p in enumerate(specs):
        get = (lambda key, default: default) if p is None else (
            lambda key, default, p=p: default if getattr(p, key) is None else getattr(p, key))
        steps = d.steps - start if p is None or p.steps is None else p.steps
        objective = get("objective", d.objective)
        ratios = (p.prefix_ratios if p is not None and p.prefix_ratios is not None
                  else (p.prefix_ratio,) if p is not None and p.prefix_ratio is not None
                  else run_ratios)
        own = p is not None and (p.lr is not None or p.warmup_steps is not None)
        lam = get("lam", d.lam)
        name = (p.name if p is not None and p.name else
                objective if len(specs) == 1 else f"{i}:{objective}")
        out.append(Phase(
            index=i, name=name, start=start, end=start + steps, objective=objective, lam=lam,
            lam_end=get("lam_end", lam), beta=get("beta", d.beta),
            temperature=get("temperature", d.temperature), prefix_ratios=tuple(ratios),
            lr=(get("lr", lr.lr) if own else None),
            warmup_steps=get("warmup_steps", lr.warmup_steps),
            options={**d.objective_options, **(p.objective_options if p is not None else {})},
            reuse=get("reuse", d.reuse), reuse_buffer=get("reuse_buffer", d.reuse_buffer),
            reuse_fresh=get("reuse_fresh", d.reuse_fresh)))
        start += steps
    return tuple(out)


def phase_at(cfg: RunConfig, step: int) -> Phase:
    """The phase of learner step `step` (steps past the end: the last phase)."""
    ps = phases(cfg)
    return ps[max(0, bisect.bisect_right([p.start for p in ps], step) - 1)]


def phase_objective(phase: Phase, step: int | None = None) -> Objective:
    """The objective of `phase` at `step` (its first step when None), built by name from the
    settings it reads (opd/config/objective_settings.py), λ the ramp's at `step`."""
    values = dict(lam=phase.lam_at(phase.start if step is None else step), beta=phase.beta,
                  temperature=phase.temperature)
    reads = {key: values[key] for key in OBJECTIVE_SETTINGS[phase.objective]}
    return get_objective(phase.objective, **{**reads, **phase.options})


def objective_at(cfg: RunConfig, step: int) -> Objective:
    """The objective of learner step `step`."""
    return phase_objective(phase_at(cfg, step), step)


def phase_sources(phase: Phase) -> set[str]:
    """Where the phase's sequences can come from: "student", "data", "teacher"."""
    out = set()
    for step in (phase.start, phase.end - 1):
        source = phase_objective(phase, step).source
        out |= {"student", "data"} if source == "mixed" else {source}
    return out


def rolls_out(cfg: RunConfig) -> bool:
    """Whether any step of the run can train on student rollouts (else no rollout worker)."""
    return any("student" in phase_sources(p) for p in phases(cfg))


def objectives(cfg: RunConfig) -> list[Objective]:
    """One objective per phase (its first step's), for checks that hold for the whole run."""
    return [phase_objective(p) for p in phases(cfg)]


def learning_rate(cfg: RunConfig, step: int) -> float:
    """The learning rate of 0-based learner step `step`.  The run's schedule: learner.lr after a
    linear warm-up over learner.warmup_steps, then constant or (learner.lr_decay="linear")
    decaying linearly to 10 % at distill.steps.  A phase with its own `lr` / `warmup_steps`
    restarts it inside the phase: warm-up from the phase's first step, decay to 10 % at its
    end.  A function of the step alone, so resume is exact."""
    p = phase_at(cfg, step)
    if p.lr is None:
        lr, start, length, warmup = cfg.learner.lr, 0, cfg.distill.steps, cfg.learner.warmup_steps
    else:
        lr, start, length, warmup = p.lr, p.start, p.steps, p.warmup_steps
    local = step - start
    if warmup > 0:
        lr *= min(1.0, (local + 1) / warmup)
    if cfg.learner.lr_decay == "linear":
        lr *= 0.1 + 0.9 * max(0.0, 1.0 - local / length)
    return lr
