"""A step's pieces: how one prefix batch is cut so its stages stream, and put back together.

An on-policy step flows through its roles in P pieces (docs/STREAMING.md): piece p is generated
by a rollout worker, scored by a teacher worker and trained on by every learner rank while the
next piece is still being generated.  The learner accumulates gradients over the pieces in piece
order (0, 1, ..., P-1, never arrival order) and steps the optimizer once, so a step's update is
the whole batch's up to float summation order, and the reference loop, which accumulates the
same pieces in the same order, computes the same losses (invariant 5).

Rows.  Learner rank r of R trains on the contiguous rows `shard_rows(B, R)[r]`.  Piece p holds,
for every rank, the p-th of P contiguous sub-ranges of that rank's shard (in rank order), so
every rank has rows in every piece: each rank runs one forward and backward per piece, which
ZeRO 2-3 need (they reduce gradients at every backward).  With R = 1 the pieces are P
contiguous row ranges.  A piece's rollout job keeps its rows' image ids, so its tokens are the
whole batch's rows (the engines key random numbers by (seed, image id, position)).

Rollout calls.  A step is generated in C rollout calls ("parts", `step_parts`: one per
worker), each a contiguous run of pieces; the teacher scores and the learner trains piece by
piece.  On a CPU a rollout round's fixed cost dominates a small model's, so cutting the rollout
itself into pieces would multiply its rounds (docs/STREAMING.md).

How many.  `distill.pieces` P, or with 0 (auto) `auto_pieces`: pieces of about `PIECE_ROWS`
rows per learner rank, at least one per worker of the larger pool (rollout or teacher) so
every worker has work, at most one row per rank each.  Both run modes take the count from the
config alone, so they cut a step identically.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from opd.distill.batch import TrajectoryBatch
from opd.config.schema import RunConfig
from opd.distill.rollout_stats import RolloutStats

PIECE_ROWS = 8
"""Rows per learner rank in an auto-sized piece.  Per piece a step pays a fixed cost in every
stage (a Ray call, an object-store put, a model call); on the digits default (32 rows) 4 pieces
of 8 measured fastest (docs/STREAMING.md, `opd bench step --pieces`)."""


def row_ranges(batch: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous [start, stop) ranges covering 0..batch, sizes differing by at most one
    (first ranges larger); empty ranges are dropped."""
    parts = max(1, min(parts, batch))
    base, extra = divmod(batch, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (i < extra)
        out.append((start, stop))
        start = stop
    return out


def shard_rows(batch: int, world_size: int) -> list[tuple[int, int]]:
    """Learner shards: rank r takes rows [start, stop) of the global batch (equal sizes needed:
    the pipeline checks data.batch_size % learner.world_size == 0)."""
    if batch % world_size:
        raise ValueError(f"a batch of {batch} rows does not split evenly over {world_size} learner ranks")
    n = batch // world_size
    return [(r * n, (r + 1) * n) for r in range(world_size)]


def worker_count(n) -> int:
    """The most workers of a pool setting (an int, or (min, max) for an elastic pool)."""
    return n[1] if isinstance(n, tuple) else int(n)


def auto_pieces(batch: int, world_size: int, workers: int) -> int:
    """Pieces of a step of `batch` rows over `world_size` learner ranks when distill.pieces is 0:
    about PIECE_ROWS rows per rank each, at least `workers`, at most one row per rank each."""
    per_rank = batch // world_size
    return max(1, min(per_rank, max(workers, round(per_rank / PIECE_ROWS))))


def step_pieces(cfg: RunConfig) -> int:
    """P, the pieces every step of run `cfg` is cut into (both run modes)."""
    B, R = cfg.data.batch_size, cfg.learner.world_size
    if cfg.distill.pieces:
        return cfg.distill.pieces
    workers = max(worker_count(cfg.rollout.num_workers), cfg.teacher.num_workers)
    return auto_pieces(B, R, workers)              # the same in both run modes


def step_parts(cfg: RunConfig) -> int:
    """C, the rollout calls ("parts") a step's batch is generated in: one per worker of the
    larger pool (rollout, or teacher for teacher rollouts), at most one per piece.  A rollout
    call of many rows costs about as much as one of few on a CPU, where a round's fixed cost
    dominates, so the rollout is not cut further: only scoring and learning go piece by piece."""
    workers = max(worker_count(cfg.rollout.num_workers), cfg.teacher.num_workers)
    return max(1, min(workers, step_pieces(cfg)))


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a step of a run is cut: `rows[p]` the batch rows of piece p (opd/distill/pieces.py docstring),
    `parts[c]` the pieces rollout call c generates (contiguous, in order), and for each piece
    its part and its [a, b) rows within that part's rows."""
    rows: list[Tensor]
    parts: list[list[int]]

    @property
    def part_of(self) -> list[int]:
        return [c for c, ps in enumerate(self.parts) for _ in ps]

    def part_rows(self, c: int) -> Tensor:
        return torch.cat([self.rows[p] for p in self.parts[c]])

    @property
    def call_rows(self) -> list[Tensor]:
        """(rows,) int64 batch rows of each rollout call (part), in order."""
        return [self.part_rows(c) for c in range(len(self.parts))]

    def within_part(self, p: int) -> tuple[int, int]:
        c = self.part_of[p]
        a = sum(len(self.rows[q]) for q in self.parts[c] if q < p)
        return a, a + len(self.rows[p])


def step_layout(cfg: RunConfig, source: str = "student") -> Layout:
    """The layout of a step of run `cfg` whose sequences come from `source` (the same in both
    run modes).  A step on data is one piece: it depends on no policy, so its scoring runs ahead
    of the learner anyway and pieces would only add per-piece costs."""
    P = 1 if source == "data" else step_pieces(cfg)
    rows = piece_rows(cfg.data.batch_size, cfg.learner.world_size, P)
    C = 1 if source == "data" else step_parts(cfg)
    return Layout(rows, [list(range(a, b)) for a, b in row_ranges(P, C)])


def piece_rows(batch: int, world_size: int, pieces: int) -> list[Tensor]:
    """(rows,) int64 batch rows of each piece: the p-th sub-range of every rank's shard, in rank
    order."""
    shards = shard_rows(batch, world_size)
    per_rank = batch // world_size
    if pieces > per_rank:
        raise ValueError(f"{pieces} pieces of a batch of {batch} rows over {world_size} learner "
                         f"ranks leave a rank without rows (at most {per_rank})")
    subs = row_ranges(per_rank, pieces)
    return [torch.cat([torch.arange(s + a, s + b) for s, _ in shards]) for a, b in subs]


def piece_cuts(rows: Tensor, shards: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """For each rank, the [a, b) positions within a piece of `rows` that fall in its shard
    (contiguous by construction of `piece_rows`; a == b: none)."""
    out = []
    for s, e in shards:
        idx = ((rows >= s) & (rows < e)).nonzero().flatten()
        out.append((int(idx[0]), int(idx[-1]) + 1) if len(idx) else (0, 0))
    return tuple(out)


def split_job(job, rows: list[Tensor]) -> list:
    """The job (an `opd.distill.steps.RolloutJob`) as one sub-job per entry of `rows` (batch row
    indices), each keeping its rows' image ids."""
    B = job.labels.shape[0]
    ids = job.image_ids if job.image_ids is not None else torch.arange(B)
    return [dataclasses.replace(job, labels=job.labels[r], tokens=job.tokens[r], image_ids=ids[r])
            for r in rows]


def merge_batches(parts: list[TrajectoryBatch]) -> TrajectoryBatch:
    """Concatenate pieces of one prefix batch (in order) into one batch."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    for p in parts[1:]:
        if (p.batch_id, p.prefix_len, p.policy_version, p.source, p.teacher_transport) != (
                first.batch_id, first.prefix_len, first.policy_version, first.source,
                first.teacher_transport):
            raise ValueError(f"sub-batches do not belong together: batch {p.batch_id} v{p.policy_version} "
                             f"{p.source} vs batch {first.batch_id} v{first.policy_version} {first.source}")

    def cat(name: str):
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else torch.cat(values)

    return TrajectoryBatch(first.batch_id, cat("labels"), first.prefix_len, cat("tokens"),
                           first.policy_version, first.source,
                           RolloutStats.merge([p.rollout_stats for p in parts]),
                           cat("teacher_logprobs"), cat("teacher_topk_values"),
                           cat("teacher_topk_indices"), cat("behaviour_logprobs"))


def take_rows(batch: TrajectoryBatch, start: int, stop: int) -> TrajectoryBatch:
    """Rows [start, stop) of a batch (tensors are views)."""
    def rows(t):
        return None if t is None else t[start:stop]
    return TrajectoryBatch(batch.batch_id, rows(batch.labels), batch.prefix_len, rows(batch.tokens),
                           batch.policy_version, batch.source, batch.rollout_stats.copy(),
                           rows(batch.teacher_logprobs), rows(batch.teacher_topk_values),
                           rows(batch.teacher_topk_indices), rows(batch.behaviour_logprobs))
