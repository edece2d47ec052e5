"""Rollout engines for class-conditional AR image models (pure torch).

    from rollout import make_engine
    engine = make_engine("hbsjd", window=16, decoding="greedy", execution="hybrid", gamma="auto")
    result = engine.generate(model, labels, prefix, num_new_tokens, cfg_scale=2.0, seed=0)
    result.tokens          # (B, P + N) int64

Engines (ENGINES): cached_ar, sjd_sync, sjd_independent, hbsjd; their options and modules are
declared in rollout/options.py, which imports no torch.  `make_engine` imports an engine's
module the first time it is asked for (rollout/engine.py `engine_class`); the names below are
loaded on first use, so `import rollout.options` alone stays torch-free for the run config.
The model protocol is in rollout/protocol.py.
"""
from __future__ import annotations

import importlib

_EXPORTS = {"ENGINES": "rollout.engine", "Engine": "rollout.engine",
            "make_engine": "rollout.engine", "DECODINGS": "rollout.options",
            "EXECUTIONS": "rollout.options", "RolloutModel": "rollout.protocol",
            "RolloutResult": "rollout.stats"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rollout' has no attribute {name!r}")
    if name == "ENGINES":                               # the registry, every engine in it
        from rollout.engine import load_engines
        return load_engines()
    return getattr(importlib.import_module(_EXPORTS[name]), name)
