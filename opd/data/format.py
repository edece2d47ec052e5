"""Token datasets: the Parquet format and validated reading (see opd/data/__init__.py)."""


from __future__ import annotations

import copy

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch


METADATA_KEY = b"opd"
FORMAT_VERSION = 1
REQUIRED_COLUMNS = ("label", "tokens")
LLAMAGEN_TOKENIZER = "llamagen-vq-ds16"
_MAKE_HINT = "write it with opd.data.write_token_parquet (or `opd prepare`)"


class DataError(ValueError):
    """A dataset file or its contents cannot be used; the message names file, row and value."""


@dataclass(frozen=True)
class DatasetMeta:
    """What a token file was tokenized with; ``seq_len = grid_size**2`` tokens per image."""

    vocab_size: int
    num_classes: int
    grid_size: int
    tokenizer: str

    @property
    def seq_len(self) -> int:
        return self.grid_size**2

    def to_json(self) -> bytes:
        return json.dumps({"format": FORMAT_VERSION, **asdict(self)}, sort_keys=True).encode()


def _check_meta(where: str, meta: DatasetMeta) -> None:
    for key in ("vocab_size", "num_classes", "grid_size"):
        value = getattr(meta, key)
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise DataError(f"{where}: {key}={value!r} must be a positive integer; pass the value your tokenizer used.")


def _check_range(where: str, values: np.ndarray, high: int, what: str, locate) -> None:
    """Raise DataError at the first element of ``values`` outside [0, high); ``locate(flat) -> str``."""
    bad = (values < 0) | (values >= high)
    if bad.any():
        flat = int(np.flatnonzero(bad.reshape(-1))[0])
        value = int(values.reshape(-1)[flat])
        raise DataError(
            f"{where}: {locate(flat)} has {what} {value}, outside [0, {high}); "
            f"{'re-tokenize the images or fix vocab_size' if what == 'token id' else 'fix the label or num_classes'}."
        )


def _check_arrays(where: str, labels: np.ndarray, tokens: np.ndarray, meta: DatasetMeta) -> None:
    """labels: (N,) ints; tokens: (N, T) ints; rows are named by their index."""
    _check_range(where, labels, meta.num_classes, "label", lambda f: f"row {f}")
    t = tokens.shape[1]
    _check_range(where, tokens, meta.vocab_size, "token id", lambda f: f"row {f // t} (position {f % t})")


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def _schema(meta: DatasetMeta) -> pa.Schema:
    return pa.schema(
        [
            ("id", pa.int64()),
            ("aug", pa.int32()),
            ("label", pa.int64()),
            ("tokens", pa.list_(pa.int32(), meta.seq_len)),
        ],
        metadata={METADATA_KEY: meta.to_json()},
    )


def _table(meta: DatasetMeta, labels: np.ndarray, tokens: np.ndarray, ids: np.ndarray, augs: np.ndarray) -> pa.Table:
    flat = pa.array(np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1), pa.int32())
    return pa.Table.from_arrays(
        [
            pa.array(ids.astype(np.int64)),
            pa.array(augs.astype(np.int32)),
            pa.array(labels.astype(np.int64)),
            pa.FixedSizeListArray.from_arrays(flat, meta.seq_len),
        ],
        schema=_schema(meta),
    )


def _as_int_array(where: str, name: str, value, ndim: int) -> np.ndarray:
    arr = np.asarray(value.cpu() if isinstance(value, torch.Tensor) else value)
    if arr.ndim != ndim or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise DataError(
            f"{where}: {name} must be a {ndim}-d integer array, got shape {arr.shape} dtype {arr.dtype}; "
            "convert it with np.asarray(..., dtype=np.int64)."
        )
    return arr.astype(np.int64)


def write_token_parquet(
    path: str | os.PathLike,
    labels: np.ndarray,
    tokens: np.ndarray,
    *,
    vocab_size: int,
    num_classes: int,
    grid_size: int,
    tokenizer: str,
    ids: np.ndarray | None = None,
    augs: np.ndarray | None = None,
) -> Path:
    """Validate and write a token dataset atomically (temp file + rename).

    labels: (N,) int class indices; tokens: (N, grid_size**2) int token ids;
    ids: (N,) int64 source ids (default arange(N)); augs: (N,) int augmentation index (default 0).
    """
    path = Path(path)
    where = f"{path} (being written)"
    meta = DatasetMeta(vocab_size, num_classes, grid_size, str(tokenizer))
    _check_meta(where, meta)
    labels = _as_int_array(where, "labels", labels, 1)
    tokens = _as_int_array(where, "tokens", tokens, 2)
    n = labels.shape[0]
    if tokens.shape != (n, meta.seq_len):
        raise DataError(
            f"{where}: tokens have shape {tokens.shape}, expected ({n}, {meta.seq_len}) "
            f"(one row per label, grid_size {grid_size} squared); check grid_size and the label count."
        )
    ids = np.arange(n, dtype=np.int64) if ids is None else _as_int_array(where, "ids", ids, 1)
    augs = np.zeros(n, dtype=np.int64) if augs is None else _as_int_array(where, "augs", augs, 1)
    for name, arr in (("ids", ids), ("augs", augs)):
        if arr.shape != (n,):
            raise DataError(f"{where}: {name} has shape {arr.shape}, expected ({n},); pass one value per row.")
    _check_arrays(where, labels, tokens, meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    pq.write_table(_table(meta, labels, tokens, ids, augs), tmp)
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def _first_null(column: pa.ChunkedArray) -> int:
    return int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])


def _read_meta(path: Path, schema: pa.Schema) -> DatasetMeta | None:
    raw = (schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        return None
    try:
        d = json.loads(raw)
        meta = DatasetMeta(int(d["vocab_size"]), int(d["num_classes"]), int(d["grid_size"]), str(d["tokenizer"]))
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: the b'opd' metadata {raw[:200]!r} is not valid ({e!r}); {_MAKE_HINT}.") from None
    _check_meta(str(path), meta)
    return meta


def _tokens_to_numpy(path: Path, column: pa.ChunkedArray, seq_len: int) -> np.ndarray:
    """tokens column (list / large_list / fixed_size_list of ints) -> (N, seq_len) int64."""
    typ = column.type
    if not (pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ)) or not (
        pa.types.is_integer(typ.value_type)
    ):
        raise DataError(f"{path}: column 'tokens' has type {typ}, expected a list of integers; {_MAKE_HINT}.")
    if column.null_count:
        raise DataError(f"{path}: row {_first_null(column)} has a null 'tokens' value; drop or re-tokenize that row.")
    rows = []
    offset = 0
    for chunk in column.chunks:
        lengths = pc.list_value_length(chunk).to_numpy(zero_copy_only=False)
        wrong = np.flatnonzero(lengths != seq_len)
        if wrong.size:
            r = int(wrong[0])
            raise DataError(
                f"{path}: row {offset + r} has {int(lengths[r])} tokens, expected {seq_len} (grid_size "
                f"{math.isqrt(seq_len)} squared); re-tokenize at the right resolution or fix grid_size."
            )
        values = chunk.flatten()
        if values.null_count:
            bad = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataError(f"{path}: row {offset + bad // seq_len} has a null token; re-tokenize that row.")
        rows.append(values.to_numpy(zero_copy_only=False).astype(np.int64).reshape(len(chunk), seq_len))
        offset += len(chunk)
    return np.concatenate(rows) if rows else np.zeros((0, seq_len), np.int64)


def _int_column(path: Path, table: pa.Table, name: str) -> np.ndarray:
    column = table.column(name)
    if not pa.types.is_integer(column.type):
        raise DataError(f"{path}: column '{name}' has type {column.type}, expected an integer type; {_MAKE_HINT}.")
    if column.null_count:
        raise DataError(f"{path}: row {_first_null(column)} has a null '{name}'; fill or drop that row.")
    return column.to_numpy().astype(np.int64)


class TokenDataset:
    """A validated, in-memory token dataset read from one Parquet file.

    labels: (N,) int64; tokens: (N, T) int64 with T = grid_size**2; ids: (N,) int64; augs: (N,) int64.
    Expected vocab_size / num_classes / grid_size (e.g. from the model config) must match the
    file's metadata; a file without metadata is accepted only when all three are given.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        vocab_size: int | None = None,
        num_classes: int | None = None,
        grid_size: int | None = None,
    ) -> None:
        self.path = path = Path(path)
        if not path.is_file():
            raise DataError(f"{path}: no such dataset file; check the path or build it with `opd prepare`.")
        try:
            schema = pq.read_schema(path)
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{path}: not a readable Parquet file ({e}); regenerate it, {_MAKE_HINT}.") from None
        missing = [c for c in REQUIRED_COLUMNS if c not in schema.names]
        if missing:
            raise DataError(
                f"{path}: missing column '{missing[0]}' (found {schema.names}); a token dataset needs "
                f"columns {list(REQUIRED_COLUMNS)}, {_MAKE_HINT}."
            )
        expected = {"vocab_size": vocab_size, "num_classes": num_classes, "grid_size": grid_size}
        meta = _read_meta(path, schema)
        if meta is None:
            if any(v is None for v in expected.values()):
                raise DataError(
                    f"{path}: no b'opd' metadata (vocab_size, num_classes, grid_size, tokenizer); "
                    f"{_MAKE_HINT}, or pass all of vocab_size, num_classes and grid_size."
                )
            meta = DatasetMeta(vocab_size, num_classes, grid_size, "unknown")  # type: ignore[arg-type]
            _check_meta(str(path), meta)
        for key, want in expected.items():
            have = getattr(meta, key)
            if want is not None and want != have:
                raise DataError(
                    f"{path}: the data was tokenized with {key}={have} ({meta.tokenizer}) but {key}={want} "
                    "is expected; use a dataset and model that share one tokenizer and label set."
                )
        self.meta = meta
        columns = [c for c in ("id", "aug", "label", "tokens") if c in schema.names]
        table = pq.read_table(path, columns=columns)
        self.labels = _int_column(path, table, "label")
        self.tokens = _tokens_to_numpy(path, table.column("tokens"), meta.seq_len)
        n = len(self.labels)
        self.ids = _int_column(path, table, "id") if "id" in columns else np.arange(n, dtype=np.int64)
        self.augs = _int_column(path, table, "aug") if "aug" in columns else np.zeros(n, dtype=np.int64)
        _check_arrays(str(path), self.labels, self.tokens, meta)

    @property
    def num_rows(self) -> int:
        return int(self.labels.shape[0])

    def __len__(self) -> int:
        return self.num_rows

    @property
    def vocab_size(self) -> int:
        return self.meta.vocab_size

    @property
    def num_classes(self) -> int:
        return self.meta.num_classes

    @property
    def grid_size(self) -> int:
        return self.meta.grid_size

    @property
    def seq_len(self) -> int:
        return self.meta.seq_len

    def __repr__(self) -> str:
        return f"TokenDataset({str(self.path)!r}, rows={self.num_rows}, {self.meta})"

    def of_classes(self, classes) -> TokenDataset:
        """A copy holding only the rows of the given class labels (a specialist's data)."""
        keep = np.isin(self.labels, np.asarray(list(classes), dtype=np.int64))
        out = copy.copy(self)
        out.labels, out.tokens = self.labels[keep], self.tokens[keep]
        out.ids, out.augs = self.ids[keep], self.augs[keep]
        return out


def dataset_stats(dataset: TokenDataset) -> dict:
    """Token statistics; entropies in nats per token.

    unigram_entropy_nats: entropy of the pooled token distribution (NLL of a model that predicts
    the corpus unigram at every position); positional_entropy_nats: mean over positions of the
    per-position unigram entropy (a position-aware baseline, <= the former).
    """
    v, t = dataset.vocab_size, dataset.seq_len

    def entropy(counts: np.ndarray) -> np.ndarray:
        total = counts.sum(-1, keepdims=True)
        p = counts / np.maximum(total, 1)
        return -(p * np.log(np.where(p > 0, p, 1.0))).sum(-1)

    counts = np.bincount(dataset.tokens.reshape(-1), minlength=v).astype(np.float64)
    per_position = np.zeros((t, v), dtype=np.float64)
    np.add.at(per_position, (np.broadcast_to(np.arange(t), dataset.tokens.shape), dataset.tokens), 1.0)
    return {
        "num_rows": dataset.num_rows,
        "num_tokens": int(counts.sum()),
        "vocab_size": v,
        "vocab_used": int((counts > 0).sum()),
        "unigram_entropy_nats": float(entropy(counts)),
        "positional_entropy_nats": float(entropy(per_position).mean()) if t else 0.0,
        "class_counts": np.bincount(dataset.labels, minlength=dataset.num_classes).tolist(),
    }
