"""A rollout call ("part") streamed as its pieces: each piece as soon as its rows are complete.

    stream = PartStream(model, engine, job, cfg, policy_version, layout.part_sizes(c))
    for piece in stream:          # Piece(index, rows, batch), in piece order
        ...                       # score it, hand it on: the call's other rows go on decoding
    stream.stats                  # the call's RolloutStats, once it is exhausted

The rule (opd/distill/pieces.py, docs/STREAMING.md): the engine hands out images as they
complete (`rollout.engine.Engine.stream`: one group per round, in row order); the part's
completed rows queue up in that order, and piece k takes the next `sizes[k]` of them as soon as
that many are there, and holds them in row order.  Both run modes iterate this class, so they cut the same pieces.  A "data"
job runs no model: its pieces are its rows in order.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from opd.config.schema import RunConfig
from opd.distill.batch import TrajectoryBatch
from opd.distill.pieces import take_rows
from opd.distill.rollout_stats import RolloutStats
from opd.distill.steps import RolloutJob, engine_call, generate, rollout_stats, trajectory


@dataclass
class Piece:
    """Piece `index` of a part (0-based within the part): the part's `rows` it holds, (n,)
    int64 row indices of the job, ascending, and their trajectory (its
    rollout_stats empty: the call's are `PartStream.stats`)."""
    index: int
    rows: Tensor
    batch: TrajectoryBatch


class PartStream:
    """`job`'s rollout by `model` (the student, or the teacher for SeqKD) at `policy_version`,
    cut into pieces of `sizes` rows (summing to the job's rows) as they complete."""

    def __init__(self, model, engine, job: RolloutJob, cfg: RunConfig, policy_version: int,
                 sizes: list[int]):
        if sum(sizes) != int(job.labels.shape[0]):
            raise ValueError(f"pieces of {sizes} rows do not cut a rollout call of "
                             f"{int(job.labels.shape[0])} rows")
        self.model, self.engine, self.job, self.cfg = model, engine, job, cfg
        self.version, self.sizes = policy_version, list(sizes)
        self.stats: RolloutStats | None = None

    def __iter__(self) -> Iterator[Piece]:
        job = self.job
        if job.source == "data":
            whole, start = generate(None, None, job, self.cfg, self.version), 0
            for k, n in enumerate(self.sizes):
                yield Piece(k, torch.arange(start, start + n), take_rows(whole, start, start + n))
                start += n
            self.stats = whole.rollout_stats
            return
        args, kwargs = engine_call(self.model, job, self.cfg)
        stream = self.engine.stream(*args, **kwargs)
        queued = None                    # (rows, tokens, logprobs) completed, not in a piece yet
        k = 0
        for done in stream:
            group = (done.images.cpu(), done.tokens, done.logprobs)
            queued = group if queued is None else tuple(torch.cat(x) for x in zip(queued, group))
            while k < len(self.sizes) and queued[0].shape[0] >= self.sizes[k]:
                n = self.sizes[k]
                order = queued[0][:n].argsort()              # a piece's rows in row order
                yield self._piece(k, *(x[:n][order] for x in queued))
                queued = tuple(x[n:] for x in queued)
                k += 1
        self.stats = rollout_stats(stream.result, job, self.cfg)

    def _piece(self, k: int, rows: Tensor, tokens: Tensor, logprobs: Tensor) -> Piece:
        return Piece(k, rows, trajectory(self.job, rows, tokens, logprobs, self.version,
                                         RolloutStats()))

