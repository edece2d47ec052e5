"""A step's rollout jobs, planned the same way in both run modes.

The reference loop (opd/run/reference.py) and the Ray driver's planner
(actors/driver/planner.py) ask these for a step's objective and source and for its rollout
calls' jobs; the driver adds only the bounds (queue, staleness) and the dispatch.

    objective, source = step_source(cfg, step)
    jobs = step_jobs(cfg, step, source, next(batcher), seq_len, layouts[source])
"""
from __future__ import annotations

from opd.config.schema import RunConfig
from opd.distill.objectives import Objective
from opd.distill.pieces import Layout, split_job
from opd.distill.steps import RolloutJob, batch_prefix_len, batch_source, build_objective


def step_source(cfg: RunConfig, step: int) -> tuple[Objective, str]:
    """Step `step`'s objective (its phase's, opd/distill/phases.py) and where its sequences
    come from ("student", "data" or "teacher"; keyed by (run.seed, step))."""
    objective = build_objective(cfg, step)
    return objective, batch_source(objective, step, cfg.run.seed)


def step_jobs(cfg: RunConfig, step: int, source: str, batch, seq_len: int,
              layout: Layout) -> list[RolloutJob]:
    """The rollout jobs of step `step` on prefix batch `batch` (an `opd.data.PrefixBatch`:
    batch_id, labels, tokens), one per rollout call of `layout` (`step_layout(cfg, source)`),
    each keeping its rows' image ids; the prefix length is the batch's
    (`batch_prefix_len`)."""
    job = RolloutJob(batch.batch_id, batch.labels, batch.tokens,
                     batch_prefix_len(cfg, batch.batch_id, seq_len, step), source, cfg.run.seed)
    return split_job(job, layout.call_rows)
