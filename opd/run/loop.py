"""What every run's step loop shares, reference (opd/run/reference.py) and distributed
(actors/driver/pipeline.py): the metrics log and progress bar, a step's metrics.parquet row
(`step_row`), the checkpoint cadence (`checkpoint_due`), the stop after Ctrl-C, and the check
of the teacher transport against every phase's objective (`check_objectives`).

    with StepLog(cfg, run_dir, start=0, stop_after=None, resume=False, desc="opd reference") as steps:
        for step in range(steps.start, steps.end):
            ...                                      # one step; row = its metrics
            steps.record(row)
            if steps.checkpoint_due(step + 1): save the checkpoint of version step + 1
        return steps.close()
    # Ctrl-C: save the current version's checkpoint, then  raise steps.interrupted(v, path)
"""
from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from opd.config.schema import RunConfig
from opd.config.loader import ConfigError
from opd.run.metrics_log import MetricsLog
from opd.distill.phases import objectives, phases
from opd.distill.steps import needs_teacher_scores
from opd.run.trackers import RunTrackers


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a run after it checkpointed step `step` (resume with `--resume run_dir`)."""

    def __init__(self, step: int, checkpoint: str, run_dir: str | Path):
        super().__init__(f"interrupted at step {step}; checkpoint {checkpoint}")
        self.step, self.checkpoint, self.run_dir = step, str(checkpoint), str(run_dir)


def checkpoint_due(cfg: RunConfig, version: int) -> bool:
    """Is the checkpoint of `version` (= learner steps done) due: every run.checkpoint_every
    steps and at the run's last step."""
    every = cfg.run.checkpoint_every
    return bool(every and version % every == 0) or version == cfg.distill.steps


class StepLog:
    """Steps [start, end) of a run: metrics.parquet rows (a resumed run keeps the rows before
    `start`), a tqdm bar over all cfg.distill.steps, when a checkpoint is due, and the run's
    experiment trackers (`trackers`, opd/run/trackers.py: every row, and the quality rows of the
    log passed to `follow`)."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, *, start: int, stop_after: int | None,
                 resume: bool, desc: str, progress: bool):
        self.cfg, self.run_dir, self.start = cfg, Path(run_dir), start
        self.end = cfg.distill.steps if stop_after is None else min(cfg.distill.steps,
                                                                     start + stop_after)
        self.log = MetricsLog(run_dir, flush_every=cfg.run.log_every, resume=resume)
        self.log.truncate(start)
        self.bar = tqdm(total=cfg.distill.steps, initial=start, desc=desc, disable=not progress,
                        dynamic_ncols=True)
        self.rollout_figures: dict[str, str] = {}    # of the last step on student rollouts
        self.trackers = RunTrackers(cfg, run_dir, start=start, resume=resume)

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        """A step that failed: end the bar's line, so the error is a line of its own."""
        if exc_type is not None:
            self.bar.close()
            self.trackers.close()

    @property
    def rows(self) -> list[dict]:
        return self.log.rows

    def follow(self, quality_log) -> None:
        """Send the rows of quality.parquet's log (opd/eval/tracking.py) to the trackers too."""
        self.trackers.follow(quality_log)

    def record(self, row: dict) -> None:
        """One step's row: into the log (flushed every run.log_every rows), the trackers and
        the bar."""
        self.log.append(row)
        self.trackers.step(self.log.rows[-1])
        self.bar.update(1)
        if row.get("source") == "student" and not row.get("reused"):   # rollout figures only
            #                                                           where there are rollouts
            ar = row.get("ar_rounds") or 0
            self.rollout_figures = {"tok_s": f"{row['rollout_tokens_per_s']:.0f}",
                                    "commit": f"{row['mean_committed']:.2f}",
                                    "rounds/AR": f"{row['rounds'] / ar:.2f}" if ar else "-"}
        self.bar.set_postfix(phase=row.get("phase", ""), loss=f"{row['loss']:.4f}",
                             **self.rollout_figures)

    def checkpoint_due(self, version: int) -> bool:
        return checkpoint_due(self.cfg, version)

    def close(self) -> list[dict]:
        self.bar.close()
        self.log.flush()
        self.trackers.close()
        return self.log.rows

    def interrupted(self, version: int, checkpoint: str | Path) -> RunInterrupted:
        """After Ctrl-C, once the checkpoint of `version` is written: close, and what to raise."""
        self.close()
        return RunInterrupted(version, str(checkpoint), self.run_dir)


def check_objectives(cfg: RunConfig) -> None:
    """The teacher transport must be one that every phase's objective supports.  Checked when a
    run starts, not with the config on load: the objectives say what they take (opd/distill,
    which imports torch) and the config's schema imports no torch."""
    transport = cfg.teachers[0].transport     # one for every teacher (config)
    tkey = "teachers[0].transport"
    for phase, objective in zip(phases(cfg), objectives(cfg)):
        if needs_teacher_scores(objective) and not objective.supports(transport):
            key = (f"distill.phases[{phase.index}].objective" if cfg.distill.phases
                   else "distill.objective")
            raise ConfigError(f"{tkey}={transport!r} is not supported by "
                              f"{key}={objective.name!r}; use one of {objective.needs}", tkey)


def step_row(step: int, traj, metrics: dict, seconds: dict, *, phase: str,
             reused: bool = False) -> dict:
    """The metrics.parquet row of one step (`phase`: the name of its distill.phases entry;
    `traj.rollout_stats` a `RolloutStats`, its columns `RolloutStats.row`; `reused`: it trained
    on a buffered rollout, opd/distill/reuse.py, made at `policy_version`, `policy_lag` versions
    ago).  `ar_rounds` is the rounds Cached AR needs for the same tokens, so rounds / ar_rounds
    is what the rollout engine saved."""
    gen = traj.num_generated_tokens
    roll = seconds.get("rollout", 0.0)
    return {"step": step, "phase": phase, "batch_id": traj.batch_id,
            "policy_version": traj.policy_version, "policy_lag": step - traj.policy_version,
            "reused": reused,
            "source": traj.source, "prefix_len": traj.prefix_len,
            **{k: v for k, v in metrics.items()},
            "rollout_s": roll, "teacher_s": seconds.get("teacher", 0.0),
            "learner_s": seconds.get("learner", 0.0), "step_s": sum(seconds.values()),
            **traj.rollout_stats.row(),
            "generated_tokens": gen,
            "rollout_tokens_per_s": gen / roll if roll > 0 and traj.source != "data" else 0.0}
