"""The model and data sections of a run config: which networks, on which token sequences.

    cfg.model.student, cfg.model.grid_size      # "GPT-digits-S", 8
    cfg.data.batch_size                         # 32

Sections of the run config's schema (opd/config/root.py joins them; opd/config/schema.py
loads them): every key with the docstring users read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

DType = Literal["float32", "bfloat16", "float64"]


@dataclass
class ModelConfig:
    """Student and teacher networks (presets from the model registry, e.g. `GPT-B`)."""

    student: str = "GPT-digits-S"
    """Student model preset name."""
    teacher: str = "GPT-digits-T"
    """Teacher model preset name."""
    student_ckpt: str | None = None
    """Student weights to start from; None = pretrain one (or reuse the cached pretrained model)."""
    teacher_ckpt: str | None = None
    """Teacher weights; None = pretrain one (or reuse the cached pretrained model)."""
    vocab_size: Annotated[int, Field(ge=2)] = 17
    """Image token ids (17 grey levels for digits; 16384 for the VQ-16 codebook)."""
    num_classes: Annotated[int, Field(ge=1)] = 10
    """Class labels 0..num_classes-1; label num_classes is the null class used by CFG."""
    grid_size: Annotated[int, Field(ge=1)] = 8
    """Token grid side; a sequence has grid_size ** 2 image tokens (digits: 8 native pixels, or 16)."""
    vq_ckpt: str | None = None
    """VQ-16 tokenizer checkpoint to decode tokens to pixels; None = tokens are pixels (digits)."""
    dtype: DType = "float32"
    """Parameter / compute dtype of rollout and teacher copies."""


@dataclass
class DataConfig:
    """Where the class-labelled token sequences come from."""

    dataset: Literal["digits", "parquet"] = "digits"
    """`digits`: the embedded UCI digits set (`opd prepare digits`); `parquet`: LlamaGen codes."""
    data_dir: str = "data/digits8"
    """Directory written by `opd prepare` (digits: prepared there on first use for model.grid_size)."""
    train: str = ""
    """Training split file; "" = derived from data_dir."""
    heldout: str = ""
    """Held-out split file (evaluation references); "" = derived from data_dir."""
    prefix_ratio: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    """Fraction of each sequence taken from data as the prompt; the student generates the rest
    (every training batch, unless prefix_ratios is set; always for held-out on-policy KL)."""
    prefix_ratios: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], ...] = ()
    """Training prefix ratios to spread over: each batch takes one, chosen by (run.seed, batch
    id); () = always prefix_ratio. 0 trains whole images from the class token, which sampling
    from scratch (evaluation) needs; the paper varies the ratio from 0.75 to 0.20."""
    batch_size: Annotated[int, Field(ge=1)] = 32
    """Sequences per training step (prefix batch size)."""
