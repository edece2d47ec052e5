"""Continuous batching (`generate(..., slots=R)`, config rollout.slots): a call's B images run
through R <= B physical rows of a Jacobi engine.

Images 0..R-1 start; whenever rows' images are complete at the start of a round and images
wait, the rows' tokens are kept and the next waiting images are prefilled into those rows, each
with its first window (one forward for all of them, rollout/rounds.py `prefill_round`,
attributed to the round that completed the old images), then the round goes on
(rollout/hbsjd.py `run_jacobi`).  An image's tokens never depend on its row: its random numbers
are keyed by the image (rollout/sampling.py).
"""
from __future__ import annotations

import time

import torch
from torch import Tensor

from rollout.engine import Request, synchronize
from rollout.jacobi import JacobiState, Plan, init_state
from rollout.prefill import prefill_token
from rollout.rounds import prefill_round
from rollout.spans import Finished, Span
from rollout.stats import RolloutResult


class Slots:
    """B = req.batch images over R = req.rows rows: the image in each row, the next waiting
    image, and the tokens of the images that left their rows."""

    def __init__(self, req: Request):
        B, T, dev = req.batch, req.total, req.labels.device
        self.img = torch.arange(req.rows, device=dev)            # (R,) the image in each row
        self.waiting = req.rows                                  # the next image to admit
        self.out = torch.empty(B, T, dtype=torch.long, device=dev)
        self.out_logp = torch.empty(B, T, dtype=torch.float32, device=dev)

    def refill(self, model, req: Request, st: JacobiState, live: Tensor,
               plan: Plan) -> tuple[Tensor, Tensor]:
        """Rows not `live` (R,) take the next waiting images, in place of `st`'s rows, each after
        its first round (`prefill_round`, window plan.W) -> the admitted images (k,) int64 and
        that round's counts (3, k) int64."""
        B, T = req.batch, req.total
        done = (~live).nonzero().squeeze(1)[: B - self.waiting]
        new = torch.arange(self.waiting, self.waiting + done.shape[0], device=live.device)
        self.out[self.img[done]] = st.seq[done, :T]
        self.out_logp[self.img[done]] = st.logp[done, :T]
        self.img[done] = new
        sub = init_state(req, new, plan, model.vocab_size)
        counts = prefill_round(model, sub, new, req, plan, done)
        st.assign(done, sub, new_images=True)
        self.waiting += done.shape[0]
        return new, counts

    def per_image(self, counts: Tensor, idx: Tensor | None, compiled: bool) -> Tensor:
        """A round's counts (3, k) of rows idx (None: every row) -> (3, B) per image."""
        B = self.out.shape[0]
        if idx is None and self.img.shape[0] == B:     # no slots, Full: row b holds image b
            # (a CUDA graph's outputs are rewritten by its next replay)
            return counts.clone() if compiled else counts
        per_image = torch.zeros(3, B, dtype=torch.long, device=counts.device)
        return per_image.index_add_(1, self.img if idx is None else self.img[idx], counts)

    def finished(self, st: JacobiState, rows: Tensor, req: Request) -> Finished:
        """The complete images in physical `rows` (k,) int64, in batch order, with copies of
        their tokens and behaviour log-probs (streaming, `Engine.stream`)."""
        images, order = self.img[rows].sort()
        rows = rows[order]
        T = req.total
        return Finished(images, st.seq[rows, :T].clone(), st.logp[rows, req.prefix_len:T].clone())

    def span(self, st: JacobiState, start: int, stop: int, midway: bool) -> Span:
        """Tokens [start, stop) of every image, once every image is admitted and has committed
        them (streaming, rollout/spans.py): copies, in batch order."""
        seq, logp = st.seq[:, start:stop], st.logp[:, start:stop]
        if self.waiting == self.img.shape[0]:          # no row refilled: row b holds image b
            return Span(start, stop, seq.clone(), logp.clone(), midway)
        tokens, logprobs = self.out[:, start:stop].clone(), self.out_logp[:, start:stop].clone()
        tokens[self.img], logprobs[self.img] = seq, logp
        return Span(start, stop, tokens, logprobs, midway)

    def collect(self, st: JacobiState) -> tuple[Tensor, Tensor]:
        """-> every image's tokens (B, T) int64 and behaviour log-probs (B, T) float32."""
        T = self.out.shape[1]
        self.out[self.img] = st.seq[:, :T]
        self.out_logp[self.img] = st.logp[:, :T]
        return self.out, self.out_logp


def single_token(model, req: Request, times: list) -> RolloutResult:
    """N = 1: the prefill is the whole rollout (in batches of R images)."""
    dev, B, R = req.labels.device, req.batch, req.rows
    parts = req.row_batches()
    first, logp = (torch.cat(t) for t in zip(*[prefill_token(model, req, i) for i in parts]))
    zeros = torch.zeros(B, dtype=torch.long, device=dev)
    synchronize(dev)
    times.append(time.perf_counter())
    return RolloutResult(tokens=torch.cat([req.prefix, first[:, None]], 1).clone(),
                         prefix_len=req.prefix_len, committed=torch.ones_like(zeros)[None],
                         accepted=zeros, rejected=zeros.clone(), active=[R], modes=["full"],
                         wall_time=0.0, round_times=[times[1] - times[0]],
                         prefills=len(parts) - 1, logprobs=logp[:, None].contiguous())
