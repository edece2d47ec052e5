"""A rollout call ("part") streamed as its pieces: each piece as soon as its rows are complete.

    stream = PartStream(model, engine, job, cfg, policy_version, layout.part_sizes(c))
    for piece in stream:          # Piece(index, rows, batch), each as soon as its rows are done
        ...                       # score it, hand it on: the call's other rows go on decoding
    stream.stats                  # the call's RolloutStats, once it is exhausted

The rule (opd/distill/pieces.py, docs/STREAMING.md): piece k of a part holds the part's k-th
contiguous run of `sizes[k]` rows, fixed by the config alone, and is handed out as soon as the
engine has completed every one of its rows (`rollout.engine.Engine.stream` hands out images
after each round); pieces completing in the same round come in piece order.  Which rows a piece
holds never depends on the engine, its window or the machine, so a step's gradient is summed in
the same order whatever decoded it: HB-SJD and Cached AR train bit-identical runs, and both run
modes cut the same pieces.  A "data" job runs no model: its pieces come in order.

With `span` S > 0 the stream also hands out the call's spans (rollout/spans.py `Span`, on the
CPU): every row's next S tokens as soon as every row has committed them, in position order,
each before the pieces of the same round; a teacher scores them as they come
(opd/distill/span_scoring.py), so only the last span is left when the call ends.

Every `rollout.compare_every`-th batch's call is run by Cached AR in place of the engine
(`steps.ar_timed`), for the summary's `rollout_vs_ar`: the same pieces and spans (their
log-probs to float32 rounding).
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
from opd.distill.steps import (RolloutJob, call_engine, engine_call, generate, rollout_stats,
                               trajectory)
from rollout.spans import Span


@dataclass
class Piece:
    """Piece `index` of a part (0-based within the part): the part's `rows` it holds, (n,)
    int64 row indices of the job (a contiguous run), and their trajectory (its rollout_stats
    empty: the call's are `PartStream.stats`)."""
    index: int
    rows: Tensor
    batch: TrajectoryBatch


class PartStream:
    """`job`'s rollout by `model` (the student, or the teacher for SeqKD) at `policy_version`,
    cut into pieces of `sizes` rows (contiguous runs summing to the job's rows), each handed out
    as soon as its rows are complete (and with `span`, each span as soon as it is committed)."""

    def __init__(self, model, engine, job: RolloutJob, cfg: RunConfig, policy_version: int,
                 sizes: list[int], span: int = 0):
        if sum(sizes) != int(job.labels.shape[0]):
            raise ValueError(f"pieces of {sizes} rows do not cut a rollout call of "
                             f"{int(job.labels.shape[0])} rows")
        self.model, self.engine, self.job, self.cfg = model, engine, job, cfg
        self.version, self.sizes, self.span = policy_version, list(sizes), span
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        self.rows = [torch.arange(a, a + n) for a, n in zip(starts, sizes)]
        self.stats: RolloutStats | None = None

    def __iter__(self) -> Iterator[Piece | Span]:
        job = self.job
        if job.source == "data":
            whole = generate(None, None, job, self.cfg, self.version)
            for k, rows in enumerate(self.rows):
                yield Piece(k, rows, take_rows(whole, int(rows[0]), int(rows[-1]) + 1))
            self.stats = whole.rollout_stats
            return
        args, kwargs = engine_call(self.model, job, self.cfg)
        stream = call_engine(self.engine, job, self.cfg).stream(*args, **kwargs, span=self.span)
        B, N = int(job.labels.shape[0]), int(job.tokens.shape[1]) - job.prefix_len
        tokens = logprobs = None                       # (B, T), (B, N): rows as they complete
        complete = torch.zeros(B, dtype=torch.bool)
        waiting = list(range(len(self.sizes)))         # pieces not handed out yet
        for done in stream:
            if isinstance(done, Span):
                yield Span(done.start, done.stop, done.tokens.cpu(), done.logprobs.cpu(),
                           done.midway)
                continue
            if tokens is None:
                tokens = done.tokens.new_empty(B, done.tokens.shape[1])
                logprobs = done.logprobs.new_empty(B, N)
            images = done.images.cpu()
            tokens[images], logprobs[images] = done.tokens, done.logprobs
            complete[images] = True
            for k in [k for k in waiting if bool(complete[self.rows[k]].all())]:
                waiting.remove(k)
                rows = self.rows[k]
                yield Piece(k, rows, trajectory(job, rows, tokens[rows], logprobs[rows],
                                                self.version, RolloutStats()))
        self.stats = rollout_stats(stream.result, job, self.cfg)
