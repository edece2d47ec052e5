"""Session-wide test setup.

- OPD_CACHE points at one temporary directory for the whole session, so the small pretrained
  teacher and student (configs/tiny.yaml sizes) are trained once and shared by every test.
- torch uses one thread per process: tests run beside Ray workers on a 2-core machine.
- `ray_session`: one local Ray for the whole session (loopback, no dashboard, no token auth),
  started by the first test that asks for it; actors use fractional CPUs so every test fits.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def opd_cache(tmp_path_factory) -> Path:
    path = Path(os.environ.get("OPD_TEST_CACHE") or tmp_path_factory.mktemp("opd_cache"))
    os.environ["OPD_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory) -> Path:
    """data/digits prepared once per session (train.parquet, heldout.parquet)."""
    from opd.data import prepare_digits
    out = tmp_path_factory.mktemp("digits")
    prepare_digits(out)
    return out


@pytest.fixture(scope="session")
def tiny_overrides(digits_dir) -> list[str]:
    """Overrides that make configs/tiny.yaml read the session's digits data."""
    return [f"data.data_dir={digits_dir}"]


@pytest.fixture(scope="session")
def ray_session(opd_cache):
    """A local Ray on 127.0.0.1 shared by the session's tests (started once, ~6 s); metrics
    are exported every second so tests can read them from the node's metrics port."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    if not ray.is_initialized():
        # address="local": a Ray of the suite's own, also when a `ray start` cluster (or the
        # stale ray_current_cluster file of one) is on this machine; never that cluster
        ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False, _system_config={"metrics_report_interval_ms": 1000})
    yield ray
    ray.shutdown()


@pytest.fixture
def fresh_calibration(opd_cache, tiny_overrides, tmp_path, monkeypatch) -> Path:
    """OPD_CACHE set, for this test, to a directory that links every entry of the session cache
    (pretrained tiny models, feature extractor, ...) except the calibration file: the test
    starts without calibrations and does not touch the session's.  Returns the directory."""
    from opd.config.schema import load_config
    from opd.models.factory import load_role_model
    cfg = load_config("tiny", tiny_overrides)
    for role in ("teacher", "student"):                 # pretrained once, in the session cache
        load_role_model(cfg, role, progress=False)
    mine = tmp_path / "opd_cache"
    mine.mkdir()
    for p in opd_cache.iterdir():
        if not p.name.startswith("calibration.json"):
            (mine / p.name).symlink_to(p)
    monkeypatch.setenv("OPD_CACHE", str(mine))
    return mine


@pytest.fixture(scope="session")
def check_tensorboard():
    """check(run_dir, steps) -> EventAccumulator: asserts that the run's TensorBoard events hold
    every metrics.parquet column at its steps (the last value written for a step) and every
    student quality row with the teacher's levels at `steps`, the evaluation steps; returns the
    reader for what a test checks beyond that."""
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from opd.eval.tracking import read_quality
    from opd.run.metrics_log import read_metrics
    from opd.run.trackers import quality_scalars, step_scalars

    def check(run_dir: Path, steps: list[int]):
        acc = EventAccumulator(str(run_dir / "tensorboard"),
                               size_guidance={"scalars": 0, "images": 0, "tensors": 0})
        acc.Reload()
        rows = read_metrics(run_dir)
        expected = {int(r["step"]): step_scalars(r, [rows[0]["phase"]]) for r in rows}
        tags = set().union(*expected.values())
        assert tags <= set(acc.Tags()["scalars"])
        for t in tags:
            assert {e.step: e.value for e in acc.Scalars(t)} == \
                {s: np.float32(v[t]) for s, v in expected.items() if t in v}, t
        quality = read_quality(run_dir)
        teacher = next(r for r in quality if r["role"] == "teacher")
        students = [r for r in quality if r["role"] == "student"]
        assert [r["step"] for r in students] == steps
        for r in students:
            for t, v in quality_scalars(r, teacher).items():
                assert [e.value for e in acc.Scalars(t) if e.step == r["step"]] == \
                    [np.float32(v)], t
        return acc
    return check
