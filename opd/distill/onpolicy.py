"""On-policy, proven every step: the learner's log-probs of the rollout's tokens.

A student rollout records, for every generated token, its behaviour log-prob: log p(token)
under the warped guided distribution p = warp(guide(logits)) it was committed from (CFG
`uncond + (cond − uncond) · scale`, then rollout.temperature, top_k, top_p;
`rollout.sampling.token_logprob`).  Sampled decoding: the distribution the token was drawn or
accepted from (speculative sampling commits tokens distributed as p).  Greedy decoding: the
same distribution's log-prob of the argmax, so one definition serves both.

`logprob_gap` recomputes those log-probs teacher-forced with the weights the learner holds
(one conditional forward, plus one unconditional forward when CFG is on; the learner passes the
conditional logits of its loss forward when that runs in eval mode — `student_dropout` off,
the default — so the check costs no conditional forward of its own) and reports

    onpolicy_logprob_delta_mean   mean |Δ| over the student-generated tokens of the batch
    onpolicy_logprob_delta_max    max |Δ|
    onpolicy_tokens               tokens compared (0: the batch has no student tokens)
    onpolicy_s                    seconds of the recomputation

Δ = recomputed − recorded.  Strict on-policy (distill.staleness 0) it is float round-off only
(cached vs uncached forward, batch shapes; below `STRICT_BOUND` in float32 on CPU); with
staleness k ≥ 1 it measures how far the weights moved over the lag.  Prefix tokens (data) and
batches whose suffix is not the student's (sources "data", "teacher") carry no behaviour
log-prob: mean and max are NaN (metrics.parquet: empty), never 0.  With top-k / top-p a token
outside the current weights' support gives Δ = inf.  In bf16 (opd/models/precision.py: bf16 rollout
copies, a learner whose forward autocasts) it measures bf16 round-off as well.
"""
from __future__ import annotations

import math
import time

import torch
from torch import Tensor

from opd.distill.batch import TrajectoryBatch
from opd.config.schema import RunConfig
from rollout.sampling import guide, token_logprob, uses_cfg, warp

STRICT_BOUND = 1e-4
"""|Δ| bound of a strict on-policy step in float32 on CPU (measured ~1e-6: the cached verifier
forward and the teacher-forced forward sum in a different order)."""

KEYS = ("onpolicy_logprob_delta_mean", "onpolicy_logprob_delta_max", "onpolicy_tokens",
        "onpolicy_s")


@torch.no_grad()
def recompute_logprobs(student, batch: TrajectoryBatch, cfg: RunConfig,
                       cond_logits: Tensor | None = None) -> Tensor:
    """(B, N) float32 log-probs of the batch's suffix tokens under `student`, teacher-forced in
    eval mode, with the rollout's guidance and warping (the definition above).  `cond_logits`:
    the (B, L − 1, V) logits of that conditional forward if the caller has them (the loss's
    eval-mode forward: the same computation).  The student's train / eval mode is left as it
    was."""
    r = cfg.rollout
    P = batch.prefix_len
    device = next(student.parameters()).device
    labels, tokens = batch.labels.to(device), batch.tokens.to(device)
    was_training = student.training
    student.eval()
    try:
        if cond_logits is None:
            cond_logits = student(labels, tokens[:, :-1])
        logits = cond_logits.detach()[:, P:]                               # (B, N, V)
        if uses_cfg(r.cfg_scale):
            null = torch.full_like(labels, student.num_classes)
            uncond = student(null, tokens[:, :-1])[:, P:]
            logits = guide(torch.cat([logits, uncond]), r.cfg_scale)
    finally:
        student.train(was_training)
    p = warp(logits, r.temperature, r.top_k or None, r.top_p)
    return token_logprob(p, tokens[:, P:]).cpu()


def logprob_gap(student, batch: TrajectoryBatch, cfg: RunConfig,
                cond_logits: Tensor | None = None) -> dict:
    """|recomputed − recorded| behaviour log-probs of the batch's student tokens: the KEYS
    above (NaN mean / max and 0 tokens when the batch has no student tokens).  `cond_logits`:
    see `recompute_logprobs`."""
    if batch.source != "student" or batch.behaviour_logprobs is None:
        return dict(zip(KEYS, (math.nan, math.nan, 0, 0.0)))
    start = time.perf_counter()
    fresh = recompute_logprobs(student, batch, cfg, cond_logits)
    delta = (fresh.double() - batch.behaviour_logprobs.double().cpu()).abs()
    return dict(zip(KEYS, (float(delta.mean()), float(delta.max()), int(delta.numel()),
                           time.perf_counter() - start)))


def combine_gaps(results: list[dict]) -> dict:
    """The KEYS of one step from the learner ranks' shards: mean weighted by each rank's
    tokens, max of maxes, tokens summed, the slowest rank's seconds."""
    parts = [r for r in results if r.get("onpolicy_tokens")]
    n = sum(r["onpolicy_tokens"] for r in parts)
    if not n:
        return dict(zip(KEYS, (math.nan, math.nan, 0, max(r.get("onpolicy_s", 0.0)
                                                          for r in results))))
    return dict(zip(KEYS, (
        sum(r["onpolicy_logprob_delta_mean"] * r["onpolicy_tokens"] for r in parts) / n,
        max(r["onpolicy_logprob_delta_max"] for r in parts), n,
        max(r.get("onpolicy_s", 0.0) for r in results))))
