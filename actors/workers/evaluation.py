"""Quality over training on Ray: an evaluation worker, and the driver's side of it.

    EvaluationWorker     (wrapped by `ray.remote` in actors/driver/cluster.py) the teacher, a student
                         copy, the reference set: `opd.eval.tracking.Evaluator` in a worker
    QualityTracking      the driver's record: submits an evaluation of version k with the
                         published weights object of version k, collects rows as they finish
                         (quality.parquet), waits for the rest when the run ends

The driver never loads a model for this: an evaluation is one actor call that takes the same
object-store weights payload the rollout workers load (actors/transport/weights.py), and the training
loop goes on while it runs.  The actor runs its calls in order, so the teacher's row comes
first and the student's rows follow in step order.  A failed evaluation is reported and
dropped: quality tracking never stops a run.
"""
from __future__ import annotations

import sys
from pathlib import Path

import ray

from actors.workers.base import Worker
from opd.config.schema import RunConfig
from opd.eval.tracking import Evaluator, has_row, is_eval_step, quality_log
from opd.distill.ensemble import load_teacher


class EvaluationWorker(Worker):
    """One evaluation worker: `teacher_row()` once, `evaluate(step, version, payload)` per
    evaluation (payload: the tagged weights of `version`, loaded by `Worker.load_weights`);
    `version` is the one it evaluated last."""
    role = "evaluation"

    def __init__(self, cfg: RunConfig | dict, run_dir: str):
        super().__init__(cfg, 0)
        self.run_dir = Path(run_dir)
        teacher = load_teacher(self.cfg, progress=False, device=self.device)   # as one model
        self.evaluator = Evaluator(self.cfg, teacher)
        self.model = self.evaluator.student

    def teacher_row(self) -> dict:
        """The teacher's quality row (cached across runs) and samples/teacher.png."""
        return self.evaluator.teacher_row(self.run_dir)

    def evaluate(self, step: int, version: int, payload: dict) -> dict:
        """Load the weights of `version` into the student copy and evaluate them as `step`
        (writes samples/student_step_<step>.png); returns the quality row."""
        self.load_weights(version, payload)
        return self.evaluator.student_row(step, self.run_dir)


class QualityTracking:
    """The driver's side: quality.parquet and the evaluations in flight."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, worker, *, resume: bool, start: int):
        self.cfg, self.worker = cfg, worker
        self.log = quality_log(run_dir, resume=resume, start=start)
        self.pending: dict[ray.ObjectRef, str] = {}         # ref -> what it evaluates
        self.submitted: set[int] = set()
        if not has_row(self.log.rows, "teacher"):
            self.pending[worker.teacher_row.remote()] = "teacher"

    def due(self, step: int) -> bool:
        """An evaluation step with neither a row nor an evaluation in flight."""
        return (is_eval_step(self.cfg, step) and step not in self.submitted
                and not has_row(self.log.rows, "student", step))

    def submit(self, step: int, version: int, weights: ray.ObjectRef) -> None:
        """Evaluate the weights object `weights` (tagged `version`) as step `step`."""
        self.submitted.add(step)
        self.pending[self.worker.evaluate.remote(step, version, weights)] = f"step {step}"

    def poll(self, timeout: float = 0.0) -> None:
        """Append the rows of finished evaluations (waits up to `timeout` s for one)."""
        if not self.pending:
            return
        done, _ = ray.wait(list(self.pending), num_returns=len(self.pending), timeout=timeout)
        for ref in done:
            what = self.pending.pop(ref)
            try:
                self.log.append(ray.get(ref))
            except ray.exceptions.RayError as e:
                print(f"opd: quality evaluation of the {what} failed and is left out of "
                      f"quality.parquet: {type(e).__name__}: {str(e).splitlines()[0]}",
                      file=sys.stderr, flush=True)

    def finish(self, *, wait: bool = True) -> list[dict]:
        """Collect every evaluation still in flight (`wait`), or only those already done."""
        while self.pending and wait:
            self.poll(timeout=None)
        self.poll()
        self.pending.clear()
        self.log.flush()
        return self.log.rows
