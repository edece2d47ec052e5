"""The embedded default dataset: scikit-learn digits, tokenizations digits8-v1 and digits16-v1.

- digits8-v1 (the default, grid 8): the native 8x8 image, one token per pixel, grey level 0..16.
- digits16-v1 (grid 16): the image upsampled bilinearly to 16x16 and rounded to the 17 levels,
  256 tokens like LlamaGen at 256 px; 4x the sequence length for the same information.
Both decode to the same 16x16 uint8 pixels (`digits_tokens_to_images`), so samples of either
are measured by one digits CNN against one reference.
"""


from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from opd.data.format import DataError, write_token_parquet

DIGITS_GRID, DIGITS_VOCAB, DIGITS_CLASSES = 8, 17, 10   # the default grid: the native 8x8
DIGITS_SIDE = 16                                         # decoded images are 16x16 pixels
DIGITS_TOKENIZERS = {8: "digits8-v1", 16: "digits16-v1"}  # grid_size -> tokenizer name
DIGITS_HELDOUT_PER_CLASS, DIGITS_SPLIT_SEED = 20, 0


def bilinear_matrix(src: int, dst: int) -> np.ndarray:
    """(dst, src) float64 1-D linear interpolation with aligned corners: x_i = i*(src-1)/(dst-1)."""
    a = np.zeros((dst, src), dtype=np.float64)
    for i in range(dst):
        num, den = i * (src - 1), max(dst - 1, 1)
        lo = min(num // den, src - 2) if src > 1 else 0
        frac = (num - lo * den) / den
        a[i, lo] += 1.0 - frac
        if src > 1:
            a[i, lo + 1] += frac
    return a


def digits_upsample(images: np.ndarray) -> np.ndarray:
    """images: (N, 8, 8) grey levels 0..16 -> (N, 16, 16) float64, bilinear, aligned corners."""
    a = bilinear_matrix(images.shape[-1], DIGITS_SIDE)
    return np.einsum("ij,njk,lk->nil", a, np.asarray(images, dtype=np.float64), a)


def _upsampled_levels(images: np.ndarray) -> np.ndarray:
    """(N, 8, 8) levels -> (N, 16, 16) int64 levels: bilinear, rounded (never a tie, see opd.data)."""
    return np.clip(np.rint(digits_upsample(images)), 0, DIGITS_VOCAB - 1).astype(np.int64)


def digits_images_to_tokens(images: np.ndarray, grid: int = DIGITS_GRID) -> np.ndarray:
    """images: (N, 8, 8) grey levels 0..16 -> tokens (N, grid²) int64 in [0, 16]: the pixels
    themselves for grid 8 (digits8-v1), the bilinear 16x16 levels for grid 16 (digits16-v1)."""
    if grid not in DIGITS_TOKENIZERS:
        raise DataError(f"digits grid_size={grid} has no tokenization; use one of {sorted(DIGITS_TOKENIZERS)}")
    images = np.asarray(images)
    levels = images.astype(np.int64) if grid == images.shape[-1] else _upsampled_levels(images)
    return levels.reshape(len(levels), grid * grid)


def digits_tokens_to_images(tokens: np.ndarray | torch.Tensor) -> np.ndarray:
    """tokens: (N, 64) or (N, 256) grey levels 0..16 -> (N, 16, 16) uint8 pixels
    round_half_up(level * 255 / 16); 8x8 grids are upsampled to 16x16 levels first, exactly as
    digits16-v1 tokenizes, so both tokenizations decode a data image to the same pixels."""
    t = np.asarray(tokens.cpu() if isinstance(tokens, torch.Tensor) else tokens).astype(np.int64)
    sides = {g * g: g for g in DIGITS_TOKENIZERS}
    if t.ndim != 2 or t.shape[1] not in sides or t.min(initial=0) < 0 or t.max(initial=0) >= DIGITS_VOCAB:
        raise DataError(
            f"digits tokens must be (N, 64) or (N, 256) ints in [0, {DIGITS_VOCAB}), got shape {t.shape}; "
            "decode only sequences produced with the digits8-v1 or digits16-v1 tokenization."
        )
    side = sides[t.shape[1]]
    if side != DIGITS_SIDE:
        t = _upsampled_levels(t.reshape(len(t), side, side)).reshape(len(t), -1)
    pixels = (t * 510 + 16) // 32  # floor(level * 255 / 16 + 1/2): half-up, as opd.models.vq
    return pixels.astype(np.uint8).reshape(len(t), DIGITS_SIDE, DIGITS_SIDE)


def digits_split(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """labels: (N,) -> (train_rows, heldout_rows), sorted int64; 20 held-out rows per class."""
    heldout = []
    for c in range(DIGITS_CLASSES):
        rows = np.flatnonzero(labels == c)
        perm = np.random.default_rng([DIGITS_SPLIT_SEED, c]).permutation(len(rows))
        heldout.append(rows[perm[:DIGITS_HELDOUT_PER_CLASS]])
    held = np.sort(np.concatenate(heldout)).astype(np.int64)
    train = np.setdiff1d(np.arange(len(labels)), held).astype(np.int64)
    return train, held


def _sha256_arrays(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prepare_digits(out_dir: str | os.PathLike, grid_size: int = DIGITS_GRID) -> dict[str, Path]:
    """Write train.parquet (1597 rows), heldout.parquet (200 rows) and manifest.json under out_dir,
    tokenized for `grid_size` (8: digits8-v1, 16: digits16-v1).

    Idempotent: files whose manifest records the same tokenizer, content hash and file hash are
    reused untouched; files of another tokenization are rewritten. Returns {"train", "heldout",
    "manifest"} -> path.
    """
    from sklearn.datasets import load_digits

    out = Path(out_dir)
    digits = load_digits()
    labels = np.asarray(digits.target, dtype=np.int64)
    tokens = digits_images_to_tokens(digits.images, grid_size)
    tokenizer = DIGITS_TOKENIZERS[grid_size]
    splits = dict(zip(("train", "heldout"), digits_split(labels)))
    paths = {name: out / f"{name}.parquet" for name in splits} | {"manifest": out / "manifest.json"}
    content = {name: _sha256_arrays(rows, labels[rows], tokens[rows]) for name, rows in splits.items()}
    try:
        old = json.loads(paths["manifest"].read_text())
        if old["tokenizer"] == tokenizer and all(
            old["splits"][name]["content_sha256"] == content[name]
            and _sha256_file(paths[name]) == old["splits"][name]["file_sha256"]
            for name in splits
        ):
            return paths
    except (OSError, ValueError, KeyError, TypeError):
        pass
    manifest = {
        "source": "sklearn.datasets.load_digits",
        "tokenizer": tokenizer,
        "vocab_size": DIGITS_VOCAB,
        "num_classes": DIGITS_CLASSES,
        "grid_size": grid_size,
        "splits": {},
    }
    for name, rows in splits.items():
        write_token_parquet(
            paths[name], labels[rows], tokens[rows], ids=rows, vocab_size=DIGITS_VOCAB,
            num_classes=DIGITS_CLASSES, grid_size=grid_size, tokenizer=tokenizer,
        )  # fmt: skip
        manifest["splits"][name] = {
            "file": paths[name].name,
            "rows": int(len(rows)),
            "content_sha256": content[name],
            "file_sha256": _sha256_file(paths[name]),
        }
    tmp = paths["manifest"].with_name(".manifest.json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, paths["manifest"])
    return paths
