"""Verification of every Jacobi window of a round at once (docs/FACTS.md §3), in window columns.

Column c of a row's window holds the prediction of token start + c and the token seq[start + c]
it checks (rollout/jacobi.py):

    done[:, c]      the token was committed before the round (c < offset: a clipped window)
    checked[:, c]   the token is a draft to check (c < W - 1, fewer on a tree path; `done`
                    columns are not checked again)
    pred / p[:, c]  the argmax / distribution of token start + c; column W - 1 predicts the
                    token after the last draft

Every per-row scalar is a (B, 1, 1) tensor and every per-column one (B, W, 1), so a round is a
few batched operations with no loop over rows or columns.  `a` is the first column that was
neither committed before nor accepted (W when every column was committed before: a finished
row); the round commits the accepted drafts before `a` and one more token at `a`.

Greedy: a draft is accepted while it equals the argmax; the argmax replaces the first mismatch.
Sampled (speculative sampling): draft x, drawn from q, is accepted with probability
min(1, p(x) / q(x)) (`keeps`); at the first rejection the replacement is drawn from
norm(max(0, p - q)) (`residual`), after a fully accepted window the bonus token from p.  The
columns after `a` become the next round's drafts, each distributed exactly as p: redrawn from p
(refresh "resample"), or (refresh "coupled", MC-SJD's maximal coupling) a stale draft x is kept
with probability min(1, p(x) / q(x)), else redrawn from norm(max(0, p - q)).  All draws are one
inverse-CDF sample per column.
"""
from __future__ import annotations

import torch
from torch import Tensor

from rollout.sampling import inverse_cdf


def leading_true(ok: Tensor) -> Tensor:
    """ok: (B, S, ...) bool -> (B, 1, ...) int64 length of the all-True prefix along dim 1."""
    return ok.cumprod(1).sum(1, keepdim=True)


def residual(p: Tensor, q: Tensor) -> Tensor:
    """Distribution to resample from after rejecting a draft: max(0, p - q), (..., V)
    (unnormalised; `inverse_cdf` normalises)."""
    return (p - q).clamp_(min=0.0)


def keeps(u: Tensor, q_x: Tensor, p_x: Tensor) -> Tensor:
    """A token x drawn from q is kept with probability min(1, p(x) / q(x)): u * q(x) < p(x)
    (no division).  u: float64 uniforms, q_x, p_x: probabilities -> bool."""
    return u * q_x < p_x


def verify_greedy(pred: Tensor, drafts: Tensor, done: Tensor, checked: Tensor) -> Tensor:
    """pred, drafts: (B, W, 1) argmax and checked token of each column, done / checked:
    (B, W, 1) bool (module docstring) -> a (B, 1, 1) int64.  The round's tokens are `pred`
    (the accepted drafts equal it)."""
    return leading_true(done | (checked & (drafts == pred)))


def verify_sample(p: Tensor, drafts: Tensor, q: Tensor, done: Tensor, checked: Tensor,
                  u: Tensor, col: Tensor, coupled: bool,
                  drafted: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Speculative sampling of every window, and the next round's drafts.

    p: (B, W, V) predictions, drafts: (B, W, 1) the checked tokens, q: (B, W, V) the
    distributions they were drawn from (any finite rows where nothing is checked), done /
    checked: (B, W, 1) bool, u: (4, B, W, 1) float64 uniforms of the acceptance test, the
    coupling test, the token at `a` and the drafts after it, col: (W, 1) the column numbers,
    drafted: (B, W, 1) bool the columns whose draft the coupled refresh may keep (default
    `checked`; a candidate-tree path checks fewer columns than hold drafts).

    Returns a (B, 1, 1) int64 and the round's tokens (B, W, 1) int64: the accepted drafts
    before `a`, the replacement or bonus token at `a`, the next drafts after it."""
    u_accept, u_couple, u_token, u_draft = u
    p_x, q_x = p.gather(2, drafts), q.gather(2, drafts)                # (B, W, 1)
    a = leading_true(done | (checked & keeps(u_accept, q_x, p_x)))     # (B, 1, 1)
    at = col == a                                                      # (B, W, 1) token at a
    res = residual(p, q)                                               # (B, W, V)
    usable = res.sum(-1, keepdim=True) > 0                 # else p (rounding left nothing)
    kept = col < a                                                     # accepted drafts
    from_res = at & checked                                # a rejection (else the bonus: p)
    if coupled:     # never verified: after `a`, or a bonus token at `a` that holds a draft
        if drafted is None:                                # a plain window: drafted = checked
            stale = (col > a) & checked
        else:
            stale = ((col > a) | (at & ~checked)) & drafted
        from_res = from_res | stale
        kept = kept | (stale & keeps(u_couple, q_x, p_x))
    new = inverse_cdf(torch.where(from_res & usable, res, p), torch.where(at, u_token, u_draft))
    return a, torch.where(kept, drafts, new)
