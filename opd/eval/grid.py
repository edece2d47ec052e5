"""Sample grids: uint8 images tiled into one PNG."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from PIL import Image
from torch import Tensor


def make_grid(images: Tensor, nrow: int = 8, upscale: int = 1, padding: int = 2, pad_value: int = 0) -> Tensor:
    """uint8 images (N, 3, H, W) or grey (N, H, W) → one uint8 grid (3, R·(sH+p)+p, C·(sW+p)+p).

    `nrow` images per row (C = min(nrow, N) columns, R = ⌈N/nrow⌉ rows), each upscaled `upscale`×
    (nearest) and separated by `padding` pixels of `pad_value`; empty cells are `pad_value`.
    """
    if images.dtype != torch.uint8:
        raise ValueError(f"images must be uint8 pixels, got {images.dtype}")
    if images.dim() == 3:
        images = images.unsqueeze(1)
    if images.dim() != 4 or images.shape[1] not in (1, 3) or images.shape[0] == 0:
        raise ValueError(f"images must be (N, 3, H, W) or (N, H, W) with N >= 1, got {tuple(images.shape)}")
    if nrow < 1 or upscale < 1 or padding < 0:
        raise ValueError(f"need nrow >= 1, upscale >= 1, padding >= 0; got {nrow}, {upscale}, {padding}")
    images = images.detach().cpu().expand(-1, 3, -1, -1)
    if upscale > 1:
        images = images.repeat_interleave(upscale, dim=2).repeat_interleave(upscale, dim=3)
    n, _, h, w = images.shape
    cols, rows = min(nrow, n), -(-n // nrow)
    grid = torch.full((3, rows * (h + padding) + padding, cols * (w + padding) + padding), pad_value,
                      dtype=torch.uint8)
    for i in range(n):
        y, x = padding + (i // cols) * (h + padding), padding + (i % cols) * (w + padding)
        grid[:, y:y + h, x:x + w] = images[i]
    return grid


def save_grid(images: Tensor, path: str | os.PathLike, nrow: int = 8, upscale: int = 1,
              padding: int = 2) -> Path:
    """Write `make_grid(images, nrow, upscale, padding)` as an RGB PNG at `path` (parents created)."""
    grid = make_grid(images, nrow=nrow, upscale=upscale, padding=padding)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid.permute(1, 2, 0).contiguous().numpy()).save(path, format="PNG")
    return path
