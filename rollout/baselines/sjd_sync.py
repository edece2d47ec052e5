"""Batch-Synchronous SJD (the original SJD batched naively): one shared window position for the
whole batch, which advances by the minimum number of tokens any image can commit.  Drafts
follow SJD's own initialisation (H = 1: copy the left neighbour) unless H is given.

Greedy and "sample" output equals Cached AR's (a draft accepted past the batch minimum is
proposed again, the same token).  With decoding="speculative" every image's tokens follow the
model's distribution, but they depend on the batch (the batch minimum decides which accepted
drafts are kept; those not committed are drawn again from p), unlike the independent engines.

The round is the independent engines' (rollout/hbsjd.py) with its own verification step
(`sync_update`, the call's `Plan.update`).
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from rollout.engine import Request, register
from rollout.hbsjd import JacobiEngine
from rollout.jacobi import JacobiState, Plan, commit, commit_count, verify
from rollout.sampling import inverse_cdf


def batch_minimum(m: Tensor) -> Tensor:
    """m: (B, 1, 1) tokens each row could commit -> the least of the live rows' (m > 0) for
    every live row, 0 for a finished one."""
    live = m > 0
    return torch.where(live, m, torch.iinfo(m.dtype).max).amin() * live


def sync_update(st: JacobiState, guided: Tensor, positions: Tensor, offset: Tensor,
                req: Request, plan: Plan) -> tuple[Tensor, None]:
    """`jacobi.jacobi_update` with the batch minimum: every live row commits as many tokens as
    the row that commits fewest; a row past it commits accepted drafts only (its counts: no
    rejection, at most m accepted).  -> counts (3, B) int64, None (no candidate drafting)."""
    v = verify(st, guided, positions, offset, req, plan)
    m = batch_minimum(commit_count(v.a, v.w.off, plan.W))             # (B, 1, 1)
    if req.speculative:     # accepted past the batch minimum: drafts again, from p
        again = (plan.col >= v.w.off + m) & (plan.col <= v.a)
        v = v._replace(tokens=torch.where(again, inverse_cdf(v.p, v.u[3]), v.tokens))
    accepted, rejected = commit(st, v, m, req, plan)
    accepted, rejected = torch.minimum(accepted, m), rejected & (accepted < m)
    return torch.stack([m, accepted, rejected.long()]).view(3, -1), None


@register("sjd_sync")
class SyncSJD(JacobiEngine):
    """Batch-Synchronous SJD: H defaults to 1, the round verifies with `sync_update`."""

    def history(self, model) -> int:
        H = self.options["history_offset"]
        return 1 if H is None else H

    def plan(self, model, req: Request, W: int | None = None,
             scratch_len: int | None = None) -> Plan:
        return replace(super().plan(model, req, W, scratch_len), update=sync_update)
