"""What a streaming call hands out (`Engine.stream`): `Finished` groups of complete images and,
streamed by position span, every image's tokens [a, b) once every image of the call has
committed past b (`Engine.stream(..., span=S)`).

A call of P prefix and N new tokens (T = P + N) is cut at fixed positions, P, P + S, P + 2S,
..., T: span k holds tokens [P + kS, min(P + (k + 1)S, T)) of every image.  The cuts depend on
(P, N, S) alone, never on the engine, its window or the timing it measures, so every engine
and both run modes cut a call the same way.  A span goes out after the device sync of the
round in which the call's slowest image committed its last token (rollout/hbsjd.py
`run_jacobi`: the minimum committed cursor rides that round's sync); Cached AR, whose images
all complete in its last round, hands every span out at the end.  Its tokens and behaviour
log-probs are exactly those of the whole call's result (tests/rollout/test_spans.py).

What it is for: the teacher's log-prob at a position depends only on the tokens before it, so
a teacher that keeps a KV cache per image scores each span as it comes, and at the call's end
only the last span is left (opd/distill/span_scoring.py, docs/STREAMING.md).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Finished:
    """Images of a streaming call that are complete: their indices in the call's batch,
    ascending, and exactly the rows of the whole call's result."""
    images: Tensor        # (k,) int64
    tokens: Tensor        # (k, P + N) int64
    logprobs: Tensor      # (k, N) float32 behaviour log-probs (RolloutResult.logprobs)


@dataclass
class Span:
    """Tokens [start, stop) of every image of a streaming call, in batch order: exactly the
    columns start..stop-1 of the whole call's result; `midway`: the call still had rounds to
    run when it went out (what a teacher scores of it then runs beside the rollout)."""
    start: int
    stop: int
    tokens: Tensor        # (B, stop - start) int64
    logprobs: Tensor      # (B, stop - start) float32 behaviour log-probs of those tokens
    midway: bool = False


def span_cuts(prefix_len: int, total: int, span: int, handed: int,
              committed: int) -> list[tuple[int, int]]:
    """The [a, b) of the spans (of `span` tokens, cut at prefix_len + k·span and at `total`)
    from token `handed` (the end of the last span handed out) that every image has committed
    once each has `committed` tokens; none when span is 0 (off)."""
    cuts, a = [], handed
    while span and a < total:
        b = min(a + span, total)
        if b > committed:
            break
        cuts.append((a, b))
        a = b
    return cuts


def whole_spans(prefix_len: int, span: int, tokens: Tensor,
                logprobs: Tensor) -> Iterator[Span]:
    """Every span of a complete call: tokens (B, T) int64 and their behaviour log-probs
    (B, T - prefix_len) float32 (a `RolloutResult`'s)."""
    P, T = prefix_len, tokens.shape[1]
    for a, b in span_cuts(P, T, span, P, T):
        yield Span(a, b, tokens[:, a:b].clone(), logprobs[:, a - P:b - P].clone())


def whole_call(prefix_len: int, span: int, result) -> Iterator[Span | Finished]:
    """What a call run whole hands out (its images complete together, as Cached AR's do): its
    spans, then every image as one group; `result` a `RolloutResult`."""
    yield from whole_spans(prefix_len, span, result.tokens, result.logprobs)
    yield Finished(torch.arange(result.tokens.shape[0], device=result.tokens.device),
                   result.tokens, result.logprobs)
