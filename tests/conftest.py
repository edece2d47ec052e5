"""Session-wide test setup.

- OPD_CACHE points at one temporary directory for the whole session, so the small pretrained
  teacher and student (configs/tiny.yaml sizes) are trained once and shared by every test.
- torch uses one thread per process: tests run beside Ray workers on a 2-core machine.
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
