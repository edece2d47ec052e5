"""The embedded default dataset: scikit-learn digits, tokenization digits16-v1."""


from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from opd.data.format import DIGITS_TOKENIZER, DataError, write_token_parquet

# ---------------------------------------------------------------------------------------------
# Embedded default dataset: scikit-learn digits, tokenization digits16-v1
# ---------------------------------------------------------------------------------------------

DIGITS_GRID, DIGITS_VOCAB, DIGITS_CLASSES = 16, 17, 10
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
    a = bilinear_matrix(images.shape[-1], DIGITS_GRID)
    return np.einsum("ij,njk,lk->nil", a, np.asarray(images, dtype=np.float64), a)


def digits_images_to_tokens(images: np.ndarray) -> np.ndarray:
    """images: (N, 8, 8) grey levels 0..16 -> tokens (N, 256) int64 in [0, 16] (digits16-v1)."""
    up = np.clip(np.rint(digits_upsample(images)), 0, DIGITS_VOCAB - 1)
    return up.astype(np.int64).reshape(len(up), DIGITS_GRID * DIGITS_GRID)


def digits_tokens_to_images(tokens: np.ndarray | torch.Tensor) -> np.ndarray:
    """tokens: (N, 256) grey levels 0..16 -> (N, 16, 16) uint8 pixels round_half_up(level * 255 / 16)."""
    t = np.asarray(tokens.cpu() if isinstance(tokens, torch.Tensor) else tokens).astype(np.int64)
    if t.ndim != 2 or t.shape[1] != DIGITS_GRID**2 or t.min(initial=0) < 0 or t.max(initial=0) >= DIGITS_VOCAB:
        raise DataError(
            f"digits tokens must be (N, {DIGITS_GRID ** 2}) ints in [0, {DIGITS_VOCAB}), got shape {t.shape}; "
            "decode only sequences produced with the digits16-v1 tokenization."
        )
    pixels = (t * 510 + 16) // 32  # floor(level * 255 / 16 + 1/2): half-up, as opd.models.vq
    return pixels.astype(np.uint8).reshape(len(t), DIGITS_GRID, DIGITS_GRID)


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


def prepare_digits(out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write train.parquet (1597 rows), heldout.parquet (200 rows) and manifest.json under out_dir.

    Idempotent: files whose manifest records the same tokenizer, content hash and file hash are
    reused untouched. Returns {"train", "heldout", "manifest"} -> path.
    """
    from sklearn.datasets import load_digits

    out = Path(out_dir)
    digits = load_digits()
    labels = np.asarray(digits.target, dtype=np.int64)
    tokens = digits_images_to_tokens(digits.images)
    splits = dict(zip(("train", "heldout"), digits_split(labels)))
    paths = {name: out / f"{name}.parquet" for name in splits} | {"manifest": out / "manifest.json"}
    content = {name: _sha256_arrays(rows, labels[rows], tokens[rows]) for name, rows in splits.items()}
    try:
        old = json.loads(paths["manifest"].read_text())
        if old["tokenizer"] == DIGITS_TOKENIZER and all(
            old["splits"][name]["content_sha256"] == content[name]
            and _sha256_file(paths[name]) == old["splits"][name]["file_sha256"]
            for name in splits
        ):
            return paths
    except (OSError, ValueError, KeyError, TypeError):
        pass
    manifest = {
        "source": "sklearn.datasets.load_digits",
        "tokenizer": DIGITS_TOKENIZER,
        "vocab_size": DIGITS_VOCAB,
        "num_classes": DIGITS_CLASSES,
        "grid_size": DIGITS_GRID,
        "splits": {},
    }
    for name, rows in splits.items():
        write_token_parquet(
            paths[name], labels[rows], tokens[rows], ids=rows, vocab_size=DIGITS_VOCAB,
            num_classes=DIGITS_CLASSES, grid_size=DIGITS_GRID, tokenizer=DIGITS_TOKENIZER,
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
