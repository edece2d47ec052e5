"""Divergences between the teacher's and the student's next-token distributions.

P is the teacher, Q the student, both distributions of image token i at position i
(`student_logits[:, i]` is aligned with `tokens[:, i]`).  Every divergence is computed per
valid position and reduced to a token average: the sum over positions where `mask` is true,
divided by their count (0 when there are none).

Registered by name (`DIVERGENCES`, `get_divergence`):

- `forward_kl`: KL(P‖Q) = Σ_v P(v) (log P(v) − log Q(v))   (mean-seeking)
- `reverse_kl`: KL(Q‖P)                                     (mode-seeking)
- `jsd`: generalized Jensen–Shannon with M = βP + (1−β)Q,
  JSD_β = β·KL(P‖M) + (1−β)·KL(Q‖M).  Following GKD / TRL, β = 0 is *taken as* forward KL and
  β = 1 as reverse KL exactly (the formula itself tends to 0 at both ends).  log M is formed
  in log space with logaddexp.

Temperature τ is applied to both sides before the softmax: Q_τ = softmax(z/τ),
P_τ = softmax(log P / τ) (= softmax(teacher logits / τ)).  `teacher_temperature` can override
the teacher's side.

Teacher transport (the loss is told which one the batch carries):

- full: teacher log-probs (B, T, V); the divergence is exact.
- top-k: the teacher's full-vocabulary log-probs at its k most likely tokens, values (B, T, k)
  and indices (B, T, k) int64.  Both distributions are *lumped* onto the same k + 1 atoms:
  the k teacher tokens and one "rest" atom holding the remaining mass (teacher rest
  1 − Σ exp(values), floored at the dtype's eps; student rest computed exactly from its
  logits).  At τ = 1 this is the exact divergence of the coarse-grained distributions, a lower
  bound of the full one (data-processing inequality) that still charges the student for mass
  it puts outside the teacher's top-k.  τ is applied to the lumped log-probs of both sides
  alike.  With k = V there is no rest atom and the result equals the full transport.
"""
from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

TRANSPORTS = ("full", "topk")

# (student_logp (..., A), teacher_logp (..., A)) -> divergence (...)
DivergenceFn = Callable[[Tensor, Tensor], Tensor]
DIVERGENCES: dict[str, Callable[..., Tensor]] = {}


def register_divergence(name: str) -> Callable[[Callable[..., Tensor]], Callable[..., Tensor]]:
    """Register `fn(student_logp, teacher_logp, **params) -> Tensor` under `name`."""

    def wrap(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        if name in DIVERGENCES:
            raise ValueError(f"divergence {name!r} is already registered")
        DIVERGENCES[name] = fn
        return fn

    return wrap


def get_divergence(name: str, **params: float) -> DivergenceFn:
    """The divergence `name` with its parameters bound (e.g. `get_divergence("jsd", beta=0.5)`)."""
    if name not in DIVERGENCES:
        raise ValueError(f"unknown divergence {name!r}; registered: {sorted(DIVERGENCES)}")
    fn = DIVERGENCES[name]
    allowed = list(inspect.signature(fn).parameters)[2:]
    for key in params:
        if key not in allowed:
            raise ValueError(f"divergence {name!r} takes no parameter {key!r}; it takes {allowed}")
    return functools.partial(fn, **params) if params else fn


@dataclass(frozen=True)
class TeacherDist:
    """The teacher's next-token log-probs at every position of a batch.

    full:  logprobs (B, T, V) float, log_softmax of the teacher logits; indices None.
    top-k: logprobs (B, T, k) float, the teacher's full-vocabulary log-probs at its k most
           likely tokens; indices (B, T, k) int64, distinct within a position.
    """

    logprobs: Tensor
    indices: Tensor | None = None

    @property
    def transport(self) -> str:
        return "full" if self.indices is None else "topk"


def kl(logp: Tensor, logq: Tensor) -> Tensor:
    """KL(p‖q) over the last dim from log-probs (..., A) -> (...), with 0·log 0 = 0."""
    p = logp.exp()
    diff = torch.where(p > 0, logp - logq, torch.zeros_like(logp))
    return (p * diff).sum(-1)


def entropy(logp: Tensor) -> Tensor:
    """Shannon entropy in nats over the last dim from log-probs (..., A) -> (...)."""
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)


@register_divergence("forward_kl")
def forward_kl(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """KL(P‖Q); student_logp, teacher_logp: (..., A) log-probs -> (...)."""
    return kl(teacher_logp, student_logp)


@register_divergence("reverse_kl")
def reverse_kl(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """KL(Q‖P); student_logp, teacher_logp: (..., A) log-probs -> (...)."""
    return kl(student_logp, teacher_logp)


@register_divergence("jsd")
def jsd(student_logp: Tensor, teacher_logp: Tensor, beta: float = 0.5) -> Tensor:
    """Generalized JSD_β with M = βP + (1−β)Q; β = 0 is forward KL, β = 1 reverse KL.

    student_logp, teacher_logp: (..., A) log-probs -> (...).
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd beta must lie in [0, 1], got {beta}")
    if beta == 0.0:
        return forward_kl(student_logp, teacher_logp)
    if beta == 1.0:
        return reverse_kl(student_logp, teacher_logp)
    log_m = torch.logaddexp(teacher_logp + math.log(beta), student_logp + math.log1p(-beta))
    return beta * kl(teacher_logp, log_m) + (1.0 - beta) * kl(student_logp, log_m)


def temper(logp: Tensor, temperature: float) -> Tensor:
    """log softmax(logp / τ) over the last dim: (..., A) -> (..., A); identity at τ = 1."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if temperature == 1.0:
        return logp
    return F.log_softmax(logp / temperature, dim=-1)


def _check_inputs(student_logits: Tensor, teacher: TeacherDist, mask: Tensor) -> None:
    if student_logits.dim() != 3:
        raise ValueError(f"student_logits must be (B, T, V), got {tuple(student_logits.shape)}")
    B, T, V = student_logits.shape
    if mask.shape != (B, T) or mask.dtype != torch.bool:
        raise ValueError(f"mask must be (B, T) = {(B, T)} bool, got {tuple(mask.shape)} {mask.dtype}")
    t = teacher.logprobs
    if teacher.indices is None:
        if t.shape != (B, T, V):
            raise ValueError(f"full teacher log-probs must be (B, T, V) = {(B, T, V)}, got {tuple(t.shape)}")
    else:
        if t.dim() != 3 or t.shape[:2] != (B, T) or teacher.indices.shape != t.shape:
            raise ValueError(
                f"top-k teacher values and indices must both be (B, T, k) with (B, T) = {(B, T)}, "
                f"got {tuple(t.shape)} and {tuple(teacher.indices.shape)}"
            )
        if teacher.indices.dtype != torch.int64:
            raise ValueError(f"top-k teacher indices must be int64, got {teacher.indices.dtype}")
        if not 1 <= t.shape[-1] <= V:
            raise ValueError(f"top-k k must lie in [1, V={V}], got {t.shape[-1]}")


def valid_atoms(student_logits: Tensor, teacher: TeacherDist, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Untempered student and teacher log-probs on common atoms at the valid positions.

    student_logits: (B, T, V) float; teacher: full or top-k (see module doc); mask: (B, T) bool.
    Returns (student_logp, teacher_logp), each (N, A) in at least float32, N = mask.sum(),
    A = V (full), k (top-k, k = V) or k + 1 (top-k, k < V; the last atom is the rest mass).
    """
    _check_inputs(student_logits, teacher, mask)
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    z = student_logits[mask].to(dtype)                        # (N, V)
    t = teacher.logprobs[mask].to(dtype)                      # (N, V) or (N, k)
    if teacher.indices is None:
        return F.log_softmax(z, dim=-1), t
    idx = teacher.indices[mask]                               # (N, k)
    k, V = idx.shape[-1], z.shape[-1]
    log_z = torch.logsumexp(z, dim=-1, keepdim=True)          # (N, 1)
    s = z.gather(-1, idx) - log_z                             # (N, k)
    if k == V:
        return s, t
    s_rest = torch.logsumexp(z.scatter(-1, idx, float("-inf")), dim=-1, keepdim=True) - log_z
    t_mass = torch.logsumexp(t, dim=-1, keepdim=True).exp()   # (N, 1)
    t_rest = (1.0 - t_mass).clamp_min(torch.finfo(dtype).eps).log()
    return torch.cat([s, s_rest], dim=-1), torch.cat([t, t_rest], dim=-1)


def masked_mean(values: Tensor, weights: Tensor | None = None) -> Tensor:
    """Token average of per-position values (N,) -> scalar; 0 when N = 0.

    With weights (N,) >= 0 the average is self-normalized: Σ w·x / Σ w (0 when Σ w = 0).
    """
    if weights is None:
        return values.sum() / max(values.numel(), 1)
    return (weights * values).sum() / weights.sum().clamp_min(torch.finfo(values.dtype).tiny)


def scatter_positions(values: Tensor, mask: Tensor) -> Tensor:
    """Per-valid-position values (N,) -> (B, T) with zeros at invalid positions."""
    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask, values)


def masked_divergence(
    student_logits: Tensor,
    teacher: TeacherDist,
    mask: Tensor,
    divergence: str = "forward_kl",
    *,
    temperature: float = 1.0,
    teacher_temperature: float | None = None,
    return_per_position: bool = False,
    **params: float,
) -> Tensor | tuple[Tensor, Tensor]:
    """Token-averaged divergence between teacher and student over the valid positions.

    student_logits: (B, T, V) float; teacher: `TeacherDist` (full or top-k); mask: (B, T) bool.
    divergence: a registered name; params are its parameters (e.g. beta for "jsd").
    temperature: τ on both sides; teacher_temperature overrides the teacher's τ.
    Returns the scalar loss, and with return_per_position also (B, T) per-position values
    (zero at invalid positions).
    """
    fn = get_divergence(divergence, **params)
    s, t = valid_atoms(student_logits, teacher, mask)
    tau_t = temperature if teacher_temperature is None else teacher_temperature
    d = fn(temper(s, temperature), temper(t, tau_t))          # (N,)
    loss = masked_mean(d)
    if return_per_position:
        return loss, scatter_positions(d, mask)
    return loss
