"""Per-step metrics of a run, kept in `metrics.parquet` in the run directory.

One row per learner step; columns are whatever the step reports (floats, ints, strings).  The
file is rewritten atomically after every `log_every` steps, so a run that stops keeps what it
measured, and a resumed run appends to the rows it already had.  The rows already written are
kept as an Arrow table, so a flush converts only the rows since the last one: rebuilding every
column from every row made the default run's flushes quadratic, 62 % of the driver's CPU
seconds in its on-policy steps (docs/WINDOW_POLICY.md).
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

FILE = "metrics.parquet"


class MetricsLog:
    """Rows of per-step metrics, flushed to `<run_dir>/<file>` (default metrics.parquet;
    quality.parquet holds the evaluations of opd/eval/tracking.py)."""

    def __init__(self, run_dir: str | Path, *, flush_every: int = 1, resume: bool = False,
                 file: str = FILE):
        self.path = Path(run_dir) / file
        self.flush_every = max(1, flush_every)
        self.rows: list[dict] = read_metrics(self.path) if resume and self.path.is_file() else []
        self.table: pa.Table | None = None     # self.rows[:converted] as columns
        self.converted = 0

    def truncate(self, step: int) -> None:
        """Drop rows of steps >= `step` (a resumed run repeats them)."""
        self.rows = [r for r in self.rows if r.get("step", -1) < step]
        self.table, self.converted = None, 0

    def append(self, row: dict) -> None:
        self.rows.append({k: _plain(v) for k, v in row.items()})
        if len(self.rows) % self.flush_every == 0:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        new = self.rows[self.converted:]
        if new:
            keys: dict[str, None] = {}
            for row in new:
                keys.update(dict.fromkeys(row))
            added = pa.table({k: [r.get(k) for r in new] for k in keys})
            # columns a part lacks are nulls; an int column meeting floats becomes float
            self.table = added if self.table is None else pa.concat_tables(
                [self.table, added], promote_options="permissive").combine_chunks()
            self.converted = len(self.rows)
        table = self.table
        tmp = self.path.with_suffix(".tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, self.path)


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.parquet file (or of the one in a run directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / FILE
    # One read of the whole file: a path read may open it twice (footer, then pages), and a
    # running run replaces the file after every step.
    return pq.read_table(pa.BufferReader(path.read_bytes())).to_pylist()
