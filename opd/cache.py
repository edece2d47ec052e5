"""Where opd keeps what it computes once and reuses: pretrained models, γ calibration, the
digits feature extractor.

The directory and the calibration file are defined in rollout/calibrate.py (rollout/ imports
nothing from opd/, and its engines read the calibration file); this module is opd's name for
them, so there is one definition of each.
"""
from __future__ import annotations

from pathlib import Path

from rollout.calibrate import cache_root, calibration_file  # noqa: F401  (re-exported)


def cache_dir() -> Path:
    """`$OPD_CACHE` if set, else `~/.cache/opd`."""
    return cache_root()
