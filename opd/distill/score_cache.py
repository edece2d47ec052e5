"""The teacher's scores of data images, computed once per image and reused in later epochs
(`distill.cache_data_scores`, reference mode).

A data step trains on dataset images, and the teacher is frozen: the target of an image (its
teachers' merged scores, opd/distill/teachers.py) is the same in every epoch, so only the first
time a run meets an image needs the teacher's forward.  The cache holds, per image, its target
at every position (prefix 0, S = L rows) and cuts the suffix a step's prefix length asks for, so
an image seen at prefix ratios 0 and 0.5 is still forwarded once.

    cache = DataScoreCache()
    batch, shares = cache.score(dataset_rows, batch, lambda b: score_piece(models, cfg, teachers, b, score))

Key: the image's row in the train split.  Everything else the target depends on is fixed for a
run (its teachers, their transport and guidance, rollout.cfg_scale), and the cache lives as long
as the run's process, so the row is the whole key.  Exact: a step's batch equals the uncached
one bit for bit as long as the teacher's forward of a row does not depend on the other rows of
its batch (true of the CPU kernels; GPU kernels chosen by batch size may change the last bits).

Bytes (the run's transport; float32 values as the learner receives them):

    full   L · V · 4 per image          digits 8x8: 64 · 17 · 4 = 4,352 B; 1,597 train
                                        images: 6.95 MB.  16x16: 256 · 17 · 4 = 17,408 B
    top-k  L · k · (4 + index bytes)    (int16 indices up to 32,768 ids)

At LlamaGen's shapes (vocabulary 16,384, ImageNet's 1,281,167 training images), even in fp16:

    full fp16    256 tokens: 256 · 16,384 · 2 = 8 MiB an image, 9.8 TiB in all
                 576 tokens: 576 · 16,384 · 2 = 18 MiB an image, 22 TiB in all
    top-256      (teacher.topk of configs/llamagen_*.yaml) fp16 values + int16 ids:
                 256 · 256 · 4 = 256 KiB an image, 313 GiB in all;
                 576 tokens: 576 KiB an image, 704 GiB in all

so at that scale only top-k scores fit, and on disk (written once, read back per epoch) rather
than in a process's memory; this in-memory cache is for the digits testbed.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from opd.distill.batch import TrajectoryBatch
from opd.distill.teachers import take_index

FIELDS = ("teacher_logprobs", "teacher_topk_values", "teacher_topk_indices")
"""The per-position teacher tensors of a scored batch, (B, S, ·) each when present."""


class DataScoreCache:
    """Teacher targets of data images, by train-split row (module docstring)."""

    def __init__(self) -> None:
        self.entries: dict[int, tuple[Tensor | None, ...]] = {}   # row -> FIELDS, (L, ·) each
        self.nbytes = 0                                           # of the cached tensors

    def __len__(self) -> int:
        return len(self.entries)

    def score(self, rows: np.ndarray, batch: TrajectoryBatch,
              score_rows: Callable[[TrajectoryBatch], tuple[TrajectoryBatch, list]]
              ) -> tuple[TrajectoryBatch, list]:
        """`batch` (a data piece; `rows` (B,) its images' train-split rows) with its teachers'
        targets: the cached ones, and for the rows not cached yet `score_rows` (the uncached
        scoring, e.g. `opd.distill.teachers.score_piece`) run on those rows alone at prefix 0,
        then cached.  Returns (the scored batch, the shares `score_rows` made: [] when every row
        was cached)."""
        keys = [int(r) for r in rows]
        missing = [i for i, k in enumerate(keys) if k not in self.entries]
        shares: list = []
        if missing:
            part = batch if len(missing) == len(keys) else take_index(batch, torch.tensor(missing))
            scored, shares = score_rows(dataclasses.replace(part, prefix_len=0))
            for j, i in enumerate(missing):
                entry = tuple(None if t is None else t[j].clone()
                              for t in (getattr(scored, f) for f in FIELDS))
                self.entries[keys[i]] = entry
                self.nbytes += sum(t.numel() * t.element_size() for t in entry if t is not None)
        P = batch.prefix_len
        cut = [None if self.entries[keys[0]][f] is None else
               torch.stack([self.entries[k][f][P:] for k in keys]) for f in range(len(FIELDS))]
        return batch.with_teacher(*cut), shares


__all__ = ["DataScoreCache"]
