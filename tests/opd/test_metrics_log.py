"""metrics.parquet (opd/run/metrics_log.py): a flush converts only the rows since the last one,
and the file it writes must equal the table built from every row at once (the reference), for
rows whose columns come and go and change type (an int column meeting floats, a column that is
None until it is not, lists), across truncation (a resumed run) and every flush period."""
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from opd.run.metrics_log import MetricsLog, read_metrics


def rows(start: int, stop: int) -> list[dict]:
    out = []
    for s in range(start, stop):
        row = {"step": s, "loss": 1.0 / (s + 1), "source": "data" if s % 3 else "student"}
        row["rounds"] = s if s < 5 else s + 0.5           # ints, then floats
        row["late"] = None if s < 4 else s * 2            # None until step 4
        if s % 3 == 0:                                    # a student step's columns
            row["window_hist"] = [s, 0, 1]
        out.append(row)
    return out


def reference(all_rows: list[dict]) -> pa.Table:
    keys: dict[str, None] = {}
    for row in all_rows:
        keys.update(dict.fromkeys(row))
    return pa.table({k: [r.get(k) for r in all_rows] for k in keys})


@pytest.mark.parametrize("every", [1, 3])
def test_the_file_is_the_table_of_every_row(tmp_path, every):
    log = MetricsLog(tmp_path, flush_every=every)
    for row in rows(0, 9):
        log.append(row)
    log.flush()
    assert pq.read_table(tmp_path / "metrics.parquet").equals(reference(rows(0, 9)))
    resumed = MetricsLog(tmp_path, flush_every=every, resume=True)   # a resume from step 6
    resumed.truncate(6)
    for row in rows(6, 11):
        resumed.append(row)
    resumed.flush()
    want = reference(rows(0, 11))
    assert pq.read_table(tmp_path / "metrics.parquet").equals(want)
    assert read_metrics(tmp_path) == want.to_pylist()
