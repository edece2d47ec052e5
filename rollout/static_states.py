"""`StaticStates`: the round-state buffers a compiled Jacobi engine keeps across calls
(rollout/hbsjd.py), so every replay of a round's graph sees the same addresses."""
from __future__ import annotations

from dataclasses import fields

import torch

from rollout.jacobi_state import JacobiState


class StaticStates:
    """Round-state buffers kept across calls, one set per shape: `hold(st)` copies a fresh
    state into them, so a compiled round sees the same addresses in every call (what CUDA
    graphs replay; marked static for torch.compile on CUDA)."""

    def __init__(self):
        self._held: dict[tuple, JacobiState] = {}

    def hold(self, st: JacobiState) -> JacobiState:
        values = [getattr(st, f.name) for f in fields(st)]
        key = tuple(None if t is None else (t.shape, t.dtype, t.device) for t in values)
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = JacobiState(*(None if t is None else t.clone()
                                                  for t in values))
            for f in fields(held):
                t = getattr(held, f.name)
                if t is not None and t.is_cuda:
                    torch._dynamo.mark_static_address(t)
        else:
            for f, t in zip(fields(held), values):
                if t is not None:
                    getattr(held, f.name).copy_(t)
        return held
