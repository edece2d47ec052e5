"""Token datasets: the Parquet format, validated reading, deterministic batches, converters.

Format (one row per image, or per (image, augmentation)):

    label   int32/int64                       class index in [0, num_classes)
    tokens  fixed_size_list<int> or list<int>  grid_size**2 token ids in [0, vocab_size), raster order
    id      int64, optional                   source image id (default: row index)
    aug     int, optional                     augmentation index (default: 0)

The Parquet schema metadata key ``b"opd"`` holds JSON
``{"format": 1, "vocab_size", "num_classes", "grid_size", "tokenizer"}``.

Embedded default dataset, tokenization ``digits16-v1`` (``prepare_digits``):
    scikit-learn's bundled UCI digits (1797 images, 8x8, grey levels 0..16, 10 classes).
    Each image is upsampled to 16x16 by separable bilinear interpolation with corner pixels
    aligned (``F.interpolate(mode="bilinear", align_corners=True)``; source coordinate of output
    index i is i*7/15), i.e. ``up = A @ img @ A.T`` with A the (16, 8) linear-interpolation
    matrix. Every value of ``up`` is k/225 for an integer k, so it is never exactly half-way
    between two integers and rounding to the nearest of the 17 grey levels 0..16 is unambiguous.
    Token = grey level, raster order -> 256 tokens, vocab_size 17, num_classes 10, grid_size 16.
    Inverse (``digits_tokens_to_images``): pixel = floor(level * 255 / 16 + 1/2), uint8.
    Split: per class, a permutation seeded with (0, class) puts its first 20 images in
    ``heldout`` (200 rows) and the rest in ``train`` (1597 rows); rows keep sklearn's order
    and ``id`` is the sklearn index.

LlamaGen layout (``prepare_llamagen_codes``): ``extract_codes_c2i.py`` writes
``imagenet{size}_codes/{i}.npy`` of shape (1, aug, T) or (aug, T) and
``imagenet{size}_labels/{i}.npy`` of shape (1,); one row per (i, aug) is written.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

METADATA_KEY = b"opd"
FORMAT_VERSION = 1
REQUIRED_COLUMNS = ("label", "tokens")
DIGITS_TOKENIZER = "digits16-v1"
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


# ---------------------------------------------------------------------------------------------
# Deterministic batches with a resumable cursor
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefixBatch:
    """One batch of data rows; the consumer cuts the prefix (prefix ratio x T) from ``tokens``.

    batch_id: unique over the run, = epoch * batches_per_epoch + index in epoch;
    rows: (B,) int64 row indices into the dataset; ids: (B,) int64 source ids;
    labels: (B,) int64; tokens: (B, T) int64.
    """

    batch_id: int
    epoch: int
    rows: np.ndarray
    ids: torch.Tensor
    labels: torch.Tensor
    tokens: torch.Tensor


class PrefixBatcher:
    """Endless, epoch-shuffled batches; the order of epoch e is ``default_rng([seed, e]).permutation(N)``.

    The cursor (epoch, position = rows consumed in that epoch) is saved by ``state_dict`` and
    restored by ``load_state_dict``, so a resumed run yields exactly the batches it would have.
    With ``drop_last`` the last N % batch_size rows of each epoch's order are skipped.
    """

    def __init__(
        self, dataset: TokenDataset, batch_size: int, seed: int, *, shuffle: bool = True, drop_last: bool = True
    ) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise DataError(f"{dataset.path}: batch_size={batch_size!r} must be a positive integer.")
        if not isinstance(seed, int) or seed < 0:
            raise DataError(f"{dataset.path}: seed={seed!r} must be a non-negative integer.")
        n = dataset.num_rows
        if n == 0 or (drop_last and batch_size > n):
            raise DataError(
                f"{dataset.path}: batch_size {batch_size} is larger than the {n} rows of the dataset; "
                "use a smaller batch size or a larger dataset."
            )
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.batches_per_epoch = n // batch_size if drop_last else -(-n // batch_size)
        self.epoch, self.position = 0, 0
        self._order: tuple[int, np.ndarray] | None = None

    def epoch_order(self, epoch: int) -> np.ndarray:
        """(N,) int64 row order of ``epoch``."""
        if self._order is None or self._order[0] != epoch:
            n = self.dataset.num_rows
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._order = (epoch, order.astype(np.int64))
        return self._order[1]

    @property
    def next_batch_id(self) -> int:
        return self.epoch * self.batches_per_epoch + self.position // self.batch_size

    def batch_at(self, batch_id: int) -> PrefixBatch:
        """Rebuild the batch with this id (e.g. to re-issue it after a worker failure)."""
        if batch_id < 0:
            raise DataError(f"{self.dataset.path}: batch id {batch_id} is negative; ids start at 0.")
        epoch, index = divmod(batch_id, self.batches_per_epoch)
        start = index * self.batch_size
        rows = self.epoch_order(epoch)[start : start + self.batch_size]
        ds = self.dataset
        return PrefixBatch(
            batch_id=batch_id,
            epoch=epoch,
            rows=rows,
            ids=torch.from_numpy(ds.ids[rows]),
            labels=torch.from_numpy(ds.labels[rows]),
            tokens=torch.from_numpy(ds.tokens[rows]),
        )

    def __iter__(self) -> PrefixBatcher:
        return self

    def __next__(self) -> PrefixBatch:
        batch = self.batch_at(self.next_batch_id)
        self.position += self.batch_size
        if self.position // self.batch_size >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict:
        """The cursor plus what it is only valid for (JSON-serializable)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_rows": self.dataset.num_rows,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("seed", "batch_size", "num_rows", "shuffle", "drop_last"):
            if key in state and state[key] != mine[key]:
                raise DataError(
                    f"{self.dataset.path}: the saved data cursor has {key}={state[key]!r} but this run has "
                    f"{key}={mine[key]!r}; resume with the same dataset and data settings."
                )
        epoch, position = state.get("epoch"), state.get("position")
        valid = isinstance(epoch, int) and isinstance(position, int) and epoch >= 0 and position >= 0
        if not valid or position % self.batch_size or position // self.batch_size >= self.batches_per_epoch:
            raise DataError(
                f"{self.dataset.path}: the saved data cursor (epoch={epoch!r}, position={position!r}) is not a "
                f"batch boundary of this dataset; pass the state saved by PrefixBatcher.state_dict()."
            )
        self.epoch, self.position = epoch, position


def iterate_batches(
    dataset: TokenDataset,
    batch_size: int,
    seed: int,
    *,
    num_batches: int | None = None,
    state: dict | None = None,
    shuffle: bool = True,
    drop_last: bool = True,
) -> Iterator[PrefixBatch]:
    """Yield ``num_batches`` batches (endless if None), starting at a saved cursor ``state``."""
    batcher = PrefixBatcher(dataset, batch_size, seed, shuffle=shuffle, drop_last=drop_last)
    if state is not None:
        batcher.load_state_dict(state)
    count = 0
    while num_batches is None or count < num_batches:
        yield next(batcher)
        count += 1


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
