"""Distillation objectives (KD, SeqKD, GKD, VarKD), registered by name.

An objective is a small config dataclass with

- `needs`: the teacher transports its loss can use ("full", "topk"), or ("tokens",) when it
  needs teacher-generated token sequences instead of teacher scores;
- `source` / `choose_source(step, seed)`: where the sequences of a training step come from,
  "student" (on-policy rollout of the current student), "data" (dataset suffix) or
  "teacher" (teacher-generated suffix);
- `loss(student_logits, batch) -> (loss, metrics)`: student_logits (B, L, V) are the
  student's distributions of image tokens 0..L-1, aligned with `batch.tokens` (B, L); the loss
  is a token average over `batch.loss_mask` (the generated suffix).

`get_objective(name, **cfg)` builds one from the run config.  The objectives' names and the
run settings each reads (λ, β, τ, with their ranges and defaults) are declared in
opd/config/objective_settings.py; an objective has a dataclass field of the same name for each.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from opd.distill.batch import TrajectoryBatch
from opd.config.objective_settings import BETA, LAM, OBJECTIVE_SETTINGS, SETTINGS, TEMPERATURE
from opd.distill.divergences import (
    TeacherDist,
    entropy,
    jsd,
    masked_divergence,
    masked_mean,
    temper,
    valid_atoms,
)

OBJECTIVES: dict[str, type[Objective]] = {}


def register_objective(name: str) -> Callable[[type[Objective]], type[Objective]]:
    """Class decorator: register an `Objective` subclass under `name`."""

    def wrap(cls: type[Objective]) -> type[Objective]:
        if name in OBJECTIVES:
            raise ValueError(f"objective {name!r} is already registered")
        if name not in OBJECTIVE_SETTINGS:
            raise ValueError(f"objective {name!r} is not declared in opd/config/objective_settings.py's "
                             f"OBJECTIVE_SETTINGS; add it there with the settings it reads")
        missing = set(OBJECTIVE_SETTINGS[name]) - {f.name for f in dataclasses.fields(cls)}
        if missing:
            raise ValueError(f"objective {name!r} reads {sorted(missing)} but has no such field")
        cls.name = name
        OBJECTIVES[name] = cls
        return cls

    return wrap


def get_objective(name: str, **cfg: object) -> Objective:
    """Build the objective `name` from its config keys (e.g. `get_objective("gkd", beta=0.5)`)."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; registered: {sorted(OBJECTIVES)}")
    cls = OBJECTIVES[name]
    known = [f.name for f in dataclasses.fields(cls)]
    for key in cfg:
        if key not in known:
            raise ValueError(f"objective {name!r} has no config key {key!r}; its keys are {known}")
    return cls(**cfg)


def teacher_dist(batch: TrajectoryBatch) -> TeacherDist:
    """The batch's teacher scores as a `TeacherDist` (full (B, S, V) or top-k (B, S, k), S the
    positions from `batch.teacher_start` on; top-k indices widened to int64)."""
    if batch.teacher_logprobs is not None:
        return TeacherDist(batch.teacher_logprobs)
    if batch.teacher_topk_values is not None:
        return TeacherDist(batch.teacher_topk_values, batch.teacher_topk_indices.long())
    raise ValueError(f"batch {batch.batch_id} has no teacher scores: score it with the teacher first")


def scored_positions(student_logits: Tensor, batch: TrajectoryBatch) -> tuple[Tensor, TeacherDist, Tensor]:
    """(student logits, teacher scores, loss mask) on the positions the teacher scores cover:
    (B, S, V), (B, S, ·), (B, S) from position `batch.teacher_start` on.  The loss mask is
    false before the prefix end, so the valid positions, and their order, are those of the
    whole batch: a loss is the same whether the teacher scored every position or the suffix."""
    start = batch.teacher_start
    return student_logits[:, start:], teacher_dist(batch), batch.loss_mask[:, start:]


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def _check_unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {value}")


@dataclass
class Objective:
    """Base class; subclasses set `needs` and `accepts` and implement `_loss`."""

    name: ClassVar[str] = ""
    needs: ClassVar[tuple[str, ...]] = ()      # supported teacher transports, or ("tokens",)
    accepts: ClassVar[tuple[str, ...]] = ()    # batch sources the loss is defined on

    @property
    def source(self) -> str:
        """Where this objective's sequences come from: one of `accepts`, or "mixed"."""
        return self.accepts[0]

    def supports(self, transport: str) -> bool:
        return transport in self.needs

    def choose_source(self, step: int, seed: int) -> str:
        """The sequence source of training step `step` (deterministic in (step, seed))."""
        return self.source

    def __post_init__(self) -> None:
        """Range checks of the run settings the objective reads (opd/config/objective_settings.py)."""
        for key in OBJECTIVE_SETTINGS[self.name]:
            SETTINGS[key].check(self.name, getattr(self, key))

    def validate(self, student_logits: Tensor, batch: TrajectoryBatch) -> None:
        """Raise if the batch's source, teacher transport or shape does not fit this loss."""
        if batch.source not in self.accepts:
            raise ValueError(f"objective {self.name!r} takes batches from {self.accepts}, "
                             f"got source {batch.source!r} (batch {batch.batch_id})")
        if self.needs != ("tokens",) and batch.teacher_transport not in self.needs:
            raise ValueError(f"objective {self.name!r} needs teacher transport {self.needs}, batch "
                             f"{batch.batch_id} has {batch.teacher_transport!r}")
        B, L = batch.tokens.shape
        if student_logits.dim() != 3 or student_logits.shape[:2] != (B, L):
            raise ValueError(f"student_logits must be (B, L, V) with (B, L) = {(B, L)} aligned with "
                             f"batch.tokens, got {tuple(student_logits.shape)}")

    def loss(self, student_logits: Tensor, batch: TrajectoryBatch) -> tuple[Tensor, dict[str, float]]:
        """student_logits: (B, L, V) float; returns (scalar loss, metrics of Python floats)."""
        self.validate(student_logits, batch)
        loss, metrics = self._loss(student_logits, batch)
        mask = batch.loss_mask
        return loss, {"loss": float(loss.detach()), "tokens": float(mask.sum()),
                      "on_policy": float(batch.source == "student"), **metrics}

    def _loss(self, student_logits: Tensor, batch: TrajectoryBatch) -> tuple[Tensor, dict[str, float]]:
        raise NotImplementedError


@register_objective("kd")
@dataclass
class KD(Objective):
    """Word-level KD: forward KL(P‖Q) to the teacher on data sequences (GKD with λ = 0, β = 0).

    temperature: τ on both teacher and student (no τ² rescaling).
    """

    temperature: float = TEMPERATURE.default
    needs: ClassVar[tuple[str, ...]] = ("full", "topk")
    accepts: ClassVar[tuple[str, ...]] = ("data",)

    def _loss(self, student_logits: Tensor, batch: TrajectoryBatch) -> tuple[Tensor, dict[str, float]]:
        loss = masked_divergence(*scored_positions(student_logits, batch), "forward_kl",
                                 temperature=self.temperature)
        return loss, {}


@register_objective("seqkd")
@dataclass
class SeqKD(Objective):
    """Sequence-level KD: cross-entropy of the student on teacher-generated suffix tokens,
    −log Q(tokens[:, i]) averaged over the generated positions.  Needs no teacher scores."""

    needs: ClassVar[tuple[str, ...]] = ("tokens",)
    accepts: ClassVar[tuple[str, ...]] = ("teacher",)

    def _loss(self, student_logits: Tensor, batch: TrajectoryBatch) -> tuple[Tensor, dict[str, float]]:
        mask = batch.loss_mask
        z = student_logits[mask]                                                  # (N, V)
        z = z.to(torch.promote_types(z.dtype, torch.float32))
        nll = F.cross_entropy(z, batch.tokens[mask], reduction="none")          # (N,)
        return masked_mean(nll), {}


@register_objective("gkd")
@dataclass
class GKD(Objective):
    """Generalized KD (Agarwal et al.): JSD_β between teacher and student on a mix of on-policy
    student rollouts (probability λ per step) and data sequences.

    lam: on-policy fraction λ in [0, 1]; beta: JSD β in [0, 1] (0 forward KL, 1 reverse KL);
    temperature: τ on both sides.
    """

    lam: float = LAM.default
    beta: float = BETA.default
    temperature: float = TEMPERATURE.default
    needs: ClassVar[tuple[str, ...]] = ("full", "topk")
    accepts: ClassVar[tuple[str, ...]] = ("student", "data")

    @property
    def source(self) -> str:
        return "student" if self.lam == 1.0 else "data" if self.lam == 0.0 else "mixed"

    def choose_source(self, step: int, seed: int) -> str:
        """"student" with probability λ, else "data"; one uniform draw keyed by (seed, step)."""
        u = np.random.default_rng([int(seed), int(step)]).random()
        return "student" if u < self.lam else "data"

    def _loss(self, student_logits: Tensor, batch: TrajectoryBatch) -> tuple[Tensor, dict[str, float]]:
        loss = masked_divergence(*scored_positions(student_logits, batch), "jsd",
                                 temperature=self.temperature, beta=self.beta)
        return loss, {}


WEIGHTINGS = ("none", "gate", "exp")


@register_objective("varkd")
@dataclass
class VarKD(Objective):
    """VarKD (Peruzzo et al. 2026), OUR INTERPRETATION: the paper's exact loss is not public in
    our sources.  What it states — distill on student samples, supervise selectively, reduce the
    token-level ambiguity of the visual vocabulary — is implemented as:

    1. Sequences: on-policy student rollouts only (source "student").
    2. Target: the teacher distribution P at temperature `teacher_temperature` (> 1 spreads mass
       over near-equivalent codes, < 1 sharpens), then smoothed over its top
       `smoothing_topk` tokens: P' = (1 − α)·P + α·Uniform(top-k of P), α = `smoothing`.
       The student is not forced to copy the teacher's arbitrary choice among near-equivalent
       codes.  (With top-k transport the rest atom never enters the uniform part.)
    3. Per position: d_i = JSD_β(P'_i, Q_i) with Q at `temperature`, β = `beta`.
    4. Selective supervision from the teacher's confidence, its entropy H_i in nats at τ = 1
       (for top-k transport the entropy of the lumped k + 1 atoms, a lower bound):
       `weighting` "none": w_i = 1; "gate": w_i = 1[H_i <= entropy_gate];
       "exp": w_i = exp(−H_i / weight_temperature).
    5. loss = Σ_i w_i d_i / Σ_i w_i over the generated positions (self-normalized; 0 when
       every position is gated out).  Weights carry no gradient.

    Defaults are a starting point, not tuned values from the paper.
    """

    beta: float = BETA.default
    temperature: float = TEMPERATURE.default
    teacher_temperature: float = 1.0
    smoothing: float = 0.1
    smoothing_topk: int = 8
    weighting: str = "exp"
    entropy_gate: float = 4.0
    weight_temperature: float = 1.0
    needs: ClassVar[tuple[str, ...]] = ("full", "topk")
    accepts: ClassVar[tuple[str, ...]] = ("student",)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_unit("varkd.smoothing", self.smoothing)
        _check_positive("varkd.teacher_temperature", self.teacher_temperature)
        _check_positive("varkd.weight_temperature", self.weight_temperature)
        if self.smoothing_topk < 1:
            raise ValueError(f"varkd.smoothing_topk must be >= 1, got {self.smoothing_topk}")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"varkd.weighting must be one of {WEIGHTINGS}, got {self.weighting!r}")

    def weights(self, teacher_entropy: Tensor) -> Tensor:
        """Per-position weights (N,) from teacher entropies (N,) in nats."""
        if self.weighting == "gate":
            return (teacher_entropy <= self.entropy_gate).to(teacher_entropy.dtype)
        if self.weighting == "exp":
            return torch.exp(-teacher_entropy / self.weight_temperature)
        return torch.ones_like(teacher_entropy)

    def smooth(self, teacher_logp: Tensor, num_tokens: int) -> Tensor:
        """P' = (1 − α)·P + α·Uniform(top-k of P) over atoms (N, A) -> (N, A) log-probs; only the
        first `num_tokens` atoms are tokens (a trailing rest atom is never in the top-k)."""
        if self.smoothing == 0.0:
            return teacher_logp
        k = min(self.smoothing_topk, num_tokens)
        top = teacher_logp[:, :num_tokens].topk(k, dim=-1).indices                   # (N, k)
        uniform = torch.zeros_like(teacher_logp).scatter(-1, top, 1.0 / k)
        p = (1.0 - self.smoothing) * teacher_logp.exp() + self.smoothing * uniform
        return p.log()

    def _loss(self, student_logits: Tensor, batch: TrajectoryBatch) -> tuple[Tensor, dict[str, float]]:
        logits, teacher, mask = scored_positions(student_logits, batch)
        s, t = valid_atoms(logits, teacher, mask)                                   # (N, A)
        num_tokens = t.shape[-1] if teacher.indices is None else teacher.indices.shape[-1]
        h = entropy(t).detach()                                                     # (N,)
        w = self.weights(h)
        target = self.smooth(temper(t, self.teacher_temperature), num_tokens)
        d = jsd(temper(s, self.temperature), target, beta=self.beta)                 # (N,)
        loss = masked_mean(d, w)
        n = max(d.numel(), 1)
        return loss, {
            "teacher_entropy": float(h.sum()) / n,
            "weight_mean": float(w.sum()) / n,
            "kept_fraction": float((w > 0).sum()) / n,
            "divergence": float(masked_mean(d.detach())),
        }
