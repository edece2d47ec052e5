"""Deterministic prefix batches with a resumable cursor."""


from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from opd.data.format import DataError, TokenDataset

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
