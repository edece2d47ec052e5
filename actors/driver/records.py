"""What a distributed run writes that outlives it: checkpoints and consumed.json.

    checkpoints/step_<n>/     the layout of opd/run/checkpoints.py: student.pt (learner rank 0),
                              optimizer/ (DeepSpeed's files of every rank), state.json (step,
                              policy version, data cursor, consumed batch ids, mode "ray")
    consumed.json             every prefix batch id with its use count (must be 1), re-issued
                              jobs, sample lags ({lag: samples}), queue stats, worker failures,
                              rollout pool events, the nodes each role ran on and the nodes
                              lost or added (actors/driver/nodes.py)

`RunRecords` gets everything it writes as arguments; the metrics.parquet row of a step is
`actors.driver.core.step_metrics`.  A learner group that fails stops the run with `LearnerFailure`
naming the last checkpoint written here.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import ray
from ray.exceptions import RayActorError

from actors.driver.group import call_all
from opd.run import checkpoints as ckpt
from opd.config.schema import RunConfig

CONSUMED_FILE = "consumed.json"


class LearnerFailure(RuntimeError):
    """The learner group failed and the run stopped; `checkpoint` is the last one written."""

    def __init__(self, message: str, checkpoint: str | None):
        super().__init__(message)
        self.checkpoint = checkpoint


class RunRecords:
    """The run directory's checkpoints (written by `learners`, committed here) and consumed.json."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, learners: list):
        self.cfg, self.run_dir, self.learners = cfg, Path(run_dir), learners
        self.last_checkpoint: str | None = None

    def learner_failure(self, what: str, step: int, error: Exception) -> LearnerFailure:
        """The error that stops the run when a learner call (`what`) of `step` failed."""
        last = self.last_checkpoint
        return LearnerFailure(
            f"the learner group failed ({what}, step {step}: {type(error).__name__}); the run "
            f"stopped. Last checkpoint: {last or 'none'}"
            + (f" (continue with `--resume {self.run_dir}`)" if last else ""), last)

    def has_checkpoint(self, step: int) -> bool:
        return (self.last_checkpoint or "").endswith(f"step_{step:06d}")

    def save_checkpoint(self, step: int, cursor: dict, consumed: Counter[int]) -> None:
        """Every learner rank saves into checkpoints/step_N.tmp; once all have returned, the
        driver writes state.json (`cursor`: the data cursor before step N's batch) and renames
        the directory into place (opd.run.checkpoints.commit)."""
        with ckpt.writing(self.run_dir, step) as tmp:   # an OSError of a rank: CheckpointWriteError
            try:
                call_all(self.learners, "save_checkpoint", str(tmp))
            except RayActorError as e:
                raise self.learner_failure("checkpoint", step, e) from e
            state = ckpt.checkpoint_state(self.cfg, step, cursor, "ray",
                                          consumed=sorted(consumed.elements()))
            self.last_checkpoint = str(ckpt.commit(tmp, state))

    def load_checkpoint(self, path: Path) -> dict:
        """Restore every learner rank from checkpoint `path`; returns its state.json (step, data
        cursor, consumed batch ids) for the driver."""
        state = ckpt.read_state(path, mode="ray")
        call_all(self.learners, "load_checkpoint", str(path), int(state["step"]))
        self.last_checkpoint = str(path)
        return state

    def write_consumed(self, consumed: Counter[int], *, reissued: int, queue,
                       worker_failures: dict[str, int], rollout_workers: dict,
                       weight_sync: str, nodes: dict[str, list[dict]] | None = None,
                       node_events: list[dict] | None = None,
                       reused: Counter[int] | None = None) -> None:
        """consumed.json (the queue's lags and stats asked of `queue`; `reused`: step -> times
        its buffered rollout trained again, opd/distill/reuse.py); raises if a batch id was
        consumed other than once."""
        record = {"consumed": {str(k): v for k, v in sorted(consumed.items())},
                  "reused": {str(k): v for k, v in sorted((reused or {}).items())},
                  "reissued": reissued,
                  "lags": {str(k): n for k, n in ray.get(queue.lags.remote()).items()},
                  "queue": ray.get(queue.stats.remote()),
                  "worker_failures": worker_failures,
                  "rollout_workers": rollout_workers,
                  "weight_sync": weight_sync,
                  "nodes": nodes or {}, "node_events": node_events or []}
        tmp = self.run_dir / (CONSUMED_FILE + ".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, self.run_dir / CONSUMED_FILE)
        twice = {b: n for b, n in consumed.items() if n != 1}
        if twice:
            raise RuntimeError(f"batch ids consumed more than once: {twice}")
