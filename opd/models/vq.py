"""Image tokenizers' decode paths: LlamaGen's VQ-16 and the embedded digits grey-level codec.

`VQModel` reproduces the module tree of LlamaGen's `tokenizer/tokenizer_image/vq_model.py`
(docs/FACTS.md §2) so that the released `vq_ds16_c2i.pt` loads strictly: encoder, decoder,
`quantize.embedding` (16384 × 8, L2-normalized at lookup), `quant_conv` (256→8) and
`post_quant_conv` (8→256).  Decode: codes (B, h·w) → normalized codebook rows (B, 8, h, w)
→ `post_quant_conv` → decoder → image (B, 3, 16h, 16w) in about [−1, 1].

Decoder key layout (ch_mult [1, 1, 2, 2, 4], 2 res blocks per level; the up path has one res
block more per level, walked from the lowest resolution up):

    decoder.conv_in                       256 → 512
    decoder.mid.{0,1,2}                   res, attn, res at 512
    decoder.conv_blocks.0.res.{0,1,2}     512 (+ .attn.{0,1,2}, + .upsample.conv)
    decoder.conv_blocks.1.res.{0,1,2}     512 → 256 (+ .upsample.conv)
    decoder.conv_blocks.2.res.{0,1,2}     256 (+ .upsample.conv)
    decoder.conv_blocks.3.res.{0,1,2}     256 → 128 (+ .upsample.conv)
    decoder.conv_blocks.4.res.{0,1,2}     128
    decoder.norm_out, decoder.conv_out    128 → 3

`DigitsDecoder` is the same interface for the embedded digits dataset, whose tokens are pixels:
token t ∈ 0..16 is the grey value t·255/16 (tokenizations digits8-v1 / digits16-v1 in `opd.data`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from opd.data import DIGITS_GRID, DIGITS_VOCAB, digits_tokens_to_images
from opd.models.safe_load import load_into, load_state_dict_safely


@dataclass(frozen=True)
class VQArgs:
    """VQ-16 tokenizer shape. Defaults are LlamaGen's `VQ_16` (`vq_ds16_c2i.pt`)."""

    codebook_size: int = 16384
    codebook_embed_dim: int = 8
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    z_channels: int = 256
    num_res_blocks: int = 2
    in_channels: int = 3
    out_channels: int = 3
    # LlamaGen keeps a rolling buffer of recent code ids (`quantize.codebook_used`) in its state dict.
    codebook_used_size: int = 65536

    @property
    def downsample(self) -> int:
        """Pixels per code along one side (16 for VQ-16)."""
        return 2 ** (len(self.ch_mult) - 1)


def swish(x: Tensor) -> Tensor:
    return x * torch.sigmoid(x)


def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=32, num_channels=channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    """norm → swish → conv3 → norm → swish → conv3, plus a (1×1 when channels change) skip."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.norm1 = group_norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, 1, 1)
        self.norm2 = group_norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1)
        self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(swish(self.norm2(h)))
        skip = x if self.nin_shortcut is None else self.nin_shortcut(x)
        return skip + h


class AttnBlock(nn.Module):
    """Single-head spatial self-attention with 1×1 q/k/v/proj_out convs; x: (B, C, H, W)."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = group_norm(channels)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        b, c, hh, ww = x.shape
        h = self.norm(x)
        q = self.q(h).flatten(2).transpose(1, 2)  # (B, HW, C)
        k = self.k(h).flatten(2).transpose(1, 2)
        v = self.v(h).flatten(2).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v)  # softmax(q kᵀ / √C) v
        return x + self.proj_out(out.transpose(1, 2).reshape(b, c, hh, ww))


class Upsample(nn.Module):
    """Nearest 2× upsampling then conv3."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Downsample(nn.Module):
    """Pad (0, 1, 0, 1) then stride-2 conv3 (halves H and W)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, 2, 0)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class _Level(nn.Module):
    """One resolution level: `res` blocks, `attn` blocks (lowest resolution only), resampler."""

    def __init__(self, res: list[nn.Module], attn: list[nn.Module], resample: nn.Module | None,
                 resample_name: str):
        super().__init__()
        self.res = nn.ModuleList(res)
        self.attn = nn.ModuleList(attn)
        if resample is not None:
            setattr(self, resample_name, resample)

    def blocks(self, h: Tensor) -> Tensor:
        for i, res in enumerate(self.res):
            h = res(h)
            if len(self.attn) > 0:
                h = self.attn[i](h)
        return h


class Encoder(nn.Module):
    """Image (B, in_channels, H, W) → latent (B, z_channels, H/16, W/16)."""

    def __init__(self, a: VQArgs):
        super().__init__()
        n = len(a.ch_mult)
        self.conv_in = nn.Conv2d(a.in_channels, a.ch, 3, 1, 1)
        in_mult = (1,) + tuple(a.ch_mult)
        self.conv_blocks = nn.ModuleList()
        block_in = a.ch
        for level in range(n):
            block_in, block_out = a.ch * in_mult[level], a.ch * a.ch_mult[level]
            res, attn = [], []
            for _ in range(a.num_res_blocks):
                res.append(ResnetBlock(block_in, block_out))
                block_in = block_out
                if level == n - 1:
                    attn.append(AttnBlock(block_in))
            down = Downsample(block_in) if level != n - 1 else None
            self.conv_blocks.append(_Level(res, attn, down, "downsample"))
        self.mid = nn.ModuleList([ResnetBlock(block_in, block_in), AttnBlock(block_in),
                                  ResnetBlock(block_in, block_in)])
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, a.z_channels, 3, 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv_in(x)
        for level in self.conv_blocks:
            h = level.blocks(h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)
        for block in self.mid:
            h = block(h)
        return self.conv_out(swish(self.norm_out(h)))


class Decoder(nn.Module):
    """Latent (B, z_channels, h, w) → image (B, out_channels, 16h, 16w) in about [−1, 1]."""

    def __init__(self, a: VQArgs):
        super().__init__()
        n = len(a.ch_mult)
        block_in = a.ch * a.ch_mult[-1]
        self.conv_in = nn.Conv2d(a.z_channels, block_in, 3, 1, 1)
        self.mid = nn.ModuleList([ResnetBlock(block_in, block_in), AttnBlock(block_in),
                                  ResnetBlock(block_in, block_in)])
        self.conv_blocks = nn.ModuleList()
        for level in reversed(range(n)):  # lowest resolution first
            block_out = a.ch * a.ch_mult[level]
            res, attn = [], []
            for _ in range(a.num_res_blocks + 1):
                res.append(ResnetBlock(block_in, block_out))
                block_in = block_out
                if level == n - 1:
                    attn.append(AttnBlock(block_in))
            up = Upsample(block_in) if level != 0 else None
            self.conv_blocks.append(_Level(res, attn, up, "upsample"))
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, a.out_channels, 3, 1, 1)

    def forward(self, z: Tensor) -> Tensor:
        h = self.conv_in(z)
        for block in self.mid:
            h = block(h)
        for level in self.conv_blocks:
            h = level.blocks(h)
            if hasattr(level, "upsample"):
                h = level.upsample(h)
        return self.conv_out(swish(self.norm_out(h)))


class VectorQuantizer(nn.Module):
    """Codebook `embedding.weight` (K, D); lookups use L2-normalized rows."""

    def __init__(self, a: VQArgs):
        super().__init__()
        self.embedding = nn.Embedding(a.codebook_size, a.codebook_embed_dim)
        self.register_buffer("codebook_used", torch.zeros(a.codebook_used_size))

    def codebook(self) -> Tensor:
        """(K, D) L2-normalized code vectors."""
        return F.normalize(self.embedding.weight, p=2, dim=-1)

    def lookup(self, codes: Tensor, h: int, w: int) -> Tensor:
        """codes (B, h·w) int64 raster order → (B, D, h, w)."""
        z = self.codebook()[codes]  # (B, h·w, D)
        return z.reshape(codes.shape[0], h, w, -1).permute(0, 3, 1, 2).contiguous()


class VQModel(nn.Module):
    """LlamaGen's VQ tokenizer (same state-dict keys); used here for decoding GPT samples."""

    def __init__(self, args: VQArgs = VQArgs()):
        super().__init__()
        self.args = args
        self.encoder = Encoder(args)
        self.decoder = Decoder(args)
        self.quantize = VectorQuantizer(args)
        self.quant_conv = nn.Conv2d(args.z_channels, args.codebook_embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(args.codebook_embed_dim, args.z_channels, 1)

    def decode_codes(self, codes: Tensor, grid: tuple[int, int] | None = None) -> Tensor:
        """codes (B, h·w) int64 (square grid unless `grid`=(h, w)) → images (B, 3, 16h, 16w) float ≈[−1, 1]."""
        h, w = grid if grid is not None else _square_grid(codes.shape[-1])
        z = self.quantize.lookup(codes.long(), h, w).to(self.post_quant_conv.weight.dtype)
        return self.decoder(self.post_quant_conv(z))


def _square_grid(n: int) -> tuple[int, int]:
    side = int(round(n ** 0.5))
    if side * side != n:
        raise ValueError(f"{n} codes do not form a square grid; pass grid=(h, w)")
    return side, side


def to_uint8(images: Tensor) -> Tensor:
    """float images ≈[−1, 1] (any shape) → uint8 pixels clamp(127.5·x + 128, 0, 255) (LlamaGen)."""
    return torch.clamp(127.5 * images.float() + 128.0, 0, 255).to(torch.uint8)


def create_vq16(**overrides) -> VQModel:
    """LlamaGen's VQ-16 (`vq_ds16_c2i.pt` shapes); `overrides` change VQArgs fields (tests use tiny ones)."""
    if "ch_mult" in overrides:
        overrides["ch_mult"] = tuple(overrides["ch_mult"])
    return VQModel(VQArgs(**overrides))


def load_vq_checkpoint(path: str | os.PathLike, *, device: str | torch.device = "cpu", **overrides) -> VQModel:
    """VQModel in eval mode with weights from a LlamaGen VQ file (e.g. `vq_ds16_c2i.pt`), loaded strictly.

    Read with `opd.models.safe_load.load_state_dict_safely` (no pickled code runs).  A missing
    `quantize.codebook_used` (training bookkeeping only) is tolerated; any other missing,
    unexpected or mis-shaped key raises `CheckpointError` naming it.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"VQ tokenizer checkpoint {str(path)!r} not found (model.vq_ckpt: LlamaGen's "
                                f"vq_ds16_c2i.pt, or unset it for digits, whose tokens are pixels)")
    state = load_state_dict_safely(path)
    model = create_vq16(**overrides)
    state.setdefault("quantize.codebook_used", model.quantize.codebook_used.clone())
    load_into(model, state, f"VQ checkpoint {path}")
    return model.to(device).eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------
# Digits (embedded default dataset): 17 grey levels, one token per pixel of an 8×8 or 16×16 grid.

class DigitsDecoder(nn.Module):
    """The inverse of the digits tokenizations (`opd.data`), with VQModel's `decode_codes` interface.

    Token t ∈ 0..16 is a grey level; its pixel is ⌊t·255/16 + ½⌋, which equals
    `to_uint8(decode_codes(t))`.  No weights.
    """

    def __init__(self, side: int = DIGITS_GRID):
        super().__init__()
        self.side = side

    def decode_codes(self, codes: Tensor, grid: tuple[int, int] | None = None) -> Tensor:
        """codes (B, side²) in 0..16 → (B, 3, side, side) float in [−1, 1] (t·2/16 − 1)."""
        h, w = grid if grid is not None else (self.side, self.side)
        x = codes.float().reshape(-1, 1, h, w) * (2.0 / (DIGITS_VOCAB - 1)) - 1.0
        return x.expand(-1, 3, -1, -1).contiguous()

    def decode_uint8(self, codes: Tensor) -> Tensor:
        """codes (B, 64 or 256) in 0..16 → uint8 (B, 3, 16, 16) via `opd.data.digits_tokens_to_images`."""
        grey = torch.from_numpy(digits_tokens_to_images(codes))  # (B, 16, 16)
        return grey.unsqueeze(1).expand(-1, 3, -1, -1).contiguous()
