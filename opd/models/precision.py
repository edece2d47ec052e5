"""The precision each role of a run computes in: one rule, read by both run modes.

    role                         parameters        forward
    rollout (student copies)     model.dtype       model.dtype
    teacher (scoring, SeqKD)     model.dtype       model.dtype
    evaluation (student copy)    model.dtype       model.dtype
    learner                      float32           bf16 autocast when learner.precision
                                                   resolves to bf16, else float32

`learner.precision` "auto" resolves to bf16 on a CUDA device that supports it, else fp32 (so a
CPU run of a GPU preset set to "auto" trains in float32).  The learner keeps float32 weights,
gradients and AdamW state and only its forward autocasts (torch AMP): the reference loop and the
DeepSpeed learner (its `torch_autocast` section) then do the same arithmetic, so the distributed
run equals the reference in bf16 as in float32 (invariant 5, docs/ARCHITECTURE.md).  Rollout
copies receive the learner's float32 weights cast to model.dtype (round to nearest), in the
reference loop as from the object store.

Whatever the model's dtype, logits leave the model in float32 (opd/models/gpt.py), and every
probability, acceptance test and log-prob of rollout/ and of the losses is float32 (uniforms
float64): bf16 is a property of the weights and the matmuls, never of a distribution.
"""
from __future__ import annotations

import contextlib
import copy

import torch

from opd.config.schema import RunConfig

ROLES = ("rollout", "teacher", "evaluation", "learner")
LEARNER_DTYPE = torch.float32


def role_dtype(cfg: RunConfig, role: str) -> torch.dtype:
    """The parameter dtype of `role`'s model (the table above)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return LEARNER_DTYPE if role == "learner" else getattr(torch, cfg.model.dtype)


def learner_autocast(cfg: RunConfig, device: torch.device | str) -> torch.dtype | None:
    """The dtype the learner's forward autocasts to on `device` (bf16), or None (float32)."""
    device = torch.device(device)
    p = cfg.learner.precision
    if p == "auto":
        p = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    return torch.bfloat16 if p == "bf16" else None


def autocast(dtype: torch.dtype | None, device: torch.device | str) -> contextlib.AbstractContextManager:
    """torch.autocast to `dtype` on `device`'s type; a no-op for None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def deepspeed_precision(cfg: RunConfig, device: torch.device | str) -> dict:
    """The DeepSpeed config sections of the learner's precision: float32 engine (its bf16 mode
    would hold bf16 weights, which the reference loop does not), autocast as `learner_autocast`.
    DeepSpeed's forward turns an outer torch.autocast off unless its own section is on."""
    dtype = learner_autocast(cfg, device)
    return {"bf16": {"enabled": False}, "fp16": {"enabled": False},
            "torch_autocast": {"enabled": dtype is not None, "dtype": "bfloat16"}}


def to_role(model: torch.nn.Module, cfg: RunConfig, role: str,
            device: torch.device | str | None = None) -> torch.nn.Module:
    """`model` on `device` in `role`'s dtype; frozen and in eval mode unless it is the learner's."""
    model = model.to(device=device, dtype=role_dtype(cfg, role))
    return model if role == "learner" else model.eval().requires_grad_(False)


class RolloutCopy:
    """The reference loop's student as the rollout workers hold it: the student itself when
    model.dtype is the learner's float32, else a frozen copy in model.dtype whose weights
    `__call__` refreshes from the student (a cast, as `load_numpy_weights` does)."""

    def __init__(self, cfg: RunConfig, student: torch.nn.Module):
        same = role_dtype(cfg, "rollout") == next(student.parameters()).dtype
        self.model = student
        if not same:
            self.model = to_role(copy.deepcopy(student), cfg, "rollout")   # draws no random numbers

    def __call__(self, student: torch.nn.Module) -> torch.nn.Module:
        """The copy, holding `student`'s current weights."""
        if self.model is not student:
            source = student.state_dict()
            with torch.no_grad():
                for name, target in self.model.state_dict().items():
                    target.copy_(source[name])
        return self.model
