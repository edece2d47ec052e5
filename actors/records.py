"""Checkpoints, the consumed-ids record, learner failures and Ctrl-C of a distributed run.

`RunRecords` is the part of `actors.pipeline.Pipeline` that writes what outlives the run:

    checkpoints/step_<n>/     the layout of opd/checkpoints.py: student.pt (learner rank 0),
                              optimizer/ (DeepSpeed's files of every rank), state.json (step,
                              policy version, data cursor, consumed batch ids, mode "ray")
    consumed.json             every prefix batch id with its use count (must be 1), re-issued
                              jobs, sample lags ({lag: samples}), queue stats, worker failures,
                              rollout pool events

Its methods use the pipeline's state (learners, cursor, consumed, pools, queue, ...).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import ray
from ray.exceptions import RayActorError

from opd import checkpoints as ckpt
from opd.checkpoints import CHECKPOINTS  # noqa: F401  (re-exported by actors.pipeline)
from opd.reference import RunInterrupted

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


class RunRecords:
    """Mixin of `Pipeline`: checkpoints, consumed.json, learner failures, Ctrl-C."""

    def _learner_failure(self, what: str, step: int, error: Exception) -> LearnerFailure:
        return LearnerFailure(
            f"the learner group failed ({what}, step {step}: {type(error).__name__}); the run "
            f"stopped. Last checkpoint: {self.last_checkpoint or 'none'}"
            + (f" (continue with `--resume {self.run_dir}`)" if self.last_checkpoint else ""),
            self.last_checkpoint)

    def _interrupted(self) -> RunInterrupted:
        """Ctrl-C: the step in training finishes, the current step is checkpointed."""
        if self.training is not None:
            for ref, task in list(self.tasks.items()):
                if task.kind == "train":
                    del self.tasks[ref]
                    self.training["results"][task.worker] = ray.get(ref)
            self._train_finished()
        if not (self.last_checkpoint or "").endswith(f"step_{self.version:06d}"):
            self._save_checkpoint()
        self.bar.close()
        self.log.flush()
        self._write_consumed()
        return RunInterrupted(self.version, self.last_checkpoint, self.run_dir)

    def _save_checkpoint(self) -> None:
        """Every learner rank saves into checkpoints/step_N.tmp; once all have returned, the
        driver writes state.json and renames the directory into place (opd.checkpoints.commit)."""
        step = self.version
        with ckpt.writing(self.run_dir, step) as tmp:   # an OSError of a rank: CheckpointWriteError
            try:
                ray.get([a.save_checkpoint.remote(str(tmp)) for a in self.learners])
            except RayActorError as e:
                raise self._learner_failure("checkpoint", step, e) from e
            state = ckpt.checkpoint_state(self.cfg, step, self.cursor[step], "ray",
                                          consumed=sorted(self.consumed.elements()))
            self.last_checkpoint = str(ckpt.commit(tmp, state))

    def _load_checkpoint(self, path: Path) -> int:
        state = ckpt.read_state(path, mode="ray")
        step = int(state["step"])
        ray.get([a.load_checkpoint.remote(str(path), step) for a in self.learners])
        self.batcher.load_state_dict(state["data"])
        self.consumed.update(state.get("consumed", []))
        self.last_checkpoint = str(path)
        return step

    def _write_consumed(self) -> None:
        queue = self.groups.queue
        record = {"consumed": {str(k): v for k, v in sorted(self.consumed.items())},
                  "reissued": self.reissued,
                  "lags": {str(k): n for k, n in ray.get(queue.lags.remote()).items()},
                  "queue": ray.get(queue.stats.remote()),
                  "worker_failures": {r: p.failures for r, p in self.pools.items()},
                  "rollout_workers": (self.elastic.summary() if self.elastic is not None
                                      else {"min": len(self.rollout), "max": len(self.rollout)}),
                  "weight_sync": "collective" if self.collective else "object_store"}
        tmp = self.run_dir / (CONSUMED_FILE + ".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, self.run_dir / CONSUMED_FILE)
        twice = {b: n for b, n in self.consumed.items() if n != 1}
        if twice:
            raise RuntimeError(f"batch ids consumed more than once: {twice}")
