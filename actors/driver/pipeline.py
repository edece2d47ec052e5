"""The driver: `run_distributed(cfg, run_dir)` runs OPD on Ray and returns the per-step metric
rows, like `opd.run.reference.run_reference` (same rows, same losses in strict mode: invariant 5).
The roles, one step's data flow, faults and the invariants are in docs/ARCHITECTURE.md; per
step k, the reference's order of work:

    plan      next prefix batch, its source and prefix length, cut into parts and pieces
              (planner.py; a `Step`, step.py)
    generate  RolloutWorker.generate(part job, k): one engine call per part, a Ray streaming
              generator that hands out each piece as its rows complete ("teacher": TeacherWorker;
              "data": no call, the suffixes are the data's)
    score     TeacherWorker.score(piece) -> queue.put_piece  (each piece as soon as it is handed out;
              with rollout.span each span as it comes, then the pieces: spans.py; "data":
              TeacherWorker.score_data builds the piece from its job, then scores it)
    train     StudentLearner.train_piece(k, version, piece)  (each piece as soon as it is in the
              queue, in piece order; rank r fetches only its rows; one update after the last)
    seal      queue.seal(k, batch id, version)  (every piece delivered; strict: version k only)
    publish   weights k + 1  (one object-store object, or a broadcast: publisher.py), when a
              fresh student rollout may be made with them (planner.py `rollouts_at`)

The driver only orchestrates: it receives reports and metrics, never a trajectory or a weight
payload.  Each step is a state machine (step.py) that takes the answers of its tasks as events
and returns commands (commands.py); `Pipeline` routes answers to their step (router.py) and
carries out the commands (executor.py), with its parts: planner.py (steps, data cursor), core.py (what spans steps: the version, the
batches consumed, the step in training, its metrics row), dispatch.py (tasks, workers, probes),
publisher.py (weights), records.py (checkpoints, consumed.json), elastic.py (an elastic rollout
pool), evaluation.py (quality at evaluation steps); opd/run/loop.py (progress, rows, checkpoint
cadence) is shared with the reference loop.  Steps not sampled from the student are prepared
ahead (up to `distill.queue_capacity`); with `distill.staleness` k > 0 student rollouts run up
to k versions ahead.  With `distill.reuse` k > 1 a step may train on a buffered rollout
(opd/distill/reuse.py): the learner ranks kept their rows of it, so the step makes nothing, goes
through no queue and consumes no prefix batch (consumed.json counts it under "reused").
Ctrl-C (opd/run/interrupt.py): the step in training finishes, its checkpoint is written, and
the run raises `RunInterrupted`.  Faults: failed workers are probed and their calls or pieces
issued again (step.py); a learner failure stops the run and names the last checkpoint.  Every
prefix batch id is consumed exactly once (consumed.json).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import ray
from tqdm import tqdm

from actors.driver import core
from actors.driver.cluster import ActorGroups, check_distributed, connect
from actors.driver.core import DriverState, PoolCounts
from actors.driver.dispatch import Dispatcher
from actors.driver.elastic import ElasticRollout
from actors.driver.executor import CommandExecutor
from actors.driver.group import fan_out
from actors.driver.nodes import NodeWatch
from actors.driver.planner import StepPlanner
from actors.driver.publisher import WeightPublisher
from actors.driver.records import RunRecords
from actors.driver.router import AnswerRouter
from actors.driver.step import Step
from actors.driver.tasks import PieceTraining
from actors.ray_metrics import RoleMetrics
from actors.workers.evaluation import QualityTracking
from opd.config.schema import RunConfig
from opd.data import PrefixBatcher
from opd.data.splits import open_dataset
from opd.distill.results import LearnerResult
from opd.distill.teachers import teacher_metrics
from opd.run.checkpoints import latest_checkpoint
from opd.run.interrupt import NoInterrupt
from opd.run.loop import StepLog, check_objectives


class Pipeline(CommandExecutor, AnswerRouter):
    """One distributed run on started actor `groups`: the step loop, which carries out the
    commands of its steps (actors/driver/step.py) and of actors/driver/core.py.  Its parts: `planner` (actors/driver/planner.py), `dispatch`
    (actors/driver/dispatch.py), `publisher` (actors/driver/publisher.py), `records` (actors/driver/records.py),
    `elastic` (actors/driver/elastic.py, None for a fixed pool), `quality` (actors/workers/evaluation.py, None
    without eval.track); `state` is the `core.DriverState`.  Hooks (tests) see the pipeline:
    its worker lists `rollout`, `teacher`, `learners`, the `pools` and `reissued`."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, groups: ActorGroups, *,
                 resume: bool = False, progress: bool = True,
                 hooks: dict[str, Callable] | None = None, interrupt=None):
        self.cfg, self.run_dir, self.groups = cfg, Path(run_dir), groups
        self.hooks = hooks or {}
        self.interrupt = interrupt or NoInterrupt()
        self.dispatch = Dispatcher(groups, cfg.cluster.max_restarts)
        self.metrics = RoleMetrics("driver", 0)
        self.idle = {r: RoleMetrics(r, "all") for r in ("rollout", "teacher", "learner")}
        self.teacher_metrics: dict[str, RoleMetrics] = {}    # one per teacher name
        self.records = RunRecords(cfg, self.run_dir, groups.learners)
        self.nodes = NodeWatch(log=lambda line: tqdm.write(f"opd: {line}"))
        for role, infos in groups.infos.items():
            for i in infos:
                self.nodes.placed(role, i["index"], i["node_id"], i["node_ip"])
        self.publisher = WeightPublisher(cfg, groups, self.dispatch, self.metrics, self.records)
        if self.publisher.collective and groups.rollout:
            groups.join_broadcast(cfg)
        self.elastic = ElasticRollout.for_run(cfg, groups, self.dispatch, self.publisher)
        train = open_dataset(cfg, "train")
        batcher = PrefixBatcher(train, cfg.data.batch_size, cfg.run.seed)
        state = {"step": 0, "consumed": []}
        if resume and (path := latest_checkpoint(self.run_dir)) is not None:
            state = self.records.load_checkpoint(path)
            batcher.load_state_dict(state["data"])
        start = int(state["step"])
        self.steps = StepLog(cfg, self.run_dir, start=start, stop_after=None, resume=resume,
                             desc="opd ray", progress=progress)
        self.state = DriverState(start, self.steps.end)
        self.state.consumed.update(state.get("consumed", []))
        self.planner = StepPlanner(cfg, batcher, train.seq_len, start)
        reuse = self.planner.reuse                     # the reuses before a resume, as planned
        self.state.reused.update(reuse.origin(t) for t in range(start) if reuse.reused(t))
        self.quality = (None if groups.evaluator is None else
                        QualityTracking(cfg, self.run_dir, groups.evaluator, resume=resume,
                                        start=start))
        if self.quality is not None:
            self.steps.follow(self.quality.log)

    # -- what the hooks see ---------------------------------------------------------------------

    @property
    def rollout(self) -> list:
        return self.groups.rollout

    @property
    def teacher(self) -> list:
        return self.groups.teacher

    @property
    def learners(self) -> list:
        return self.groups.learners

    @property
    def pools(self) -> dict:
        return self.dispatch.pools

    @property
    def reissued(self) -> int:
        return self.state.reissued

    # -- the run ----------------------------------------------------------------------------------

    def run(self) -> list[dict]:
        self.publisher.publish(self.state.version)
        self._evaluate()
        with self.steps:                       # a failure ends the progress bar's line
            try:
                with self.interrupt.armed():
                    while not self.state.done:
                        if self.interrupt.pending():
                            raise KeyboardInterrupt
                        self._issue()
                        self._wait()           # every answer to its step; what waited to workers
                        self._watch_nodes()
                        if self.quality is not None:
                            self.quality.poll()
            except KeyboardInterrupt:
                interrupted = self._interrupted()
                if self.quality is not None:
                    self.quality.finish(wait=False)
                raise interrupted from None
        if self.quality is not None:
            self.quality.finish()              # the evaluations still running
        self._write_consumed()
        return self.steps.close()

    # -- carrying out a step's commands ---------------------------------------------------------

    def _issue(self) -> None:
        """Plan the next steps that the queue bound and the staleness bound allow."""
        while (step := self.planner.plan(self.state.version, self.publisher.published.version,
                                         self.state.end)) is not None:
            self._execute(step, step.start())

    # -- learning -----------------------------------------------------------------------------------

    def _step_done(self, step: Step, results: list[LearnerResult]) -> None:
        """The step's last piece is trained: checkpoint and publish when due, hand the version
        to the evaluation worker when due, start the steps that waited for the new weights,
        then write the step's row (metrics.parquet and the trackers take milliseconds that a
        strict step would otherwise wait for); then the learner group begins the next step if
        it can."""
        done = core.step_trained(self.state, step, results, time.perf_counter(), self.cfg,
                                 self.planner.rollouts_at)
        self.planner.finish(step.step, self.state.version)
        row = self._row(step, done)
        self.nodes.stepped(step.step)
        self._hook("after_step", step=step.step, row=row)
        if self.elastic is not None:
            self.elastic.after_step(step.step, row)
        try:
            if done.checkpoint:
                self._save_checkpoint()
            if done.publish:
                self.publisher.publish(self.state.version)
            self._evaluate()                       # before the learners get the next step
            if not self.interrupt.pending():       # Ctrl-C: the run ends at this step
                self._issue()
        finally:                                   # a learner that failed: its row is kept
            self.steps.record(row)
        self._start_training()

    def _row(self, step: Step, done: core.StepDone) -> dict:
        pools, sync = self.dispatch.pools, self.publisher.last_sync
        teachers = self.planner.teachers
        alive = sum(len(pools[teachers.pool(i)].alive()) for i in range(len(teachers)))
        row = core.step_metrics(step, done, PoolCounts(len(pools["rollout"].alive()),
                                                       len(pools["rollout"].up()), alive),
                                sync_seconds=sync.seconds, sync_bytes=sync.bytes,
                                reissued=self.state.reissued)
        per_teacher = teacher_metrics(teachers, [r.measure for p in step.pieces
                                                 for r in p.scored.values()
                                                 if r.measure and step.origin is None])
        row.update(per_teacher)
        for name in teachers.names:
            self.teacher_metrics.setdefault(name, RoleMetrics("teacher", name)).report(
                teacher_onpolicy_kl=per_teacher[f"teacher_kl/{name}"],
                teacher_rows=per_teacher[f"teacher_rows/{name}"])
        self.metrics.report(step_seconds=done.wall, queue_depth=row["queue_depth"],
                            policy_lag=row["policy_lag"])
        for role in ("rollout", "teacher", "learner"):
            self.idle[role].set("opd_idle_ratio", row[f"{role}_idle"])
        return row

    def _evaluate(self) -> None:
        """Hand the current version to the evaluation worker when it is an evaluation step:
        the published weights object when it holds this version, else one taken from the
        learners now (before they get the next step; every rank, ZeRO-3 gathers)."""
        v = self.state.version
        if self.quality is None or not self.quality.due(v):
            return
        p = self.publisher.published
        if p.version == v and p.ref is not None:
            ref = p.ref
        else:
            ref = fan_out(self.learners, "get_weights", v)[0]
        self.quality.submit(v, v, ref)

    # -- records ------------------------------------------------------------------------------------

    def _save_checkpoint(self) -> None:
        v = self.state.version
        self.records.save_checkpoint(v, self.planner.cursor[v], self.state.consumed)

    def _write_consumed(self) -> None:
        pools = self.dispatch.pools
        n = len(self.rollout)
        self.records.write_consumed(
            self.state.consumed, reissued=self.state.reissued, queue=self.groups.queue,
            worker_failures={r: p.failures for r, p in pools.items()},
            rollout_workers=(self.elastic.summary() if self.elastic is not None
                             else {"min": n, "max": n}),
            weight_sync="collective" if self.publisher.collective else "object_store",
            nodes=self.nodes.ran_on(), node_events=self.nodes.events, reused=self.state.reused)

    def _interrupted(self):
        """Ctrl-C: the step in training finishes, the current step is checkpointed; returns
        the `RunInterrupted` to raise."""
        step = core.in_training(self.planner.plans)
        if step is not None:
            for ref, task in list(self.dispatch.tasks.items()):
                if isinstance(task, PieceTraining) and task.step == step.step:
                    del self.dispatch.tasks[ref]
                    self._piece_trained(task, ray.get(ref))
            while step.trains and step.training.results is not None:
                self._wait()                   # trained: it is done with its calls' reports
        if core.in_training(self.planner.plans) is not None:   # pieces not made yet: dropped
            fan_out(self.learners, "drop_step", step.step)
        if not self.records.has_checkpoint(self.state.version):
            self._save_checkpoint()
        self._write_consumed()
        return self.steps.interrupted(self.state.version, self.records.last_checkpoint)

    def _hook(self, name: str, **info) -> None:
        fn = self.hooks.get(name)
        if fn is not None:
            fn(self, **info)


def run_distributed(cfg: RunConfig, run_dir: str | Path, *, progress: bool = True,
                    resume: bool = False, hooks: dict[str, Callable] | None = None,
                    interrupt=None) -> list[dict]:
    """Run cfg.distill.steps OPD steps on Ray; returns the per-step metric rows (also in
    run_dir/metrics.parquet), like `opd.run.reference.run_reference`.  `resume` continues from the
    run's latest checkpoint; `hooks` maps event names
    ("after_submit" (kind, step, worker, its pool, and part or piece), "after_piece" (a rollout call handed
    out a piece), "after_part" (a rollout call ended), "after_scored" (a piece delivered by its
    teacher worker), "after_seal" (a step's pieces all in the queue), "after_step" (its row, before
    the elastic policy reads it)) to
    callables(pipeline, **info) (tests inject faults there);
    `interrupt` (opd.run.interrupt.GracefulInterrupt) defers Ctrl-C to a checkpoint: the run then
    raises opd.run.reference.RunInterrupted (also on a plain KeyboardInterrupt)."""
    check_distributed(cfg)
    check_objectives(cfg)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    started_ray = connect(cfg)
    groups, pipeline = ActorGroups(), None
    try:
        groups = ActorGroups.start(cfg, run_dir, progress=progress)
        pipeline = Pipeline(cfg, run_dir, groups, resume=resume, progress=progress, hooks=hooks,
                            interrupt=interrupt)
        return pipeline.run()
    finally:
        if pipeline is not None and pipeline.elastic is not None:
            pipeline.elastic.close()
        groups.shutdown()
        if started_ray:
            ray.shutdown()
