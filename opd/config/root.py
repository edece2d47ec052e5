"""The root of the run config's schema: `RunConfig`, its sections joined, and the rules between
keys, which pydantic checks once every key is valid.

    config_from_dict({"teacher": {"transport": "topk"}})
    # ConfigError: teacher.topk=0: teacher.transport='topk' needs 1 <= teacher.topk <= model.vocab_size (17)

The sections are the modules of their concepts (opd/config/model.py, rollout.py, teachers.py,
training.py, runtime.py), each key with its docstring.  A rule is a function of the built
RunConfig, registered `@rule`, that raises ConfigError naming the keys; RunConfig's model
validator runs them in order.  A rule that the engines own (which options combine) is asked of
them (rollout/options.py), not repeated here.  Loading: opd/config/schema.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from pydantic import ValidationInfo, model_validator

from opd.config.loader import ConfigError, strict_schema
from opd.config.model import DataConfig, ModelConfig
from opd.config.rollout import RolloutConfig
from opd.config.runtime import ClusterConfig, EvalConfig, RunOptions
from opd.config.teachers import ONE_TEACHER, TeacherConfig
from opd.config.training import DistillConfig, LearnerConfig, PretrainConfig
from rollout.options import check_options, engine_options, engines_taking


@strict_schema
@dataclass
class RunConfig:
    """Everything one `opd` run needs; saved as config.yaml in the run directory."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    teachers: list[TeacherConfig] = field(
        default_factory=lambda: [TeacherConfig(name=ONE_TEACHER)])
    """The run's teachers (opd/distill/teachers.py), each with a `name`; several either route
    (each entry the `classes` it owns) or mix (each a `weight`).  A `teacher:` section (and
    `teacher.KEY=VALUE`) is the list of its one entry, named "default" (`one_teacher`)."""
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunOptions = field(default_factory=RunOptions)

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> RunConfig:
        """The rules between keys (`RULES`), once every key is valid; skipped for a
        preset read before its overrides (context {"rules": False}: they may still change what
        a rule relates)."""
        if (info.context or {}).get("rules", True):
            for rule in RULES:
                rule(self)
        return self


RULES: list[Callable[[RunConfig], None]] = []
"""The rules, in the order they are checked."""


def rule(fn: Callable[[RunConfig], None]) -> Callable[[RunConfig], None]:
    """Register a rule over several fields; it raises ConfigError naming the keys."""
    RULES.append(fn)
    return fn


@rule
def _teachers(cfg: RunConfig) -> None:
    """`teachers:` routes by class (every class owned once) or mixes by weight, with one
    transport (the learner's target is one tensor); opd/distill/teachers.py."""
    ts = cfg.teachers
    names = [t.name for t in ts]
    for i, t in enumerate(ts):
        if not t.name or "/" in t.name or names.count(t.name) > 1:
            raise ConfigError(f"teachers[{i}].name={t.name!r}: every teacher needs a name of its "
                              f"own, without '/' (its pool is opd/teacher/<name>)",
                              f"teachers[{i}].name")
        _teacher_topk_of(t, cfg.model.vocab_size, f"teachers[{i}]")
        if (t.transport, t.topk) != (ts[0].transport, ts[0].topk):
            raise ConfigError(f"teachers[{i}].transport={t.transport!r} (topk {t.topk}): every "
                              f"teacher sends the learner one kind of target; set the "
                              f"transport of teachers[0] ({ts[0].transport!r}, topk "
                              f"{ts[0].topk}) on each", f"teachers[{i}].transport")
    routed, mixed = [bool(t.classes) for t in ts], [t.weight is not None for t in ts]
    if any(routed) and any(mixed) or (len(ts) > 1 and not (all(routed) or all(mixed))):
        raise ConfigError("teachers: give every teacher either the classes it owns (routing) or "
                          "a weight (mixing), not both and not neither", "teachers")
    if any(mixed):
        if sum(t.weight for t in ts) <= 0:
            raise ConfigError("teachers: the weights sum to 0; give at least one teacher a "
                              "positive weight", "teachers[0].weight")
        if ts[0].transport != "full":
            raise ConfigError("teachers[0].transport='topk': a mixture log sum_i w_i p_i is exact "
                              "only over the full vocabulary (each teacher's top-k ids differ); "
                              "set transport: full on every mixed teacher, or route by class",
                              "teachers[0].transport")
    C = cfg.model.num_classes
    owner: dict[int, str] = {}
    for i, t in enumerate(ts):
        for c in t.classes:
            if c >= C:
                raise ConfigError(f"teachers[{i}].classes: class {c} is not a label of "
                                  f"model.num_classes={C} (0..{C - 1})", f"teachers[{i}].classes")
            if c in owner:
                raise ConfigError(f"teachers[{i}].classes: class {c} is owned by {owner[c]!r} "
                                  f"too; each class has one teacher", f"teachers[{i}].classes")
            owner[c] = t.name
    if any(routed) and len(owner) < C:
        none = sorted(set(range(C)) - set(owner))
        raise ConfigError(f"teachers: classes {none} are owned by no teacher; add them to one "
                          f"teacher's classes", "teachers")
    if len(ts) > 1 and (any(p.objective == "seqkd" for p in cfg.distill.phases) or (
            not cfg.distill.phases and cfg.distill.objective == "seqkd")):
        raise ConfigError("distill.objective=seqkd samples from one teacher; with several "
                          "teachers use kd, gkd or varkd", "distill.objective")


def _teacher_topk_of(t: TeacherConfig, v: int, key: str) -> None:
    if t.transport == "topk" and not 1 <= t.topk <= v:
        raise ConfigError(f"{key}.topk={t.topk}: {key}.transport='topk' needs 1 <= {key}.topk "
                          f"<= model.vocab_size ({v})", f"{key}.topk")


@rule
def _rollout_top_k(cfg: RunConfig) -> None:
    if cfg.rollout.top_k > cfg.model.vocab_size:
        raise ConfigError(f"rollout.top_k={cfg.rollout.top_k}: must be <= model.vocab_size "
                          f"({cfg.model.vocab_size}); 0 turns top-k off", "rollout.top_k")


@rule
def _candidates(cfg: RunConfig) -> None:
    """Candidate drafting, checked by the engines' own rules (rollout/options.py)."""
    r = cfg.rollout
    if not r.candidates:
        return
    takes = engine_options(r.engine)
    if "candidates" not in takes:
        raise ConfigError(f"rollout.candidates={r.candidates}: only the "
                          f"{' and '.join(sorted(engines_taking('candidates')))} engines draft "
                          f"candidates (rollout.engine={r.engine!r})", "rollout.candidates")
    try:
        check_options(r.engine, r.engine_options(takes), takes)
    except ValueError as e:
        raise ConfigError(f"rollout.candidates={r.candidates}: {e}", "rollout.candidates") from None


@rule
def _window(cfg: RunConfig) -> None:
    """`rollout.window: auto` is HB-SJD's window policy (rollout/window.py); the other Jacobi
    engines run a fixed window."""
    r = cfg.rollout
    takes = engine_options(r.engine)
    if r.window != "auto" or "window" not in takes:
        return
    try:
        check_options(r.engine, {"window": "auto"}, takes)
    except ValueError:
        raise ConfigError(f"rollout.window=auto: only the hbsjd engine chooses its window per "
                          f"round; set rollout.window to an int for rollout.engine={r.engine!r}",
                          "rollout.window") from None


@rule
def _phases(cfg: RunConfig) -> None:
    d = cfg.distill
    phases = d.phases
    for i, p in enumerate(phases):
        key = f"distill.phases[{i}]"
        if p.steps is None and i < len(phases) - 1:
            raise ConfigError(f"{key}.steps is not set: only the last phase may leave out its "
                              f"steps (it takes the rest of distill.steps)", f"{key}.steps")
        if p.prefix_ratio is not None and p.prefix_ratios is not None:
            raise ConfigError(f"{key}: set prefix_ratio or prefix_ratios, not both",
                              f"{key}.prefix_ratios")
        if p.lam_end is not None and (p.objective or d.objective) != "gkd":
            raise ConfigError(f"{key}.lam_end={p.lam_end:g}: a lambda ramp needs objective gkd "
                              f"(the phase's objective is {p.objective or d.objective!r})",
                              f"{key}.lam_end")
    reuses = [d.reuse] + [p.reuse for p in phases if p.reuse is not None]
    if max(reuses) > 1 and d.staleness > 0:
        raise ConfigError(f"distill.reuse > 1 with distill.staleness={d.staleness}: a step trains on "
                          f"a reused rollout or a stale one, not both; set distill.staleness=0",
                          "distill.staleness")
    fixed = sum(p.steps or 0 for p in phases)
    if phases and phases[-1].steps is not None and fixed != d.steps:
        raise ConfigError(f"distill.phases: the phases' steps add up to {fixed}, not "
                          f"distill.steps={d.steps}; set distill.steps={fixed} or leave out the "
                          f"last phase's steps (it then takes the rest)", "distill.phases")
    if phases and phases[-1].steps is None and fixed >= d.steps:
        raise ConfigError(f"distill.phases: the phases before the last take {fixed} steps, "
                          f"leaving none of distill.steps={d.steps} for the last; raise "
                          f"distill.steps, shorten them (distill.phases.0.steps=N) or set "
                          f"distill.objective alone for one objective throughout", "distill.phases")


@rule
def _score_cache(cfg: RunConfig) -> None:
    if cfg.distill.cache_data_scores and cfg.run.mode != "reference":
        raise ConfigError("distill.cache_data_scores=true needs run.mode=reference (a Ray run's "
                          "teacher workers keep no cache); set run.mode=reference or "
                          "distill.cache_data_scores=false", "distill.cache_data_scores")


@rule
def _worker_span(cfg: RunConfig) -> None:
    n = cfg.rollout.num_workers
    if isinstance(n, tuple) and n[0] > n[1]:
        raise ConfigError(f"rollout.num_workers='{n[0]}..{n[1]}': min must be <= max",
                          "rollout.num_workers")


@rule
def _pieces(cfg: RunConfig) -> None:
    P, B, R = cfg.distill.pieces, cfg.data.batch_size, cfg.learner.world_size
    if P and P > B // max(R, 1):
        raise ConfigError(f"distill.pieces={P}: a step of data.batch_size={B} rows over "
                          f"learner.world_size={R} ranks has at most {B // max(R, 1)} pieces (a "
                          f"row per rank each); lower distill.pieces or set 0 (auto)",
                          "distill.pieces")


@rule
def _history_offset(cfg: RunConfig) -> None:
    h, t = cfg.rollout.history_offset, cfg.model.grid_size ** 2
    if h is not None and h >= t:
        raise ConfigError(f"rollout.history_offset={h}: must be < the sequence length "
                          f"model.grid_size ** 2 ({t})", "rollout.history_offset")
