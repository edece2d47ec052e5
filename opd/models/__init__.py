"""LlamaGen-compatible models: the class-conditional GPT and (in vq.py) the VQ-16 decoder."""
from __future__ import annotations

from pathlib import Path

from opd.models.args import PRESETS, ModelArgs, preset_args
from opd.models.safe_load import CheckpointError, load_into, load_state_dict_safely
from opd.models.gpt import GPT


def create_model(preset: str, **overrides) -> GPT:
    """A freshly initialised GPT of a named preset; overrides replace ModelArgs fields."""
    return GPT(preset_args(preset, **overrides))


def load_llamagen_checkpoint(path: str | Path, preset: str, **overrides) -> GPT:
    """A GPT of `preset` with the weights of a LlamaGen `c2i_*.pt` (or our own) file, loaded
    strictly and without executing pickled code."""
    model = create_model(preset, **overrides)
    load_into(model, load_state_dict_safely(path), str(path))
    return model


__all__ = ["GPT", "ModelArgs", "PRESETS", "CheckpointError", "create_model",
           "load_llamagen_checkpoint", "load_state_dict_safely", "load_into", "preset_args"]
