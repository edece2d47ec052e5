"""Safe loading of LlamaGen checkpoints (`c2i_*.pt`, `vq_ds16_c2i.pt`) and of our own weights.

`torch.load(weights_only=True)` only rebuilds tensors and plain containers; we allow exactly one
extra class, `argparse.Namespace`, which LlamaGen's training checkpoints pickle under `args`.
A file whose pickle asks for anything else (a function call, an arbitrary class) is refused.
"""
from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import torch
from torch import Tensor, nn

WEIGHT_KEYS = ("model", "module", "state_dict")       # where LlamaGen files keep the weights
STRIP_PREFIXES = ("module.", "_orig_mod.", "_forward_module.")
IGNORED_KEYS = ("freqs_cis",)                          # older LlamaGen files carry the RoPE table


class CheckpointError(ValueError):
    """A checkpoint file that is missing, unsafe or does not fit the model."""


def _looks_like_torch_save(path: Path) -> bool:
    """torch.save writes a zip archive (torch >= 1.6; local-header magic "PK\\3\\4") or, in the
    legacy format, a pickle stream (PROTO opcode 0x80).  Only the start is read: a truncated
    checkpoint still looks like one, and torch.load then names what is wrong with it."""
    with open(path, "rb") as f:
        head = f.read(4)
    return head[:1] == b"\x80" or head == b"PK\x03\x04"


def _looks_like_safetensors(path: Path) -> bool:
    """safetensors: an 8-byte little-endian header length, then the header's JSON object."""
    with open(path, "rb") as f:
        head = f.read(9)
    return (len(head) == 9 and head[8:9] == b"{"
            and 0 < int.from_bytes(head[:8], "little") <= path.stat().st_size - 8)


def _load_safetensors(path: Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read safetensors file {path}: "
                              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def load_state_dict_safely(path: str | Path) -> dict[str, Tensor]:
    """Return the weights of a LlamaGen-style file: under `model`, else `module`, else
    `state_dict`, else the file itself; DDP/compile prefixes stripped, `freqs_cis` dropped.
    A safetensors file (`opd export --format safetensors`) is read as it is: tensors only."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist; check the path "
                              "(model.student_ckpt / model.teacher_ckpt in the config)")
    if _looks_like_safetensors(path):
        return _strip(_load_safetensors(path))
    if not _looks_like_torch_save(path):
        raise CheckpointError(f"{path} is not a checkpoint (neither a file written by torch.save "
                              "nor safetensors); pass a LlamaGen c2i_*.pt, a .safetensors file, "
                              "a run's checkpoints/step_N/student.pt or a run directory")
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"refused to load {path}: its pickle asks for code or classes a weights file does "
            f"not need ({reason[:200]}); re-save it as a plain state dict if you trust it"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {str(e).splitlines()[0]}") from None
    state = obj
    if isinstance(obj, dict):
        for key in WEIGHT_KEYS:
            if isinstance(obj.get(key), dict):
                state = obj[key]
                break
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"{path} holds no state dict of tensors (looked under "
                              f"{', '.join(WEIGHT_KEYS)} and at the top level)")
    return _strip(state)


def _strip(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """DDP/compile prefixes removed, IGNORED_KEYS dropped."""
    out = {}
    for key, value in state.items():
        for prefix in STRIP_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix):]
        if key.split(".")[-1] not in IGNORED_KEYS:
            out[key] = value
    return out


def load_into(model: nn.Module, state: dict[str, Tensor], source: str) -> None:
    """Strictly load `state` into `model`; list missing, unexpected and mis-shaped keys."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = sorted(f"{k}: file {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
                    for k in set(own) & set(state) if state[k].shape != own[k].shape)
    if missing or unexpected or shapes:
        def show(items):
            return ", ".join(items[:6]) + (f" (+{len(items) - 6} more)" if len(items) > 6 else "")
        parts = [f"{name} [{show(items)}]" for name, items in
                 (("missing keys", missing), ("unexpected keys", unexpected),
                  ("mis-shaped keys", shapes)) if items]
        raise CheckpointError(f"{source} does not fit the model: " + "; ".join(parts)
                              + "; check that the preset (and vocab/grid overrides) match the file")
    dtypes = sorted(f"{k}: {str(v.dtype).replace('torch.', '')}" for k, v in state.items()
                    if own[k].is_floating_point() and not v.is_floating_point())
    if dtypes:                  # a cast would drop imaginary parts or load integer codes silently
        raise CheckpointError(f"{source} holds tensors that are not real floating point "
                              f"[{', '.join(dtypes[:6])}]; pass a checkpoint of float weights")
    bad = sorted(k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all())
    if bad:
        raise CheckpointError(f"{source} holds NaN or infinite weights in [{', '.join(bad[:6])}"
                              f"{f' (+{len(bad) - 6} more)' if len(bad) > 6 else ''}]; pass "
                              f"another checkpoint (an earlier step of the run that wrote it)")
    with torch.no_grad():
        model.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()}, strict=True)
