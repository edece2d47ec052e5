"""A step's learner results: the metrics of its pieces and learner ranks, combined.

`combine_metrics` puts the metrics of a step's pieces (the reference learner, a learner rank)
or of its ranks together as the step's.  `LearnerResult` is one learner rank's result of a step
(actors/workers/learner.py): the objective's metrics over its rows plus what the driver's row
reads of the rank; `PieceAnswer` is a rank's answer to one piece handed to it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from opd.distill.onpolicy import KEYS as ONPOLICY_KEYS, combine_gaps


def combine_metrics(results: list[dict]) -> dict:
    """One step's metrics from the metrics of its pieces or learner ranks: loss and the
    objective's other float metrics weighted by each result's tokens (= the token mean over
    all of them), tokens summed, the first result's grad_norm (every rank reports the
    group's); the on-policy check's figures by `opd.distill.onpolicy.combine_gaps`."""
    if len(results) == 1:
        return dict(results[0])
    tokens = [r["tokens"] for r in results]
    total = sum(tokens)
    out = {}
    for key, value in results[0].items():
        if key in ONPOLICY_KEYS:
            continue
        if key == "tokens":
            out[key] = total
        elif key != "grad_norm" and isinstance(value, float):
            out[key] = (sum(r[key] * n for r, n in zip(results, tokens)) / total if total
                        else math.fsum(r[key] for r in results) / len(results))
        else:
            out[key] = value
    return {**out, **combine_gaps(results)}


@dataclass
class LearnerResult:
    """One learner rank's result of a step.

    metrics: the objective's metrics over this rank's rows (`combine_metrics` of its pieces:
        loss, tokens, the objective's own, the on-policy check `opd.distill.onpolicy.KEYS`).
    grad_norm: the global pre-clip gradient norm (every rank reports the group's).
    busy_s: seconds of its forward, backward and update; seconds: from its first piece handed
        to its update done.  rows, received_bytes: its rows and payload bytes of the step;
        queue_depth: the trajectory queue's depth when it took the step."""
    rank: int
    metrics: dict[str, float]
    grad_norm: float
    seconds: float = 0.0
    busy_s: float = 0.0
    rows: int = 0
    received_bytes: int = 0
    queue_depth: int = 0

    @staticmethod
    def step_metrics(results: list[LearnerResult]) -> dict[str, float]:
        """The step's metrics from its ranks' results (rank order): the token mean of the
        objective's metrics, tokens summed, the group's grad_norm, and `busy_s` (the ranks'
        busy seconds by the same token weights; metrics.parquet keeps this column)."""
        return combine_metrics([{**r.metrics, "grad_norm": r.grad_norm, "busy_s": r.busy_s}
                                for r in results])


@dataclass
class PieceAnswer:
    """A learner rank's answer to one piece handed to it: `result` after the step's last piece;
    `skipped` when handed out of order (after a lost piece; it is handed again), `lost` when
    the piece could not be fetched (its owner died; the driver makes it again)."""
    rank: int
    piece: int
    result: LearnerResult | None = None
    skipped: bool = False
    lost: bool = False
    lost_at: tuple[int, ...] = ()        # with `lost`: the positions, in teacher order, of
    #                                      the piece's shares that were lost
