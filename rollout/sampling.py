"""Sampling shared by every engine: CFG, temperature / top-k / top-p, keyed random numbers.

Order (LlamaGen): guided logits `uncond + (cond - uncond) * scale`, then temperature, then
top-k, then top-p, then softmax.  Greedy decoding is the argmax of the guided logits (the
warps never move the argmax).

Decoding "sample" is the Gumbel-max rule with keyed noise (`perturb`): token j of an image is

    argmax_v  log p_j(v) + G(seed, image id, j, v)

p_j the warped guided distribution of position j (masked tokens at -inf) and G standard Gumbel
noise keyed by (seed, image id, token index j, token id v) -- above FLAT_VOCAB tokens drawn in
two levels, a block of the vocabulary and then a token in it, so a row needs noise for
2 sqrt(V) ids, not V -- so
token j is a function of p_j and the image's key only; it is distributed as p_j,
independently of the other positions.
Cached AR commits it directly; a Jacobi engine proposes the draft for token j as the same
argmax under the distribution it predicted for j and accepts a draft exactly when it equals
the token its verified prediction gives (greedy verification of the perturbed scores), so every
engine, window, batch, slot order and execution mode commits Cached AR's tokens.

Decoding "speculative" is speculative sampling (rollout/verify.py), whose uniforms are keyed
by the round too (below): its tokens follow the same distribution, but which tokens a call
commits depends on the windows it ran.

Behaviour log-prob of a committed token (`token_logprob`), the same for every decoding:
log p(token) under the warped guided distribution p = warp(guide(logits)) of its position --
the distribution a sampled token was drawn (or accepted) from; for greedy decoding the same
distribution's log-prob of the argmax.  The learner recomputes it teacher-forced with this
definition (`opd/distill/onpolicy.py`).

Random numbers are not drawn from a generator in batch order.  Every uniform is a hash of

    (seed, image id, token index, attempt, stream)

(splitmix64 in int64 tensor ops, vectorised), so an image's tokens never depend on which
other images share its batch, on their order, or on Full / Compact execution.  For decoding
"speculative" `attempt` is the image's own round counter (0 = the prefill round) and `stream`
separates the uses of one (image, token, attempt): the committed token, the acceptance test, a
new draft and the test that keeps a stale draft under coupled refresh.  The Gumbel noise of
decoding "sample" has its own streams (block, token), and the block or token id in place of the
attempt.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

STREAM_TOKEN = 0    # a token drawn and committed directly (AR step, residual / bonus sample)
STREAM_ACCEPT = 1   # acceptance test of a draft
STREAM_DRAFT = 2    # a draft drawn for the next round (fresh, or the residual of a coupling)
STREAM_COUPLE = 3   # coupled refresh: the test that keeps a stale draft
STREAM_BLOCK = 4    # decoding "sample": the Gumbel noise of (token index, vocabulary block)
STREAM_GUMBEL = 5   # decoding "sample": the Gumbel noise of (token index, token id)

_U64 = 1 << 64


def _s64(c: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return c - _U64 if c >= 1 << 63 else c


_GOLDEN = _s64(0x9E3779B97F4A7C15)
_MIX1 = _s64(0xBF58476D1CE4E5B9)
_MIX2 = _s64(0x94D049BB133111EB)


def _shr(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic); a new tensor."""
    return torch.bitwise_right_shift(x, k).bitwise_and_((1 << (64 - k)) - 1)


def splitmix64(x: Tensor) -> Tensor:
    """splitmix64 finaliser on int64 tensors (wrapping arithmetic); any shape.  In place on
    one new tensor, with torch.bitwise_* rather than ^ / >> / & (the same operators without
    a wrapper each, see rollout/roundcost.py): z ^= z >>> 30; z *= MIX1; ..."""
    z = x + _GOLDEN
    z.bitwise_xor_(_shr(z, 30)).mul_(_MIX1)
    z.bitwise_xor_(_shr(z, 27)).mul_(_MIX2)
    return z.bitwise_xor_(_shr(z, 31))


def image_key(seed: Tensor, image: Tensor) -> Tensor:
    """int64 key of (seed, image id); computed once per image and generate call."""
    return splitmix64(splitmix64(seed) ^ image)


def uniform(key: Tensor, position: Tensor, attempt: Tensor, stream: Tensor | int) -> Tensor:
    """Uniforms in [0, 1), float64, one per (image key, position, attempt, stream); int64
    arguments broadcast together (e.g. key (B, 1), position (B, S), stream (3, 1, 1)).
    Keys must satisfy 0 <= position < 2**32, 0 <= attempt < 2**24, 0 <= stream < 8."""
    fields = torch.bitwise_or(torch.bitwise_left_shift(position, 27),
                              torch.bitwise_left_shift(attempt, 3))
    h = splitmix64(torch.bitwise_xor(key, torch.bitwise_or(fields, stream)))
    return _shr(h, 11).to(torch.float64).mul_(1.0 / (1 << 53))


# ---- logits -> distribution ------------------------------------------------------------------

def uses_cfg(cfg_scale: float | None) -> bool:
    """CFG is on unless the scale is None or 1.0 (then no unconditional rows exist)."""
    return cfg_scale is not None and float(cfg_scale) != 1.0


def guide(logits: Tensor, cfg_scale: float | None) -> Tensor:
    """logits: (2B, ...) conditional rows first, then unconditional rows -> (B, ...) guided;
    without CFG (B, ...) is returned unchanged."""
    if not uses_cfg(cfg_scale):
        return logits
    cond, uncond = logits.chunk(2, dim=0)
    return uncond + (cond - uncond) * cfg_scale


def warp(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None) -> Tensor:
    """logits: (..., V) guided -> probabilities (..., V) float32 after temperature, top-k
    (keep the k largest; 0/None = off) and top-p (keep the smallest prefix of the sorted
    distribution whose mass reaches top_p, as in HF/LlamaGen; 1.0/None = off)."""
    return warp_logits(logits, temperature, top_k, top_p).softmax(-1)


def warp_logits(logits: Tensor, temperature: float, top_k: int | None,
                top_p: float | None) -> Tensor:
    """`warp` before the softmax: (..., V) float32 logits of the warped distribution (up to a
    constant per row), the tokens top-k / top-p remove at -inf."""
    if logits.dtype != torch.float32:
        logits = logits.float()
    if temperature != 1.0:                      # (x / 1.0 is x: skip the copy)
        logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove = cum > top_p
        remove[..., 1:] = remove[..., :-1].clone()
        remove[..., 0] = False
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return logits


def gumbel(key: Tensor, position: Tensor, ids: Tensor, stream: int) -> Tensor:
    """Standard Gumbel noise -log(-log u), float64, one number per (image key, token index,
    id, stream): key, position int64 broadcasting against ids (int64, the token or block ids;
    ids < 2**24 take `uniform`'s attempt field) -> their broadcast shape.  Nothing else enters
    it (no round, row or window)."""
    return uniform(key, position, ids, stream).log_().neg_().log_().neg_()   # u = 0: -inf


FLAT_VOCAB = 256
"""`perturb` draws noise for every token id up to this vocabulary size (one level: fewer
operators per round), in two levels above it."""


def block_size(V: int) -> int:
    """Tokens of a vocabulary block of `perturb`: V itself up to FLAT_VOCAB (one block), else
    the power of two nearest sqrt(V) from above (V = 16384: 128 blocks of 128)."""
    return V if V <= FLAT_VOCAB else 1 << math.ceil(math.log2(V) / 2)


def perturb(guided: Tensor, key: Tensor, position: Tensor, temperature: float,
            top_k: int | None, top_p: float | None) -> tuple[Tensor, Tensor]:
    """Decoding "sample" (module docstring): guided (..., V) logits, key / position int64
    broadcasting to (..., 1) (the image key and the token index each row predicts) ->
    scores (..., V) float32, whose argmax is the token, and p (..., V) float32 the warped
    distribution (`warp`, for the behaviour log-prob).

    Up to FLAT_VOCAB tokens the noise of every token id is added to the logits.  Above it,
    Gumbel-max in two levels, so a row draws noise for 2 sqrt(V) ids, not V: the vocabulary is
    cut into blocks of `block_size(V)` tokens (the last padded with -inf); the block is the
    argmax of its log-mass (log of its tokens' summed p) plus Gumbel noise keyed by the
    block id (STREAM_BLOCK), the token the argmax inside that block of its logit plus Gumbel
    noise keyed by the token id (STREAM_GUMBEL).  The block is drawn with probability its mass
    and the token with its probability given the block, so the token is distributed as p.
    scores hold the winning block's perturbed logits and -inf elsewhere: their argmax is the
    token, the next-best are the alternatives candidate drafting takes."""
    logits = warp_logits(guided, temperature, top_k, top_p)
    p = logits.softmax(-1)
    V, b = logits.shape[-1], block_size(logits.shape[-1])
    ids = torch.arange(V, device=logits.device)
    if b == V:
        return gumbel(key, position, ids, STREAM_GUMBEL).add_(logits).float(), p
    nb = -(-V // b)
    pad = nb * b - V                           # the last block's missing tokens (-inf, p = 0)
    padded = torch.nn.functional.pad(logits, (0, pad), value=float("-inf")) if pad else logits
    blocks = padded.view(*logits.shape[:-1], nb, b)                        # (..., nb, b)
    mass = (torch.nn.functional.pad(p, (0, pad)) if pad else p).view_as(blocks).sum(-1).log_()
    block = gumbel(key, position, ids[:nb], STREAM_BLOCK).add_(mass).argmax(-1, keepdim=True)
    inner = blocks.gather(-2, block[..., None].expand(*block.shape, b)).squeeze(-2)  # (..., b)
    tokens = block * b + ids[:b]                                            # (..., b)
    noisy = gumbel(key, position, tokens, STREAM_GUMBEL).add_(inner).float()
    scores = torch.full_like(padded, float("-inf")).scatter_(-1, tokens, noisy)
    return scores[..., :V], p


def token_logprob(p: Tensor, tokens: Tensor) -> Tensor:
    """p: (..., V) float32 probabilities from `warp`, tokens: (...) int64 -> (...) float32
    log p(token): a committed token's behaviour log-prob (module docstring)."""
    return p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).log()


def sample_from(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF sampling.  probs: (..., V) non-negative (need not be normalised),
    u: (...) float64 uniforms -> tokens (...) int64.  A zero-probability token is never
    chosen (first index whose cumulative mass exceeds u * total)."""
    return inverse_cdf(probs, u.unsqueeze(-1)).squeeze(-1)


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """`sample_from` with a trailing unit dimension: probs (..., V), u (..., 1) float64 ->
    tokens (..., 1) int64."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    tok = torch.searchsorted(cdf, u * cdf[..., -1:], right=True)
    return tok.clamp_(max=probs.shape[-1] - 1)


# ---- argument checks -------------------------------------------------------------------------

def check_sampling(vocab_size: int, cfg_scale: float | None, temperature: float,
                   top_k: int | None, top_p: float | None, sampled: bool) -> None:
    """Raise ValueError naming the bad argument."""
    if cfg_scale is not None and not math.isfinite(float(cfg_scale)):
        raise ValueError(f"cfg_scale must be a finite number or None, got {cfg_scale!r}")
    if sampled and not (isinstance(temperature, (int, float)) and temperature > 0
                        and math.isfinite(temperature)):
        raise ValueError(f"temperature must be > 0 for decoding='sample', got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool)
                              or top_k < 0 or top_k > vocab_size):
        raise ValueError(f"top_k must be an int in [0, vocab_size={vocab_size}] (0 = off), "
                         f"got {top_k!r}")
    if top_p is not None and not (0.0 < float(top_p) <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] (1.0 = off), got {top_p!r}")
