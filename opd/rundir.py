"""Run directories: created fresh, never overwritten without asking, resumable.

A run directory holds `config.yaml` (the resolved config), `metrics.parquet`, `checkpoints/`,
sample grids and plots.  Starting a run in a non-empty directory is refused unless the run is
resumed from it.
"""
from __future__ import annotations

from pathlib import Path

from opd.config import ConfigError, RunConfig, default_run_dir, save_config


class RunDirError(ValueError):
    """A run directory that cannot be used as asked."""


def prepare_run_dir(cfg: RunConfig, *, resume: bool = False) -> Path:
    """Create (or, when resuming, reopen) the run directory and save the resolved config."""
    path = Path(cfg.run.dir) if cfg.run.dir else default_run_dir(cfg)
    if resume:
        if not (path / "config.yaml").is_file():
            raise RunDirError(f"cannot resume from {path}: it holds no config.yaml; pass the "
                              "directory of an earlier run")
        return path
    if path.exists() and any(path.iterdir()):
        raise RunDirError(f"run directory {path} is not empty; choose another run.dir, delete it, "
                          f"or continue that run with --resume {path}")
    path.mkdir(parents=True, exist_ok=True)
    save_config(cfg, path / "config.yaml")
    return path


__all__ = ["RunDirError", "prepare_run_dir", "ConfigError"]
