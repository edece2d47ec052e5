"""Cached AR: one token per forward with the static KV cache (the reference every engine must
match in greedy mode).  Always Full execution (rows 0..R-1); with slots, batches of R images.
With option compile a round (`ar_step`: forward and token choice) is one compiled graph."""
from __future__ import annotations

import torch

from rollout.engine import Engine, Request, cfg_rows, choose_token, register
from rollout.prefill import prefill_token
from rollout.sampling import guide
from rollout.stats import RolloutResult


def ar_step(model, x: torch.Tensor, pos: torch.Tensor, attempt: torch.Tensor,
            req: Request) -> tuple[torch.Tensor, torch.Tensor]:
    """One round: x (B, 1) token j - 1 of each image at positions pos (B, 1) = j, attempt (B,)
    zeros -> token j (B,) int64 and its behaviour log-prob (B,) float32 (`choose_token`)."""
    logits = model.forward_cached(cfg_rows(x, req), cfg_rows(pos, req), None)[:, 0]
    return choose_token(guide(logits, req.cfg_scale), req, pos[:, 0], attempt)


def decode_tokens(model, req: Request, first: torch.Tensor, first_logp: torch.Tensor,
                  step=ar_step) -> tuple[torch.Tensor, torch.Tensor]:
    """first: (B,) token P and its log-prob -> tokens (B, P + N) int64 and the behaviour
    log-probs of tokens P .. T-1 (B, N) float32, decoding tokens P+1 .. T-1 one per forward
    (`step`: `ar_step` or its compiled version)."""
    B, P, T = req.batch, req.prefix_len, req.total
    out = torch.empty(B, T, dtype=torch.long, device=first.device)
    logp = torch.empty(B, T - P, dtype=torch.float32, device=first.device)
    out[:, :P] = req.prefix
    out[:, P], logp[:, 0] = first, first_logp
    zero = torch.zeros(B, dtype=torch.long, device=first.device)
    for j in range(P + 1, T):
        x = out[:, j - 1: j]                                     # input token j-1 ...
        pos = torch.full((B, 1), j, dtype=torch.long, device=x.device)   # ... at position j
        out[:, j], logp[:, j - P] = step(model, x, pos, zero, req)
    return out, logp


@register("cached_ar")
class CachedAR(Engine):
    """Options: decoding = greedy (argmax) | sample (the keyed Gumbel-max token of each
    position) | speculative (keyed inverse-CDF sampling), rollout/sampling.py."""

    def run(self, model, req: Request) -> RolloutResult:
        B, N = req.batch, req.num_new
        dev = req.labels.device
        parts = req.row_batches()
        step = self.compiled_round(ar_step, dev)
        decoded = [decode_tokens(model, req.take(i), *prefill_token(model, req.take(i)), step)
                   for i in parts]
        tokens, logprobs = (torch.cat(t) for t in zip(*decoded))
        committed = torch.zeros(N * len(parts), B, dtype=torch.long, device=dev)
        for k, i in enumerate(parts):                # batch k owns rounds k*N .. (k+1)*N - 1
            committed[k * N:(k + 1) * N, i] = 1
        zeros = torch.zeros(B, dtype=torch.long, device=dev)
        first_round = torch.cat([torch.full_like(i, k * N) for k, i in enumerate(parts)])
        return RolloutResult(tokens=tokens, prefix_len=req.prefix_len, committed=committed,
                             accepted=zeros, rejected=zeros.clone(),
                             active=[len(i) for i in parts for _ in range(N)],
                             modes=["full"] * (N * len(parts)), wall_time=0.0,
                             prefills=len(parts) - 1, first_round=first_round,
                             logprobs=logprobs)
