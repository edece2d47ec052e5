"""LlamaGen extracted-code layout -> the opd token Parquet format."""


from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from opd.data.format import (LLAMAGEN_TOKENIZER, DataError, DatasetMeta, _check_meta, _check_range,
                             _schema, _table)

# ---------------------------------------------------------------------------------------------
# LlamaGen extracted codes -> Parquet
# ---------------------------------------------------------------------------------------------


def _load_int_npy(path: Path) -> np.ndarray:
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot read this .npy file ({e}); re-extract it with extract_codes_c2i.py.") from None
    if not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"{path}: dtype {arr.dtype} is not an integer type; codes and labels must be integer ids.")
    return arr.astype(np.int64)


def prepare_llamagen_codes(
    code_dir: str | os.PathLike,
    label_dir: str | os.PathLike,
    out_path: str | os.PathLike,
    *,
    vocab_size: int = 16384,
    num_classes: int = 1000,
    tokenizer: str = LLAMAGEN_TOKENIZER,
    rows_per_group: int = 8192,
) -> Path:
    """Convert ``{code_dir}/{i}.npy`` ((1, aug, T) or (aug, T)) and ``{label_dir}/{i}.npy`` ((1,))
    into one token Parquet file with a row per (i, aug): id = i, aug = augmentation index.

    grid_size = sqrt(T). Streams in row groups of ~rows_per_group rows and writes atomically.
    """
    code_dir, label_dir, out_path = Path(code_dir), Path(label_dir), Path(out_path)
    for d in (code_dir, label_dir):
        if not d.is_dir():
            raise DataError(f"{d}: no such directory; pass the imagenet{{size}}_codes / _labels folders.")
    files = sorted(code_dir.glob("*.npy"))
    if not files:
        raise DataError(f"{code_dir}: no .npy code files found; run LlamaGen's extract_codes_c2i.py first.")
    for f in files:
        if not f.stem.isdigit():
            raise DataError(f"{f}: code files must be named {{index}}.npy; rename or remove this file.")
    files.sort(key=lambda f: int(f.stem))

    meta: DatasetMeta | None = None
    writer: pq.ParquetWriter | None = None
    tmp = out_path.with_name(f".{out_path.name}.tmp{os.getpid()}")
    pending: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    pending_rows = 0

    def flush() -> None:
        nonlocal pending, pending_rows
        if pending:
            cols = [np.concatenate(c) for c in zip(*pending)]
            writer.write_table(_table(meta, cols[0], cols[1], cols[2], cols[3]))  # type: ignore[union-attr]
            pending, pending_rows = [], 0

    out_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        for f in files:
            codes = _load_int_npy(f)
            if codes.ndim == 3 and codes.shape[0] == 1:
                codes = codes[0]
            if codes.ndim != 2:
                raise DataError(f"{f}: codes have shape {codes.shape}, expected (1, aug, T) or (aug, T).")
            aug, t = codes.shape
            if meta is None:
                grid = math.isqrt(t)
                if grid * grid != t or t == 0:
                    raise DataError(f"{f}: {t} tokens per image is not a square grid; the codes must be grid**2 long.")
                meta = DatasetMeta(vocab_size, num_classes, grid, str(tokenizer))
                _check_meta(str(f), meta)
                writer = pq.ParquetWriter(tmp, _schema(meta))
            elif t != meta.seq_len:
                raise DataError(
                    f"{f}: {t} tokens per image, but earlier files have {meta.seq_len}; re-extract at one image size."
                )
            label_file = label_dir / f.name
            if not label_file.is_file():
                raise DataError(f"{label_file}: missing label file for {f}; extract codes and labels together.")
            label = _load_int_npy(label_file).reshape(-1)
            if label.shape != (1,):
                raise DataError(f"{label_file}: label has {label.size} values, expected one (shape (1,)).")
            _check_range(str(label_file), label, num_classes, "label", lambda _: "the file")
            _check_range(str(f), codes, vocab_size, "token id", lambda k: f"augmentation {k // t} (position {k % t})")
            pending.append((np.full(aug, label[0]), codes, np.full(aug, int(f.stem)), np.arange(aug)))
            pending_rows += aug
            if pending_rows >= rows_per_group:
                flush()
        flush()
        writer.close()  # type: ignore[union-attr]
        os.replace(tmp, out_path)
    finally:
        if tmp.exists():
            if writer is not None:
                writer.close()
            tmp.unlink()
    return out_path
