"""Model arguments and named presets, in the mould of LlamaGen's `ModelArgs` / `GPT_models`.

The LlamaGen presets (docs/FACTS.md §1) have head_dim 64 and the VQ-16 vocabulary; the
`GPT-digits-*` presets are the embedded default (17 grey levels on an 8×8 grid by default,
10 classes) and `GPT-tiny` is for tests.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None      # None: same as n_head (no grouped-query attention)
    multiple_of: int = 256            # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    vocab_size: int = 16384
    num_classes: int = 1000
    grid_size: int = 16               # image tokens per row; block_size = grid_size ** 2
    cls_token_num: int = 1
    class_dropout_prob: float = 0.1   # label -> null class, in train mode only
    token_dropout_p: float = 0.0      # LlamaGen trains with 0.1; off by default here
    resid_dropout_p: float = 0.0
    ffn_dropout_p: float = 0.0

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def block_size(self) -> int:
        return self.grid_size ** 2

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def validate(self) -> None:
        if self.dim % self.n_head:
            raise ValueError(f"model dim {self.dim} is not divisible by n_head {self.n_head}")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_kv_head {self.kv_heads}")
        if self.head_dim % 4:
            raise ValueError(f"head_dim {self.head_dim} must be a multiple of 4 for 2D RoPE")
        if self.cls_token_num != 1:
            raise ValueError("only cls_token_num=1 (class-conditional LlamaGen) is supported")
        for name in ("vocab_size", "num_classes", "grid_size", "n_layer"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name} must be >= 1, got {getattr(self, name)}")


_LLAMAGEN = dict(vocab_size=16384, num_classes=1000, grid_size=16)
_DIGITS = dict(vocab_size=17, num_classes=10, grid_size=8, multiple_of=32)

PRESETS: dict[str, dict] = {
    # LlamaGen class-conditional presets (c2i); grid_size 16 = 256 px, 24 = 384 px.
    "GPT-B": dict(n_layer=12, n_head=12, dim=768, **_LLAMAGEN),
    "GPT-L": dict(n_layer=24, n_head=16, dim=1024, **_LLAMAGEN),
    "GPT-XL": dict(n_layer=36, n_head=20, dim=1280, **_LLAMAGEN),
    "GPT-XXL": dict(n_layer=48, n_head=24, dim=1536, **_LLAMAGEN),
    "GPT-XXXL": dict(n_layer=48, n_head=40, dim=2560, **_LLAMAGEN),
    "GPT-3B": dict(n_layer=24, n_head=32, dim=3200, **_LLAMAGEN),
    # The embedded digits default: teacher and (smaller) student.
    "GPT-digits-T": dict(n_layer=4, n_head=4, dim=128, **_DIGITS),
    "GPT-digits-S": dict(n_layer=2, n_head=2, dim=64, **_DIGITS),
    # Tests.
    "GPT-tiny": dict(n_layer=2, n_head=2, dim=32, vocab_size=11, num_classes=4, grid_size=4,
                     multiple_of=16),
}


def preset_args(preset: str, **overrides) -> ModelArgs:
    """ModelArgs of a named preset with field overrides (vocab_size, grid_size, n_kv_head, ...)."""
    if preset not in PRESETS:
        lower = {name.lower(): name for name in PRESETS}
        close = [lower[c] for c in difflib.get_close_matches(preset.lower(), lower, n=1)]
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown model preset {preset!r}{hint}; known: {', '.join(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(ModelArgs)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown model argument(s) {unknown}; known: {sorted(fields)}")
    args = ModelArgs(**{**PRESETS[preset], **overrides})
    args.validate()
    return args
