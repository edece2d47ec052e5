"""What a distributed run writes that outlives it, and its metric rows.

`RunRecords` is the part of `actors.pipeline.Pipeline` that writes:

    checkpoints/step_<n>/     the layout of opd/checkpoints.py: student.pt (learner rank 0),
                              optimizer/ (DeepSpeed's files of every rank), state.json (step,
                              policy version, data cursor, consumed batch ids, mode "ray")
    consumed.json             every prefix batch id with its use count (must be 1), re-issued
                              jobs, sample lags ({lag: samples}), queue stats, worker failures,
                              rollout pool events
    metrics.parquet rows      the reference loop's columns (opd.reference.step_row) plus the
                              pipeline's own (queue depth, policy lag, idle ratios, bytes)

Its methods use the pipeline's state (learners, planner cursor, consumed, pools, queue, ...).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.exceptions import RayActorError

from actors.elastic import rollout_wait_fraction
from actors.learner import combine_rank_metrics
from actors.shards import merge_stats
from actors.tasks import StepPlan, TaskKind
from opd import checkpoints as ckpt
from opd.checkpoints import CHECKPOINTS  # noqa: F401  (re-exported by actors.pipeline)
from opd.loop import RunInterrupted
from opd.reference import step_row

CONSUMED_FILE = "consumed.json"


def lag_histogram(record: dict) -> dict[int, int]:
    """{lag: samples} of a consumed.json record; also reads the older list of one lag per sample."""
    lags = record.get("lags", {})
    if isinstance(lags, list):
        return {lag: lags.count(lag) for lag in sorted(set(lags))}
    return {int(k): n for k, n in lags.items()}


class LearnerFailure(RuntimeError):
    """The learner group failed and the run stopped; `checkpoint` is the last one written."""

    def __init__(self, message: str, checkpoint: str | None):
        super().__init__(message)
        self.checkpoint = checkpoint


@dataclass
class BatchSummary:
    """What a step row needs of the trained batch, from its parts' reports (no payload)."""
    batch_id: int
    policy_version: int
    source: str
    prefix_len: int
    rollout_stats: dict
    num_generated_tokens: int
    batch_size: int
    seq_len: int

    @classmethod
    def of(cls, plan: StepPlan) -> BatchSummary:
        reports = [plan.delivered[p] for p in range(plan.parts)]
        job = plan.jobs[0]
        return cls(plan.batch_id, plan.version, plan.source, job.prefix_len,
                   merge_stats([r.stats for r in reports]),
                   sum(r.generated_tokens for r in reports), sum(r.rows for r in reports),
                   int(job.tokens.shape[1]))


class RunRecords:
    """Mixin of `Pipeline`: checkpoints, consumed.json, rows, learner failures, Ctrl-C."""

    def _learner_failure(self, what: str, step: int, error: Exception) -> LearnerFailure:
        return LearnerFailure(
            f"the learner group failed ({what}, step {step}: {type(error).__name__}); the run "
            f"stopped. Last checkpoint: {self.last_checkpoint or 'none'}"
            + (f" (continue with `--resume {self.run_dir}`)" if self.last_checkpoint else ""),
            self.last_checkpoint)

    def _interrupted(self) -> RunInterrupted:
        """Ctrl-C: the step in training finishes, the current step is checkpointed."""
        if self.training is not None:
            for ref, task in list(self.dispatch.tasks.items()):
                if task.step == self.training.step and task.kind is TaskKind.TRAIN:
                    del self.dispatch.tasks[ref]
                    self._trained(task, ray.get(ref))
        if not (self.last_checkpoint or "").endswith(f"step_{self.version:06d}"):
            self._save_checkpoint()
        self._write_consumed()
        return self.steps.interrupted(self.version, self.last_checkpoint)

    def _save_checkpoint(self) -> None:
        """Every learner rank saves into checkpoints/step_N.tmp; once all have returned, the
        driver writes state.json and renames the directory into place (opd.checkpoints.commit)."""
        step = self.version
        with ckpt.writing(self.run_dir, step) as tmp:   # an OSError of a rank: CheckpointWriteError
            try:
                ray.get([a.save_checkpoint.remote(str(tmp)) for a in self.groups.learners])
            except RayActorError as e:
                raise self._learner_failure("checkpoint", step, e) from e
            state = ckpt.checkpoint_state(self.cfg, step, self.planner.cursor[step], "ray",
                                          consumed=sorted(self.consumed.elements()))
            self.last_checkpoint = str(ckpt.commit(tmp, state))

    def _load_checkpoint(self, path: Path, batcher) -> int:
        state = ckpt.read_state(path, mode="ray")
        step = int(state["step"])
        ray.get([a.load_checkpoint.remote(str(path), step) for a in self.groups.learners])
        batcher.load_state_dict(state["data"])
        self.consumed.update(state.get("consumed", []))
        self.last_checkpoint = str(path)
        return step

    def _write_consumed(self) -> None:
        queue = self.groups.queue
        pools = self.dispatch.pools
        record = {"consumed": {str(k): v for k, v in sorted(self.consumed.items())},
                  "reissued": self.reissued,
                  "lags": {str(k): n for k, n in ray.get(queue.lags.remote()).items()},
                  "queue": ray.get(queue.stats.remote()),
                  "worker_failures": {r: p.failures for r, p in pools.items()},
                  "rollout_workers": (self.elastic.summary() if self.elastic is not None
                                      else {"min": len(self.rollout), "max": len(self.rollout)}),
                  "weight_sync": "collective" if self.publisher.collective else "object_store"}
        tmp = self.run_dir / (CONSUMED_FILE + ".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, self.run_dir / CONSUMED_FILE)
        twice = {b: n for b, n in self.consumed.items() if n != 1}
        if twice:
            raise RuntimeError(f"batch ids consumed more than once: {twice}")

    def _row(self, plan: StepPlan, results: list[dict], learner_start: float, now: float,
             wall: float) -> dict:
        """The metrics.parquet row: the reference's columns plus the pipeline's own."""
        traj = BatchSummary.of(plan)
        seconds = {"rollout": max(0.0, plan.rollout_done - plan.issued),
                   "teacher": max(0.0, plan.score_done - plan.score_started) if plan.scored else 0.0,
                   "learner": now - learner_start}
        row = step_row(plan.step, traj, combine_rank_metrics(results), seconds, phase=plan.phase)
        depth = results[0]["queue_depth"]
        pools = self.dispatch.pools
        R, M = len(pools["rollout"].alive()), len(pools["teacher"].alive())
        sync = self.publisher.last_sync
        row.update({
            "step_s": wall, "weight_sync_s": sync.seconds,
            "weight_bytes": sync.bytes, "queue_depth": depth,
            "policy_lag": plan.step - plan.version, "samples_per_s": plan.samples / wall,
            "teacher_tokens_per_s": (traj.batch_size * traj.seq_len / seconds["teacher"]
                                     if seconds["teacher"] > 0 else 0.0),
            "rollout_idle": max(0.0, 1 - plan.rollout_busy / (R * wall)) if R else 1.0,
            "teacher_idle": max(0.0, 1 - plan.teacher_busy / (M * wall)) if M else 1.0,
            "learner_idle": max(0.0, 1 - seconds["learner"] / wall), "reissued": self.reissued,
            "rollout_workers": len(pools["rollout"].up()),
            "delivered_bytes": sum(r.nbytes for r in plan.delivered.values()),
            "learner_received_bytes": [int(r["received_bytes"]) for r in results],
            "rollout_wait": rollout_wait_fraction(plan.source, plan.issued, plan.rollout_done,
                                                  now - wall, learner_start, wall)})
        self.metrics.report(step_seconds=wall, queue_depth=depth, policy_lag=row["policy_lag"])
        for role in ("rollout", "teacher", "learner"):
            self.idle[role].set("opd_idle_ratio", row[f"{role}_idle"])
        return row
