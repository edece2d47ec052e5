"""Run configuration: nested dataclasses are the schema, YAML presets and dotted overrides set it.

    cfg = load_config("tiny", ["rollout.window=8", "learner.betas=[0.9,0.99]"])
    cfg.rollout.window            # 8

A run config is built in three layers, later ones winning: the dataclass defaults (the
embedded digits setup), a YAML preset from `configs/` (or any path, `extends:` another), then
`key=value` overrides whose values are parsed as YAML scalars (`null`, `true`, `1e-3`,
`[0.9, 0.99]`).  What the config alone decides is validated once, on load, by pydantic: unknown
keys (with the closest valid key suggested), wrong types, out-of-range or not-allowed values and
the rules between keys raise `ConfigError` naming the full dotted key and the value.  Two checks
wait for the start of a run, before any work, and raise the same one-line errors: whether every
phase's objective takes the teacher transport (`opd.run.loop.check_objectives`: the objectives
say what they take in opd/distill, which imports torch, and the schema imports none), and what
the Ray pipeline needs of a config (`actors.driver.cluster.check_distributed`: ranks that
share a batch evenly, weights that reach rollouts within distill.staleness, an elastic pool's
rules), which only a Ray run asks of it.

The schema is one dataclass per section of a run, each in the module of its concept, with the
docstring users read of every key: opd/config/model.py (model, data), rollout.py, teachers.py,
training.py (learner, distill and its phases, pretrain) and runtime.py (cluster, eval, run);
opd/config/root.py joins them into `RunConfig` and holds the rules between keys.  This module
holds the entry points (and names every section, so `from opd.config.schema import
TeacherConfig` reads as the schema).  The machinery is shared with the bench presets:
`opd.config.loader` validates a tree against a dataclass schema on pydantic and words the
errors, `opd.config.overrides` sets dotted overrides, `opd.config.files` finds presets, merges
`extends:` and writes the resolved config back (YAML, hash).

What a registry owns is read from it, not repeated: the engines, their options' names and
defaults and the decoding / refresh / execution modes (rollout/options.py), the objectives and
the ranges and defaults of λ, β, τ (opd/config/objective_settings.py); `tests/opd/test_registries.py`
holds the two to each other.

Adding a field is one line plus its docstring: `name: type = default`, with a numeric range in
the type: `name: Annotated[int, Field(ge=1)] = default` (pydantic's own constraints; also a
tuple's items, `tuple[Annotated[float, Field(ge=0.0)], ...]`, or a union's member). Supported
types: bool, int, float, str, `Literal[...]`, `X | None`, unions, `tuple[...]`, `list[X]`,
`min_max(X)` (a pair, also written "min..max"), `dict[str, Any]` (free-form, validated by its
user), and a list of sections (`list[PhaseConfig]`: each entry validated like a section, errors
name `distill.phases[1].lam`; one entry's key set on the command line as
`distill.phases.1.lam=0.5`). A rule between keys is a function of opd/config/root.py
decorated `@rule`.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from opd.config import loader
from opd.config.files import config_to_dict, read_preset, resolve_preset
from opd.config.loader import ConfigError
from opd.config.model import DataConfig, ModelConfig
from opd.config.overrides import deep_merge, set_overrides
from opd.config.rollout import (ENGINE_KEYS, RUN_CHOICES, Decoding, EngineName,
                                RolloutConfig)
from opd.config.root import RunConfig
from opd.config.runtime import ClusterConfig, EvalConfig, RunOptions
from opd.config.teachers import TeacherConfig, one_teacher
from opd.config.training import DistillConfig, LearnerConfig, PhaseConfig, PretrainConfig

__all__ = ["ENGINE_KEYS", "RUN_CHOICES", "ClusterConfig", "ConfigError", "DataConfig",
           "Decoding", "DistillConfig", "EngineName", "EvalConfig", "LearnerConfig",
           "ModelConfig", "PhaseConfig", "PretrainConfig", "RolloutConfig", "RunConfig",
           "RunOptions", "TeacherConfig", "apply_overrides", "check_resume_overrides",
           "check_retired_keys", "config_from_dict", "default_run_dir", "load_config",
           "one_teacher", "run_name", "validate"]


# --------------------------------------------------------------------------------------------
# Loading and validation
# --------------------------------------------------------------------------------------------

RETIRED_KEYS = {
    "rollout.sub_batches": "a step is cut into distill.pieces now (they stream through rollout, "
                           "teacher and learner); set distill.pieces=N",
    "run.deterministic": "runs are always reproducible (keyed random numbers, seeded "
                         "initialization), so the key did nothing; drop it",
    "run.resume": "continue a run with opd train --resume RUN_DIR",
}
"""Keys that earlier versions wrote into config.yaml but nothing read: a run directory's old
config.yaml still loads (they are dropped); setting one names what to do instead."""

RESUME_SAFE_KEYS = ("distill.steps", "run.checkpoint_every", "run.log_every", "eval.",
                    "run.loggers", "run.mlflow_uri")
"""What `opd train --resume RUN key=value` may change: how long the run goes on (a new
distill.steps also stretches the learning-rate decay from the resumed step on), how often it
checkpoints and logs, which trackers it logs to, and its evaluations (a key ending in "." is a section).  Anything else
would make the resumed steps another run's."""


def check_resume_overrides(overrides: list[str] | tuple[str, ...]) -> None:
    """ConfigError naming the first override that a resumed run may not change."""
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if not any(key == k or (k.endswith(".") and key.startswith(k))
                   for k in RESUME_SAFE_KEYS):
            raise ConfigError(f"--resume cannot change {key}: the resumed steps would be another "
                              f"run's; only distill.steps, run.checkpoint_every, run.log_every, "
                              f"run.loggers, run.mlflow_uri and eval.* change on resume (start a "
                              f"new run for the rest)", key)


def check_retired_keys(overrides: list[str] | tuple[str, ...]) -> None:
    """ConfigError naming the first override of a key that was removed, and what to do instead."""
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key in RETIRED_KEYS:
            raise ConfigError(f"config key '{key}' was removed: {RETIRED_KEYS[key]}", key)


def _drop_retired(tree: dict[str, Any]) -> None:
    for key in RETIRED_KEYS:
        section, name = key.split(".")
        if isinstance(tree.get(section), dict):
            tree[section].pop(name, None)


def _set_overrides(tree: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> None:
    """Set dotted overrides in order; `teacher.KEY=VALUE` sets the key of the one entry of
    `teachers:` (`one_teacher`)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if key.startswith("teacher."):
            one_teacher(tree)
            n = len(tree["teachers"])
            if n != 1:
                raise ConfigError(f"{key}: this run has {n} teachers (teachers:); set "
                                  f"teachers.N.{key[len('teacher.'):]}=VALUE on teacher N", key)
            item = f"teachers.0.{key[len('teacher.'):]}{sep}{raw}"
        set_overrides(RunConfig, tree, [item])


def _writes_teacher(tree: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> bool:
    """Whether the run's one teacher is written as `teacher:` (a section, `teacher.KEY=VALUE` or
    nothing) rather than as `teachers:` entries."""
    return not tree.get("teachers") and not any(
        item.strip().startswith("teachers") for item in overrides)


@contextmanager
def _as_written(teacher: bool):
    """A ConfigError names the one teacher's keys as the user wrote them: `teacher.KEY` for
    `teachers[0].KEY` when `teacher` (`_writes_teacher`)."""
    try:
        yield
    except ConfigError as e:
        if not (teacher and e.key and e.key.startswith(("teachers[0]", "teachers.0"))):
            raise
        msg, key = str(e), e.key
        for spelled in ("teachers[0]", "teachers.0"):
            msg, key = msg.replace(spelled, "teacher"), key.replace(spelled, "teacher")
        raise ConfigError(msg, key) from None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Defaults, then the YAML preset `path` (a name in configs/ or a file), then `key=value`
    overrides; validated. Raises ConfigError on any problem."""
    check_retired_keys(overrides)
    tree: dict[str, Any] = {}
    if path is not None:
        preset = resolve_preset(path)
        tree = read_preset(preset, merge=_merge_presets)
        _drop_retired(tree)
    with _as_written(_writes_teacher(tree, overrides)):
        if path is not None:
            one_teacher(tree)
            try:
                loader.build(RunConfig, tree, context={"rules": False})
            except ConfigError as e:
                raise ConfigError(f"{preset}: {e}", e.key) from None
        _set_overrides(tree, overrides)
        _objective_replaces_phases(tree, overrides)
        return config_from_dict(tree)


def _merge_presets(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """A preset over the one it extends; one that sets distill.objective without
    distill.phases trains with that objective for the whole run (its base's phases go)."""
    out = deep_merge(base, top)
    own = top.get("distill") if isinstance(top.get("distill"), dict) else {}
    if "objective" in own and "phases" not in own and isinstance(out.get("distill"), dict):
        out["distill"]["phases"] = []
    return out


def _objective_replaces_phases(tree: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> None:
    """`distill.objective=X` given without `distill.phases...`: X for the whole run (the
    preset's phases go), so `opd train distill.objective=kd` is plain KD on data."""
    keys = [item.split("=", 1)[0].strip() for item in overrides]
    if "distill.objective" in keys and not any(k.startswith("distill.phases") for k in keys):
        if isinstance(tree.get("distill"), dict):
            tree["distill"]["phases"] = []


def apply_overrides(cfg: RunConfig, overrides: list[str] | tuple[str, ...]) -> RunConfig:
    """A validated copy of `cfg` with dotted `key=value` overrides applied."""
    tree = config_to_dict(cfg)
    with _as_written(_writes_teacher(tree, overrides)):
        _set_overrides(tree, overrides)
        _objective_replaces_phases(tree, overrides)
        return config_from_dict(tree)


def config_from_dict(tree: dict[str, Any]) -> RunConfig:
    """Build and validate a RunConfig from a (partial) nested dict, e.g. one that came over Ray."""
    spelled = isinstance(tree, dict) and _writes_teacher(tree)
    if isinstance(tree, dict):                     # anything else: `build` names it
        tree = dict(tree)
        one_teacher(tree)
    with _as_written(spelled):
        return loader.build(RunConfig, tree)


def validate(cfg: RunConfig) -> RunConfig:
    """Check a config built in code (types, ranges, cross-field rules); returns a normalized copy."""
    return config_from_dict(config_to_dict(cfg))


def default_run_dir(cfg: RunConfig, now: float | None = None) -> Path:
    """run.dir, or runs/<run name>-<YYYYmmdd-HHMMSS> when it is None (`run_name`)."""
    if cfg.run.dir is not None:
        return Path(cfg.run.dir)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    return Path("runs") / f"{run_name(cfg)}-{stamp}"


def run_name(cfg: RunConfig) -> str:
    """run.name, or "<data.dataset>-<objectives of the phases in order>" (digits-kd-gkd)."""
    if cfg.run.name:
        return cfg.run.name
    d = cfg.distill
    names = [p.objective or d.objective for p in d.phases] or [d.objective]
    kept = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]
    return "-".join([cfg.data.dataset, *kept])
