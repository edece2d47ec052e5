"""Engine options: every engine's name, the options it takes with their defaults, the values
each option allows, and the check of an option set.  Pure Python (no torch), so the run config
(opd/config/rollout.py) builds its `rollout.engine` and option choices from these tables.

    engine_options("sjd_sync")   # {"window": 16, "history_offset": None, ..., "compile": False}
    check_options("hbsjd", {"window": 8}, engine_options("hbsjd"))

An engine class registers under a name declared here (rollout/engine.py: `register`); the
options' meaning is documented on the engine classes (rollout/hbsjd.py, rollout/cached_ar.py).
Every option has one name, the run config's (`rollout.window` is option `window`).
"""
from __future__ import annotations

import difflib

DECODINGS = ("greedy", "sample", "speculative")
"""greedy: the argmax of the guided logits.  sample: the keyed Gumbel-max rule, one token per
(seed, image, position) whatever the engine, window or batch (rollout/sampling.py `perturb`;
Jacobi drafts are accepted when they equal it, like greedy drafts).  speculative: speculative
sampling with per-round random numbers (rollout/verify.py): distributed as the model's
samples, but which tokens a call commits depends on its windows."""
REFRESHES = ("coupled", "resample")
"""How decoding "speculative" refreshes the drafts after the commit point (rollout/verify.py)."""
EXECUTIONS = ("full", "compact", "hybrid")
COMPILE_BACKENDS = (False, True, "inductor", "aot_eager", "eager")

_JACOBI = dict(window=16, history_offset=None, decoding="greedy", refresh="coupled")

ENGINE_OPTIONS: dict[str, dict] = {
    "hbsjd": dict(_JACOBI, execution="hybrid", gamma=None, calibration=None,
                  calibrate_missing=False, candidates=0, branch=None),
    "cached_ar": dict(decoding="greedy"),
    "sjd_sync": dict(_JACOBI),
    "sjd_independent": dict(_JACOBI, candidates=0, branch=None),
}
"""Options of each engine by engine name, with their defaults (besides `compile`, which every
engine takes, default False).  The order is the one error messages list them in."""

ENGINE_MODULES: dict[str, str] = {"hbsjd": "rollout.hbsjd", "cached_ar": "rollout.cached_ar",
                                  "sjd_sync": "rollout.baselines.sjd_sync",
                                  "sjd_independent": "rollout.baselines.sjd_independent"}
"""The module that defines (and registers) each engine: rollout/engine.py `engine_class`
imports it the first time the engine is asked for."""


def check_engine_name(name: str) -> None:
    """ValueError naming the known engines (and the closest) when `name` is not one."""
    if name not in ENGINE_OPTIONS:
        close = difflib.get_close_matches(str(name), ENGINE_OPTIONS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown engine {name!r}{hint}; known engines: "
                         f"{', '.join(ENGINE_OPTIONS)}")


def engine_options(name: str) -> dict:
    """The options engine `name` takes, with their defaults: `make_engine`'s check, opd's
    `build_engine` and the run config's checks read this one declaration."""
    check_engine_name(name)
    return {**ENGINE_OPTIONS[name], "compile": False}


def engines_taking(option: str) -> list[str]:
    """The engines that take `option`, in ENGINE_OPTIONS' order."""
    return [name for name in ENGINE_OPTIONS if option in engine_options(name)]


def option_defaults() -> dict:
    """Every option any engine takes, with its default (the same in every engine that takes it)."""
    out: dict = {}
    for name in ENGINE_OPTIONS:
        out.update(engine_options(name))
    return out


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_options(engine: str, options: dict, allowed: dict) -> dict:
    """Merge `options` over the engine's defaults `allowed`; ValueError naming a bad option."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"engine {engine!r} has no option {unknown[0]!r}; "
                         f"its options are: {', '.join(allowed) or 'none'}")
    o = {**allowed, **options}
    auto = engine == "hbsjd" and o.get("window") == "auto"   # the window policy, rollout/window.py
    w = o.get("window")
    if "window" in o and not auto and not (_is_int(w) and w >= 1):
        also = " or 'auto' (HB-SJD: chosen per round)" if engine == "hbsjd" else ""
        raise ValueError(f"option window must be an int >= 1{also}, got {w!r}")
    h = o.get("history_offset")
    if "history_offset" in o and h is not None and not (_is_int(h) and h >= 1):
        raise ValueError(f"option history_offset must be None or an int >= 1, got {h!r}")
    if "decoding" in o and o["decoding"] not in DECODINGS:
        raise ValueError(f"option decoding must be one of {DECODINGS}, got {o['decoding']!r}")
    c = o.get("compile")
    if "compile" in o and not (isinstance(c, bool) or c in COMPILE_BACKENDS[2:]):
        raise ValueError(f"option compile must be one of {COMPILE_BACKENDS} (True = inductor), "
                         f"got {o['compile']!r}")
    if "refresh" in o and o["refresh"] not in REFRESHES:
        raise ValueError(f"option refresh must be one of {REFRESHES}, got {o['refresh']!r}")
    if "execution" in o and o["execution"] not in EXECUTIONS:
        raise ValueError(f"option execution must be one of {EXECUTIONS}, got {o['execution']!r}")
    k = o.get("candidates", 0)
    if "candidates" in o and not (_is_int(k) and k >= 0):
        raise ValueError(f"option candidates must be an int >= 0 (0 = off), got {k!r}")
    if k and o.get("compile"):
        raise ValueError("option candidates cannot be combined with compile (the compiled "
                         "verifier has no tree window); turn one of them off")
    br = o.get("branch")
    if "branch" in o and br is not None and not (_is_int(br) and br >= 1):
        raise ValueError(f"option branch must be None or an int >= 1, got {br!r}")
    g = o.get("gamma")
    if "gamma" in o and g is not None and g != "auto" and not (_is_int(g) and g >= 0):
        raise ValueError(f"option gamma must be an int >= 0, 'auto' or None, got {g!r}")
    return o
