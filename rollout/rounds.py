"""One HB-SJD round: Full or Compact execution of a verifier forward over every row's window,
then the verification that advances each image (rollout/hbsjd.py `run_jacobi` runs them).
An image's first round is the prefill's forward with its first window (`prefill_round`).

    Full      all physical rows (rows=None), finished images logically inactive
    Compact   only the active images' rows (rows = index tensor; CFG: idx and idx + B)

With option compile a round -- verifier forward and verification -- is one compiled function
(`full_round_in_place`, `compact_round`) with static shapes: a Compact round runs a bucket of
rows, the active count rounded up to a power of two between R / 8 and R (`bucket`), padded
with finished rows, whose round changes nothing they keep (`compact_round`); so a call
compiles a handful of graphs (R = 32: Full, then Compact at 4, 8, 16 and 32 rows), not one
per active count.
"""
from __future__ import annotations

import torch
from torch import Tensor

from rollout.engine import Request
from rollout.jacobi import JacobiState, Plan, ar_commit, ar_round, window_inputs
from rollout.prefill import prefill_forward
from rollout.sampling import guide


def compact_rows(live: Tensor, active: int, rows: int, compiled: bool) -> Tensor:
    """The rows (k,) int64 of a Compact round: the active ones of live (R,) bool, padded to
    their bucket when compiled (`bucket_rows`)."""
    return bucket_rows(live, bucket(active, rows)) if compiled else live.nonzero().squeeze(1)


def full_round(model, st: JacobiState, req: Request, plan: Plan) -> Tensor:
    """A Full-execution round: the windows of every physical row (finished rows included)
    verified and advanced in place -> counts (3, R) int64 (`verify_window`; W = 1:
    `ar_round`)."""
    if plan.W == 1:
        return ar_round(model, st, req, plan, None)
    logits, positions, offset = forward_window(model, st, req, plan, None)
    return verify_window(model, st, logits, positions, offset, req, plan, None)


def full_round_in_place(model, st: JacobiState, req: Request, plan: Plan) -> Tensor:
    """`full_round` that leaves every state tensor in its storage (the next proposals q are
    copied into the old ones): what the compiled round runs."""
    q = st.q
    counts = full_round(model, st, req, plan)
    if q is not None:
        st.q = q.copy_(st.q)
    return counts


def compact_round(model, st: JacobiState, idx: Tensor, req: Request, plan: Plan) -> Tensor:
    """A Compact round over rows idx (k,) (cache rows idx, and idx + R with CFG), in place
    -> counts (3, k) int64.  A finished row in idx (bucket padding) changes only scratch past
    T and its unused round counter and proposals, and counts 0 (jacobi.commit_count)."""
    sub = st.select(idx)
    rows = torch.cat([idx, idx + req.rows]) if req.cfg else idx
    if plan.W == 1:
        counts = ar_round(model, sub, req, plan, rows)
    else:
        logits, positions, offset = forward_window(model, sub, req, plan, rows)
        counts = verify_window(model, sub, logits, positions, offset, req, plan, rows)
    st.assign(idx, sub)
    return counts


def bucket(active: int, rows: int) -> int:
    """Rows of a compiled Compact round: `active` rounded up to a power of two, at least
    R // 8 (a few padded rows cost less than a graph per small count), at most R."""
    return min(rows, max(1 << (active - 1).bit_length(), rows // 8))


def bucket_rows(live: Tensor, size: int) -> Tensor:
    """live: (R,) bool -> (size,) int64 the active rows in ascending order, then finished rows
    (`compact_round`'s padding); size >= the active count."""
    return torch.sort((~live).to(torch.uint8), stable=True).indices[:size]


def prefill_round(model, st: JacobiState, images: Tensor, req: Request, plan: Plan,
                  rows: Tensor | None) -> Tensor:
    """The first round of images `images` (k,), `st` their fresh states (`init_state`: cur =
    P), in place: one forward prefills the class token and the prefix into cache rows `rows`
    (None: 0..k-1; their CFG copies R rows later) and runs the first window, [token P - 1
    (the class token without a prefix), drafts P .. P + W - 2], whose columns predict tokens
    P .. P + W - 1, verified as every round's (`verify_window`): token P and the drafts it
    accepts are committed.  -> counts (3, k) int64.  A round of W = 1 is the plain prefill."""
    P, k, W = req.prefix_len, images.shape[0], plan.W
    tokens = torch.cat([req.prefix[images], st.seq[:, P:P + W - 1]], 1)       # (k, P + W - 1)
    logits, rows = prefill_forward(model, req, images, tokens, rows)
    logits = logits[:, P:]                                           # (k or 2k, W, V)
    if W == 1:                                                       # as `ar_round` commits
        return ar_commit(st, logits[:, 0], st.cur < plan.T, st.cur, req, plan)
    positions = P + plan.ar.expand(k, W)
    return verify_window(model, st, logits, positions, torch.zeros_like(st.cur), req, plan,
                         rows)


def forward_window(model, st: JacobiState, req: Request, plan: Plan,
                   rows: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """The round's verifier forward over the windows of `st`'s rows (cache rows `rows`, None =
    Full execution).  -> logits (2B or B, W, V), positions (B, W) and offset (B,) from
    `window_inputs`; C columns for W with candidate drafting (`plan.drafting.forward`)."""
    tokens, positions, offset = window_inputs(st, plan)
    logits, positions = plan.drafting.forward(model, st, tokens, positions, offset, req, rows,
                                              plan)
    return logits, positions, offset


def verify_window(model, st: JacobiState, logits: Tensor, positions: Tensor, offset: Tensor,
                  req: Request, plan: Plan, rows: Tensor | None) -> Tensor:
    """The round's verification step: guide the logits, verify every window and advance `st`
    in place (`plan.update`: rollout/jacobi.py `jacobi_update`, or a baseline's); a tree
    window's winning branch (the branch the update returns only then) then moves into place
    (`plan.drafting.move`).  -> counts (3, B) int64: committed, accepted, rejected."""
    counts, taken = plan.update(st, guide(logits, req.cfg_scale), positions, offset, req, plan)
    plan.drafting.move(model, positions, offset, taken, req, rows)
    return counts
