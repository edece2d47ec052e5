"""Batch-Synchronous SJD (the original SJD batched naively): one shared window position for the
whole batch, which advances by the minimum number of tokens any image can commit.  Drafts
follow SJD's own initialisation (H = 1: copy the left neighbour) unless H is given.

Greedy and "sample" output equals Cached AR's (a draft accepted past the batch minimum is
proposed again, the same token).  With decoding="speculative" every image's tokens follow the
model's distribution, but they depend on the batch (the batch minimum decides which accepted
drafts are kept), unlike the independent engines."""
from __future__ import annotations

from rollout.engine import register
from rollout.hbsjd import JacobiEngine


@register("sjd_sync")
class SyncSJD(JacobiEngine):
    SYNC = True
    DEFAULT_H_IS_ONE = True
