"""The train and held-out splits of a run's config: which Parquet files, opened and validated
against the model's vocab, classes and grid (the embedded digits set is prepared on first use)."""
from __future__ import annotations

from pathlib import Path

from opd.config.schema import RunConfig
from opd.data.digits import prepare_digits
from opd.data.format import TokenDataset


def data_paths(cfg: RunConfig) -> tuple[Path, Path]:
    """(train, heldout) Parquet files; the digits set is prepared on first use."""
    d = cfg.data
    train = Path(d.train) if d.train else Path(d.data_dir) / "train.parquet"
    heldout = Path(d.heldout) if d.heldout else Path(d.data_dir) / "heldout.parquet"
    if d.dataset == "digits" and not (train.is_file() and heldout.is_file()) and not d.train:
        prepare_digits(d.data_dir, cfg.model.grid_size)
    return train, heldout


def open_dataset(cfg: RunConfig, split: str) -> TokenDataset:
    """The train or heldout split, validated against the model's vocab, classes and grid."""
    train, heldout = data_paths(cfg)
    m = cfg.model
    return TokenDataset({"train": train, "heldout": heldout}[split], vocab_size=m.vocab_size,
                        num_classes=m.num_classes, grid_size=m.grid_size)
