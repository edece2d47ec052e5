"""Delivering a step part to the learner ranks that train on it.

A part is one rollout call of a step, a run of its pieces (opd/distill/pieces.py: a piece holds the
p-th sub-range of every learner rank's shard); learner rank r trains on rows
`shard_rows(B, R)[r]`, so each rank's rows of a piece are one contiguous range of it
(`PartTag.cuts`).  A part is delivered piece by piece: by the teacher that scores each piece, or
by the worker that generated it when it needs no scores.  The worker that made the part (a rollout worker, or a teacher worker
after scoring it) cuts it into one piece per rank — the part's rows that rank trains on — puts
each piece into the object store itself (it owns them) and hands the refs to the trajectory
queue.  The driver gets a `PartReport` (counts and rollout statistics, no payload); each rank
fetches only its own pieces.  If the worker dies before the learner fetched them, the pieces are
lost with it; the learner ranks then report the step lost and the driver makes its parts again.
"""
from __future__ import annotations

from dataclasses import dataclass

import ray

from actors.transport.iostats import payload_nbytes
from opd.distill.pieces import take_rows
from opd.distill.batch import TrajectoryBatch
from opd.distill.rollout_stats import RolloutStats


@dataclass
class PartReport:
    """What a worker tells the driver about a part it delivered (no payload)."""
    rows: int
    generated_tokens: int
    stats: RolloutStats               # the part's rollout statistics (opd/distill/rollout_stats.py)
    nbytes: int                       # bytes of the pieces it put into the queue
    seconds: float = 0.0              # the worker's busy time
    payload: object = None            # ref of the whole part, owned by the worker (to score)


@dataclass(frozen=True)
class PartTag:
    """Where a part goes: its step, plan generation, part index, and for each learner rank the
    part's local rows [a, b) that rank trains on (a == b: none)."""
    step: int
    gen: int
    part: int
    cuts: tuple[tuple[int, int], ...]
    version: int = -1             # the policy version of the part's trajectories
    rows: tuple[int, int] | None = None   # the piece's [a, b) rows in the generated part


def report(batch: TrajectoryBatch, nbytes: int, seconds: float, payload=None) -> PartReport:
    return PartReport(batch.batch_size, batch.num_generated_tokens, batch.rollout_stats.copy(),
                      nbytes, seconds, payload)


def put_payload(batch: TrajectoryBatch, seconds: float) -> PartReport:
    """A generated part that a teacher worker scores next: one object owned by this worker."""
    payload = batch.to_numpy_dict()
    return report(batch, payload_nbytes(payload), seconds, ray.put(payload))


def deliver(batch: TrajectoryBatch, tag: PartTag, queue, seconds: float) -> PartReport:
    """Cut `batch` (one part) into its learner ranks' pieces, put them and hand them to `queue`."""
    pieces, nbytes = [], 0
    for a, b in tag.cuts:
        if a == b:
            pieces.append(None)
            continue
        piece = take_rows(batch, a, b)
        piece.rollout_stats = RolloutStats()     # the driver has them from the report
        payload = piece.to_numpy_dict()
        nbytes += payload_nbytes(payload)
        pieces.append(ray.put(payload))
    ray.get(queue.put_part.remote(tag.step, tag.gen, tag.part, pieces, tag.version))
    return report(batch, nbytes, seconds)


def hand_over(batch: TrajectoryBatch, tags: list[PartTag] | None, queue, seconds: float,
              io) -> PartReport:
    """A generated part: delivered into `queue` piece by piece (`tags`: one per piece, each with
    its rows in the part) as the learner ranks' rows, or, without tags, put whole for a teacher
    to score; its bytes counted as sent by `io` (IOCounter).  The report is the part's."""
    if tags is None:
        made = put_payload(batch, seconds)
    else:
        sent = [deliver(take_rows(batch, *t.rows) if t.rows else batch, t, queue, 0.0)
                for t in tags]
        made = report(batch, sum(r.nbytes for r in sent), seconds)
    io.put(made.nbytes)
    return made
