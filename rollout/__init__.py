"""Rollout engines for class-conditional AR image models (pure torch).

    from rollout import make_engine
    engine = make_engine("hbsjd", W=16, decoding="greedy", execution="hybrid", gamma="auto")
    result = engine.generate(model, labels, prefix, num_new_tokens, cfg_scale=2.0, seed=0)
    result.tokens          # (B, P + N) int64

Engines (ENGINES): cached_ar, sjd_sync, sjd_independent, hbsjd.  The model protocol is in
rollout/protocol.py.
"""
from rollout import cached_ar, hbsjd, sjd_sync  # noqa: F401  (register the engines)
from rollout.engine import DECODINGS, ENGINES, EXECUTIONS, Engine, make_engine
from rollout.protocol import RolloutModel
from rollout.stats import RolloutResult

__all__ = ["DECODINGS", "ENGINES", "EXECUTIONS", "Engine", "RolloutModel", "RolloutResult",
           "make_engine"]
