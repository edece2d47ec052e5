"""Splitting a step's batch into row ranges and putting it back together.

Rollout sub-batches: a prefix batch of B rows is cut into contiguous row ranges, one rollout job
each, that keep their rows' image ids (the engines key random numbers by (seed, image id,
position)), so the concatenated sub-trajectories equal the trajectory of the whole batch.
Learner shards: data-parallel rank r of R takes the contiguous rows of `shard_rows(B, R)[r]`.
"""
from __future__ import annotations

import dataclasses

import torch

from opd.batch import TrajectoryBatch
from opd.steps import RolloutJob, row_ranges  # noqa: F401  (row_ranges re-exported)


def split_job(job: RolloutJob, parts: int) -> list[RolloutJob]:
    """The job as `parts` sub-jobs over contiguous rows, each keeping its rows' image ids."""
    B = job.labels.shape[0]
    ids = job.image_ids if job.image_ids is not None else torch.arange(B)
    return [dataclasses.replace(job, labels=job.labels[a:b], tokens=job.tokens[a:b],
                                image_ids=ids[a:b])
            for a, b in row_ranges(B, parts)]


def merge_stats(parts: list[dict]) -> dict:
    """Rollout stats of sub-batches generated side by side, as stats of the whole batch:
    counts and histograms add up, rounds, seconds and the longest stall are the slowest
    part's, mean committed tokens is re-weighted by image rounds."""
    if len(parts) == 1:
        return dict(parts[0])
    out: dict = {}
    for key in {k for p in parts for k in p}:
        values = [p[key] for p in parts if key in p]
        if key in ("generated_tokens", "accepted", "rejected", "image_rounds_sum", "images"):
            out[key] = sum(values)
        elif key in ("rounds", "ar_rounds", "rollout_seconds", "teacher_seconds", "image_rounds_max",
                     "longest_single_run"):
            out[key] = max(values)
        elif key in ("commit_hist", "window_hist"):
            out[key] = [sum(col) for col in zip(*values)]
        elif key == "image_rounds":
            out[key] = [r for v in values for r in v]
        elif key != "mean_committed":
            out[key] = values[0]
    gen = [p.get("generated_tokens", 0) for p in parts]
    mc = [p.get("mean_committed", 0.0) for p in parts]
    image_rounds = sum(g / m for g, m in zip(gen, mc) if m > 0)
    if image_rounds > 0:
        out["mean_committed"] = sum(gen) / image_rounds
    return out


def merge_batches(parts: list[TrajectoryBatch]) -> TrajectoryBatch:
    """Concatenate sub-batches of one prefix batch (in row order) into the whole batch."""
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
                           merge_stats([p.rollout_stats for p in parts]),
                           cat("teacher_logprobs"), cat("teacher_topk_values"),
                           cat("teacher_topk_indices"), cat("behaviour_logprobs"))


def shard_rows(batch: int, world_size: int) -> list[tuple[int, int]]:
    """Learner shards: rank r takes rows [start, stop) of the global batch (equal sizes needed:
    the pipeline checks data.batch_size % learner.world_size == 0)."""
    if batch % world_size:
        raise ValueError(f"a batch of {batch} rows does not split evenly over {world_size} learner ranks")
    n = batch // world_size
    return [(r * n, (r + 1) * n) for r in range(world_size)]


def take_rows(batch: TrajectoryBatch, start: int, stop: int) -> TrajectoryBatch:
    """Rows [start, stop) of a batch (tensors are views)."""
    def rows(t):
        return None if t is None else t[start:stop]
    return TrajectoryBatch(batch.batch_id, rows(batch.labels), batch.prefix_len, rows(batch.tokens),
                           batch.policy_version, batch.source, dict(batch.rollout_stats),
                           rows(batch.teacher_logprobs), rows(batch.teacher_topk_values),
                           rows(batch.teacher_topk_indices), rows(batch.behaviour_logprobs))
