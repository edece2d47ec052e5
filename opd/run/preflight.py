"""Checks of the files a run reads, before anything starts (no actor, no model, no data load).

A missing checkpoint or data file is named with its config key and the fix, in one sentence.
"""
from __future__ import annotations

from pathlib import Path

from opd.config.schema import RunConfig
from opd.config.loader import ConfigError

CKPT_HINTS = {
    "model.student_ckpt": "download the LlamaGen c2i_*.pt file there, or set the key to null "
                          "to pretrain a student on the configured data",
    "model.teacher_ckpt": "download the LlamaGen c2i_*.pt file there, or set the key to null "
                          "to pretrain a teacher on the configured data",
    "model.vq_ckpt": "download LlamaGen's vq_ds16_c2i.pt there, or set the key to null",
    "eval.inception_weights": "put torch-fidelity's pt_inception-2015-12-05 weights there "
                              "(no download happens at run time)",
}


def missing_inputs(cfg: RunConfig, *, evaluation: bool = False) -> list[str]:
    """One message per configured file that does not exist."""
    problems = []
    keys = ["model.student_ckpt", "model.teacher_ckpt", "model.vq_ckpt"]
    if evaluation or cfg.eval.track:
        keys.append("eval.inception_weights" if cfg.eval.extractor == "inception-v3-compat"
                    else None)
    for key in filter(None, keys):
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if key == "eval.inception_weights" and value is None:
            problems.append(f"{key} is not set but eval.extractor=inception-v3-compat needs it; "
                            f"{CKPT_HINTS[key]}")
        elif value is not None and not Path(value).is_file():
            problems.append(f"{key}={value} does not exist; {CKPT_HINTS[key]}")
    for i, t in enumerate(cfg.teachers):
        if t.ckpt is not None and not Path(t.ckpt).is_file():
            problems.append(f"teachers[{i}].ckpt={t.ckpt} does not exist; put teacher "
                            f"{t.name!r}'s c2i_*.pt file there, or set the key to null to "
                            f"pretrain it on the configured data (its classes')")
    if cfg.data.dataset != "digits":
        for key in ("train",) + (("heldout",) if evaluation else ()):
            value = getattr(cfg.data, key) or str(Path(cfg.data.data_dir) / f"{key}.parquet")
            if not Path(value).is_file():
                problems.append(f"data.{key}={value} does not exist; convert the codes with "
                                "`opd prepare llamagen-codes` or fix the path")
    return problems


def check_tracking(cfg: RunConfig) -> None:
    """Quality tracking during training (eval.track) must be able to measure this data."""
    e = cfg.eval
    if not e.track:
        return
    digits = cfg.data.dataset == "digits" and cfg.model.vq_ckpt is None
    if e.extractor == "digits-cnn" and not digits:
        raise ConfigError(f"eval.extractor='digits-cnn' only measures the digits data, but "
                          f"data.dataset={cfg.data.dataset!r} and eval.track=true; set "
                          f"eval.extractor=inception-v3-compat with eval.inception_weights, or "
                          f"eval.track=false", "eval.extractor")
    if e.num_samples < 4:
        raise ConfigError(f"eval.num_samples={e.num_samples}: tracking quality (eval.track=true) "
                          f"needs at least 4 samples for FID / precision / recall; raise it or "
                          f"set eval.track=false", "eval.num_samples")


def check_inputs(cfg: RunConfig, *, evaluation: bool = False) -> None:
    """Raise ConfigError for the first missing input file (all of them are listed), then for
    quality tracking that cannot measure the data, then for a run.loggers entry whose package is
    not installed."""
    problems = missing_inputs(cfg, evaluation=evaluation)
    if problems:
        more = f" (and {len(problems) - 1} more: {'; '.join(problems[1:])})" if len(problems) > 1 else ""
        raise ConfigError(problems[0] + more)
    check_tracking(cfg)
    from opd.run.trackers import check_loggers
    check_loggers(cfg)
