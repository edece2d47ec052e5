"""Where opd keeps what it computes once and reuses: pretrained models, γ calibration, the
digits feature extractor."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$OPD_CACHE` if set, else `~/.cache/opd`."""
    return Path(os.environ.get("OPD_CACHE") or Path.home() / ".cache" / "opd")
