"""Which γ calibration entries a run needs, and preparing them.

With `rollout.gamma=auto` and Hybrid HB-SJD at a fixed window (`rollout.window: auto`, the
default, measures its rounds as it runs and reads no file: rollout/window.py), every batch size an engine is called with needs entries in the calibration file
(`rollout.calibrate.calibration_file()`, i.e. `$OPD_CACHE/calibration.json`), keyed by the model's
signature, the batch, W and CFG on/off:

    training         the sizes of a step's rollout calls (`opd.distill.pieces.step_layout`: one per
                     worker of the larger pool, each a run of pieces), in both run modes
    evaluation       eval.batch_size chunks of eval.num_samples (samples) and
                     `opd.eval.quality.KL_BATCH` chunks of eval.kl_rows (on-policy KL), when set

An entry is keyed by the physical rows the engine runs: with `rollout.slots` S a training or
on-policy-KL rollout of B images runs min(S, B) rows (continuous batching).

`opd calibrate --config X` measures all of them for run X; each rollout worker calls
`prepare_calibration` when it starts, so an entry a run lacks is measured once, by the first
worker, under the file's lock (`rollout.calibrate.ensure_calibration`), and read by the rest.
"""
from __future__ import annotations

from rollout.calibrate import calibration_file
from opd.config.schema import RunConfig
from opd.distill.pieces import step_layout
from rollout.calibrate import ensure_calibrations
from rollout.sampling import uses_cfg


def chunk_sizes(total: int, batch: int) -> set[int]:
    """The batch sizes of `total` items taken `batch` at a time."""
    if total < 1:
        return set()
    return {min(batch, total)} | ({total % batch} if total % batch else set())


def slot_rows(cfg: RunConfig, sizes) -> set[int]:
    """The physical rows of rollouts of these batch sizes (rollout.slots caps them)."""
    S = cfg.rollout.slots
    return {min(S, b) if S else b for b in sizes}


def rollout_batch_sizes(cfg: RunConfig) -> list[int]:
    """The physical rows training rollouts are generated at: the sizes of a step's rollout
    calls (opd/distill/pieces.py, the same in both run modes), capped by rollout.slots."""
    return sorted(slot_rows(cfg, {len(rows) for rows in step_layout(cfg).call_rows}))


def eval_batch_sizes(cfg: RunConfig) -> list[int]:
    """The batch sizes evaluation samples (and completes held-out prefixes) at."""
    from opd.eval.quality import KL_BATCH
    e = cfg.eval
    sizes = chunk_sizes(e.num_samples, e.batch_size)
    if e.kl_rows:
        sizes |= slot_rows(cfg, chunk_sizes(e.kl_rows, KL_BATCH))
    return sorted(sizes)


def run_batch_sizes(cfg: RunConfig) -> list[int]:
    """Every batch size run `cfg` calls an engine with: training rollouts and evaluation."""
    return sorted({*rollout_batch_sizes(cfg), *eval_batch_sizes(cfg)})


def uses_calibration(cfg: RunConfig, engine: str | None = None) -> bool:
    """Whether `engine` (default rollout.engine) reads the calibration file in this config:
    HB-SJD at a fixed window with Hybrid execution and `gamma: auto` (`window: auto` chooses
    Full or Compact by what it measures, rollout/window.py)."""
    r = cfg.rollout
    return ((engine or r.engine) == "hbsjd" and r.window != "auto"
            and r.execution == "hybrid" and r.gamma == "auto")


def calibration_windows(cfg: RunConfig) -> list[int]:
    """The windows a run's entries are measured at: rollout.window (`uses_calibration`)."""
    return [cfg.rollout.window]


def prepare_calibration(model, cfg: RunConfig, batches, **measure_kw) -> dict[tuple, dict]:
    """{(batch, W): entry} of `model` at each W of `calibration_windows` and the config's CFG
    for each batch in `batches`, measuring only the missing ones (once, under the calibration
    file's lock); {} when the config does not calibrate (`uses_calibration`)."""
    if not uses_calibration(cfg) or not batches:
        return {}
    return ensure_calibrations(model, batches, calibration_windows(cfg),
                               cfg=uses_cfg(cfg.rollout.cfg_scale), path=calibration_file(),
                               preset=cfg.model.student, **measure_kw)
