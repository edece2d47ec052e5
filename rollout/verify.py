"""Verification of a Jacobi window (FACTS.md §3).

All tensors are *aligned*: index i of a row refers to image token `cur + i`, where `cur` is
the row's committed length.  The verifier forward saw [last committed token, drafts], so

    pred[:, i]    distribution of token cur + i          (B, W, V), valid for i < w
    drafts[:, i]  draft for token cur + i                (B, W - 1), checked for i < w - 1

and the draft at window index i + 1 is checked against the prediction at index i.

Greedy: accept while draft == argmax; the first mismatch is replaced by the argmax.
Probabilistic (speculative sampling): accept x with probability min(1, p(x) / q(x)), where q
is the distribution x was drawn from (one-hot for initialised drafts); stop at the first
rejection and resample from norm(max(0, p - q)); if every draft is accepted the bonus token is
drawn from p at the next index.  Either way `a` drafts are accepted and one more token (the
replacement or bonus) is produced at index a.
"""
from __future__ import annotations

import torch
from torch import Tensor

from rollout.sampling import sample_from


def leading_true(ok: Tensor) -> Tensor:
    """ok: (B, S) bool -> (B,) int64 length of the all-True prefix of each row."""
    return ok.long().cumprod(1).sum(1)


def verify_greedy(argmax: Tensor, drafts: Tensor, n_drafts: Tensor) -> Tensor:
    """argmax: (B, W) aligned argmax predictions, drafts: (B, W - 1), n_drafts: (B,) drafts
    to check -> accepted (B,) int64.  The committed tokens are argmax[:, :accepted + 1]."""
    idx = torch.arange(drafts.shape[1], device=drafts.device)
    ok = (drafts == argmax[:, : drafts.shape[1]]) & (idx < n_drafts[:, None])
    return leading_true(ok)


def residual(p: Tensor, q: Tensor) -> Tensor:
    """Distribution to resample from after rejecting a draft: max(0, p - q), (..., V)
    (unnormalised; `sample_from` normalises)."""
    return (p - q).clamp_(min=0.0)


def verify_sample(p: Tensor, drafts: Tensor, q: Tensor, n_drafts: Tensor, u_accept: Tensor,
                  u_token: Tensor) -> tuple[Tensor, Tensor]:
    """Speculative-sampling verification of every row at once.

    p: (B, W, V) aligned target distributions, drafts: (B, W - 1), q: (B, W - 1, V) the
    distributions the drafts were drawn from, n_drafts: (B,) drafts to check, u_accept:
    (B, W - 1) float64 uniforms for the acceptance tests, u_token: (B, W) float64 uniforms for
    a replacement / bonus token at each index (the one at index `accepted` is used).

    Returns accepted (B,) int64 and token (B,) int64, the token at index `accepted`: drawn
    from norm(max(0, p - q)) after a rejection, from p when every draft was accepted."""
    B, S = drafts.shape
    idx = torch.arange(S, device=drafts.device)
    p_x = p[:, :S].gather(2, drafts.unsqueeze(2)).squeeze(2).double()
    q_x = q.gather(2, drafts.unsqueeze(2)).squeeze(2).double()
    ok = (u_accept * q_x < p_x) & (idx < n_drafts[:, None])     # u < p/q without dividing
    accepted = leading_true(ok)
    rows = torch.arange(B, device=p.device)
    p_a = p[rows, accepted]                                      # (B, V)
    rejected = accepted < n_drafts
    q_a = q[rows, accepted.clamp(max=max(S - 1, 0))] if S else torch.zeros_like(p_a)
    dist = torch.where(rejected[:, None], residual(p_a, q_a), p_a)
    empty = dist.sum(-1, keepdim=True) <= 0                      # only by rounding: fall back
    dist = torch.where(empty, p_a, dist)
    return accepted, sample_from(dist, u_token.gather(1, accepted[:, None]).squeeze(1))
