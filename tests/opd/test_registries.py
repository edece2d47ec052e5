"""The run config's choices are the registries': engine names, their options and defaults, the
decoding / refresh / execution modes, the objectives and the settings they read.  Each test
derives what the schema must say from the registry and fails when the two disagree."""
import dataclasses
import typing

import pytest

from opd.config import loader
from opd.config.schema import (ENGINE_KEYS, RUN_CHOICES, DistillConfig, EvalConfig, PhaseConfig,
                               RolloutConfig, RunConfig, load_config)
from opd.distill.objectives import OBJECTIVES, get_objective
from opd.distill.phases import phase_objective, phases
from opd.config.objective_settings import OBJECTIVE_SETTINGS, SETTINGS
from rollout import ENGINES
from rollout.options import (DECODINGS, ENGINE_OPTIONS, EXECUTIONS, REFRESHES, engine_options,
                             option_defaults)


def allowed(cls, key):
    """The Literal values a schema field accepts (the Literal inside `X | None`, `int | Literal`)."""
    tp = loader.hints(cls)[key]
    literals = [a for a in (typing.get_args(tp) or (tp,)) if typing.get_origin(a) is typing.Literal]
    if typing.get_origin(tp) is typing.Literal:
        literals = [tp]
    return tuple(v for lit in literals for v in typing.get_args(lit))


def default(cls, key):
    return cls.__dataclass_fields__[key].default


def test_engine_names_are_the_registry():
    assert tuple(ENGINES) != () and set(ENGINES) == set(ENGINE_OPTIONS)
    assert allowed(RolloutConfig, "engine") == tuple(ENGINE_OPTIONS)
    assert set(allowed(EvalConfig, "engine")) == set(ENGINE_OPTIONS)
    for name, cls in ENGINES.items():
        assert cls.name == name and cls().options == engine_options(name)


def test_modes_are_the_engines():
    assert allowed(RolloutConfig, "decoding") == DECODINGS
    assert allowed(EvalConfig, "decoding") == DECODINGS
    assert allowed(RolloutConfig, "refresh") == REFRESHES
    assert allowed(RolloutConfig, "execution") == EXECUTIONS


def test_engine_options_have_one_name_and_one_default():
    defaults = option_defaults()
    for name in ENGINE_OPTIONS:                  # an option's default is the same in every engine
        for key, value in engine_options(name).items():
            assert defaults[key] == value, (name, key)
    # every rollout.* key named like an option is that option, and the run's engine takes them all
    fields = set(RolloutConfig.__dataclass_fields__)
    assert set(ENGINE_KEYS) == fields & set(defaults)
    assert set(ENGINE_KEYS) <= set(engine_options(default(RolloutConfig, "engine")))
    assert {"window", "history_offset"} <= set(ENGINE_KEYS) and not {"W", "H"} & set(defaults)
    # the run's defaults are the engines', but for the run's declared choices
    differ = {k for k in ENGINE_KEYS if default(RolloutConfig, k) != defaults[k]}
    assert differ == set(RUN_CHOICES)
    assert {k: default(RolloutConfig, k) for k in RUN_CHOICES} == RUN_CHOICES


def test_the_default_run_passes_its_options_under_their_names():
    r = RunConfig().rollout
    takes = engine_options(r.engine)
    assert r.engine_options(takes) == {k: getattr(r, k) for k in ENGINE_KEYS}
    assert r.engine_options(takes)["window"] == "auto" and r.engine_options(takes)["decoding"] == "sample"


def test_objective_names_are_the_registry():
    assert set(OBJECTIVES) == set(OBJECTIVE_SETTINGS)
    assert allowed(DistillConfig, "objective") == tuple(OBJECTIVE_SETTINGS)
    assert allowed(PhaseConfig, "objective") == tuple(OBJECTIVE_SETTINGS)


@pytest.mark.parametrize("key", sorted(SETTINGS))
def test_objective_settings_are_declared_once(key):
    s = SETTINGS[key]
    for cls in (DistillConfig, PhaseConfig):
        assert loader.bounds(loader.hints(cls)[key]) == s.bounds, (cls.__name__, key)
    assert default(DistillConfig, key) == s.default
    assert loader.bounds(loader.hints(PhaseConfig)["lam_end"]) == SETTINGS["lam"].bounds
    for name, reads in OBJECTIVE_SETTINGS.items():
        cls = OBJECTIVES[name]
        if key in reads:                        # the objective's field: same name, same default
            assert {f.name: f.default for f in dataclasses.fields(cls)}[key] == s.default
            bad = s.le + 0.5 if s.le is not None else (s.gt if s.gt is not None else s.ge) - 1
            with pytest.raises(ValueError, match=rf"^{name}\.{key} must "):
                get_objective(name, **{key: bad})
        else:
            assert key not in {f.name for f in dataclasses.fields(cls)}


def test_a_phase_passes_each_objective_the_settings_it_reads():
    cfg = load_config(None, ["distill.phases.1.lam=0.25", "distill.phases.1.beta=0.75",
                             "distill.phases.0.temperature=0.5"])
    warm, onpolicy = phases(cfg)
    kd, gkd = phase_objective(warm), phase_objective(onpolicy)
    assert (kd.name, kd.temperature) == ("kd", 0.5)
    assert (gkd.name, gkd.lam, gkd.beta, gkd.temperature) == ("gkd", 0.25, 0.75, 1.0)


def test_registering_an_undeclared_name_fails():
    from opd.distill.objectives import KD, register_objective
    from rollout.engine import register
    with pytest.raises(ValueError, match="not declared in opd/config/objective_settings.py"):
        register_objective("kd2")(KD)
    with pytest.raises(ValueError, match="not declared in rollout/options.py"):
        register("hbsjd2")
