"""One call fanned out to a group of actors (every learner rank, every rollout worker, ...).

    refs = fan_out(groups.learners, "get_weights", version)      # one ref per actor
    infos = call_all(groups.rollout, "info")                          # their answers, in order

Every rank of the learner group must take part in some calls (ZeRO-3 gathers collectively:
`get_weights`, `publish_weights`, `send_weights`, `save_checkpoint`), so those always go to the
whole group through here.
"""
from __future__ import annotations

from typing import Any

import ray


def fan_out(actors: list, method: str, *args: Any, **kwargs: Any) -> list:
    """`actor.method.remote(*args, **kwargs)` on every actor; the refs in actor order (a
    method with num_returns=2 gives a pair of refs per actor)."""
    return [getattr(a, method).remote(*args, **kwargs) for a in actors]


def call_all(actors: list, method: str, *args: Any, **kwargs: Any) -> list:
    """`fan_out` and wait: every actor's answer, in actor order."""
    return ray.get(fan_out(actors, method, *args, **kwargs))
