"""The driver: `run_distributed(cfg, run_dir)` runs OPD on Ray and returns the per-step metric
rows, like `opd.run.reference.run_reference` (same rows, same losses in strict mode: invariant 5).
The roles, one step's data flow, faults and the invariants are in docs/ARCHITECTURE.md; per
step k, the reference's order of work:

    plan      next prefix batch, its source and prefix length, cut into its pieces  (planner.py)
    generate  RolloutWorker.generate(job, k)  ("teacher": TeacherWorker; "data": no model)
    score     TeacherWorker.score(part) -> queue.put_part  (each part as soon as it is made)
    train     StudentLearner.train_piece(k, version, part)  (each piece as soon as it is in the
              queue, in piece order; rank r fetches only its rows; one update after the last)
    seal      queue.seal(k, batch id, version)  (every part reported; strict: version k only)
    publish   weights k + 1  (one object-store object, or a broadcast: publisher.py)

The driver only orchestrates: it receives reports and metrics, never a trajectory or a weight
payload.  What it decides (which parts to submit, which steps to seal and train, what to publish
and record) is actors/driver/core.py, plain functions over its typed state tested without Ray;
`Pipeline` executes them with its parts: planner.py (plans, data cursor), dispatch.py (tasks,
workers, probes), publisher.py (weights), records.py (checkpoints, consumed.json), elastic.py
(an elastic rollout pool), evaluation.py (quality at evaluation steps); opd/run/loop.py (progress,
rows, checkpoint cadence) is shared with the reference loop.  Steps not sampled from the
student are prepared ahead (up to `distill.queue_capacity`); with `distill.staleness` k > 0
student rollouts run up to k versions ahead.  Ctrl-C (opd/run/interrupt.py): the step in
training finishes, its checkpoint is written, and the run raises `RunInterrupted`.  Faults:
failed workers are probed and their parts issued again (`core.retry`); a learner failure stops
the run and names the last checkpoint.  Every prefix batch id is consumed exactly once
(consumed.json).

Over 400 lines: the executor of every decision (the loop, each kind of answer, each fault) is
kept in one class so the order in which the driver acts reads top to bottom in one file.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import ray
from ray.exceptions import ActorDiedError, RayActorError
from tqdm import tqdm

from actors.driver import core
from actors.driver.cluster import ActorGroups, bundle_node, check_distributed, connect
from actors.driver.core import DriverState, PartNext, PoolCounts, Retry
from actors.driver.dispatch import Dispatcher
from actors.driver.elastic import ElasticRollout
from actors.driver.group import fan_out
from opd.run.interrupt import NoInterrupt
from actors.driver.nodes import NodeWatch
from actors.driver.planner import StepPlanner
from actors.driver.publisher import WeightPublisher
from actors.driver.records import RunRecords
from actors.driver.tasks import StepPlan, Task, TaskKind
from actors.ray_metrics import RoleMetrics
from actors.transport.delivery import PartTag, deliver, put_payload, report as part_report
from actors.workers.evaluation import QualityTracking
from actors.workers.queue import QueueItem
from actors.workers.rollout import StaleWeightsError
from opd.run.checkpoints import latest_checkpoint
from opd.config.schema import RunConfig
from opd.data import PrefixBatcher
from opd.run.loop import StepLog, check_objectives
from opd.distill.pieces import take_rows
from opd.distill.results import PieceAnswer
from opd.data.splits import open_dataset
from opd.distill.steps import generate

WAIT_S = 30.0


class Pipeline:
    """One distributed run on started actor `groups`: the step loop, which executes the
    decisions of actors/driver/core.py.  Its parts: `planner` (actors/driver/planner.py), `dispatch`
    (actors/driver/dispatch.py), `publisher` (actors/driver/publisher.py), `records` (actors/driver/records.py),
    `elastic` (actors/driver/elastic.py, None for a fixed pool), `quality` (actors/workers/evaluation.py, None
    without eval.track); `state` is the `core.DriverState`.  Hooks (tests) see the pipeline:
    its worker lists `rollout`, `teacher`, `learners`, the `pools` and `reissued`."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, groups: ActorGroups, *,
                 resume: bool = False, stop_after: int | None = None, progress: bool = True,
                 hooks: dict[str, Callable] | None = None, interrupt=None):
        self.cfg, self.run_dir, self.groups = cfg, Path(run_dir), groups
        self.hooks = hooks or {}
        self.interrupt = interrupt or NoInterrupt()
        self.dispatch = Dispatcher(groups, cfg.cluster.max_restarts)
        self.metrics = RoleMetrics("driver", 0)
        self.idle = {r: RoleMetrics(r, "all") for r in ("rollout", "teacher", "learner")}
        self.records = RunRecords(cfg, self.run_dir, groups.learners)
        self.nodes = NodeWatch(log=lambda line: tqdm.write(f"opd: {line}"))
        for role, infos in groups.infos.items():
            for i in infos:
                self.nodes.placed(role, i["index"], i["node_id"], i["node_ip"])
        self.publisher = WeightPublisher(cfg, groups, self.dispatch, self.metrics, self.records)
        if self.publisher.collective and groups.rollout:
            groups.join_broadcast(cfg)
        wait_hook = self.hooks.get("rollout_wait")
        self.elastic = ElasticRollout.for_run(
            cfg, groups, self.dispatch, self.publisher,
            None if wait_hook is None else lambda step, row: wait_hook(self, step=step, row=row))
        train = open_dataset(cfg, "train")
        batcher = PrefixBatcher(train, cfg.data.batch_size, cfg.run.seed)
        state = {"step": 0, "consumed": []}
        if resume and (path := latest_checkpoint(self.run_dir)) is not None:
            state = self.records.load_checkpoint(path)
            batcher.load_state_dict(state["data"])
        start = int(state["step"])
        self.steps = StepLog(cfg, self.run_dir, start=start, stop_after=stop_after,
                             resume=resume, desc="opd ray", progress=progress)
        self.state = DriverState(start, self.steps.end)
        self.state.consumed.update(state.get("consumed", []))
        self.planner = StepPlanner(cfg, batcher, train.seq_len, start)
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
                        self._dispatch()
                        self._seal()
                        self._train()
                        self._wait()
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

    # -- issuing work -------------------------------------------------------------------------------

    def _issue(self) -> None:
        """Plan the next steps that the queue bound and the staleness bound allow."""
        while (plan := self.planner.plan(self.state.version, self.publisher.published.version,
                                         self.state.end)) is not None:
            self._submit_parts(plan)

    def _submit_parts(self, plan: StepPlan) -> None:
        for part in range(plan.parts):
            self._submit_generate(plan, part)

    def _tag(self, plan: StepPlan, piece: int) -> PartTag:
        return PartTag(plan.step, plan.gen, piece, plan.cuts[piece], plan.version,
                       plan.ranges[piece])

    def _submit(self, kind: TaskKind, plan: StepPlan, part: int, call: Callable) -> None:
        worker = self.dispatch.submit(kind, plan, part, call)
        if worker is not None:
            self._hook("after_submit", kind=kind.value, step=plan.step, part=part, worker=worker)

    def _submit_generate(self, plan: StepPlan, part: int) -> None:
        """Generate a part: delivered straight into the queue piece by piece, or whole for a
        teacher to score each of its pieces."""
        tags = None if plan.scored else [self._tag(plan, p) for p in plan.pieces_of[part]]
        job, queue, version = plan.jobs[part], self.groups.queue, plan.version
        if plan.source == "data":               # no model: the suffix comes from the data
            traj = generate(None, None, job, self.cfg, policy_version=plan.version)
            if tags is None:
                made = put_payload(traj, 0.0)
            else:
                sent = [deliver(take_rows(traj, *t.rows), t, queue, 0.0) for t in tags]
                made = part_report(traj, sum(r.nbytes for r in sent), 0.0)
            self._generated(plan, part, made)
            return
        kind = TaskKind.ROLLOUT if plan.source == "student" else TaskKind.TEACHER_ROLLOUT
        self._submit(kind, plan, part, lambda actor: actor.generate.remote(job, version, tags, queue))

    def _submit_score(self, plan: StepPlan, piece: int) -> None:
        """Score one piece of a generated part (the teacher takes its rows of the part)."""
        made = plan.generated.get(plan.part_of(piece))
        if made is None:                         # being made again: scored when it is
            return
        plan.times.begin("teacher", time.perf_counter())
        plan.scoring.add(piece)
        payload = made.payload
        tag, queue = self._tag(plan, piece), self.groups.queue
        self._submit(TaskKind.SCORE, plan, piece,
                     lambda actor: actor.score.remote(payload, tag, queue))

    def _dispatch(self) -> None:
        """Hand waiting parts to workers that are up (failed workers are probed when due)."""
        for kind, step, part in self.dispatch.waiting():
            plan = self.planner.plans.get(step)
            if plan is None:
                continue
            if kind is TaskKind.SCORE:
                self._submit_score(plan, part)
            else:
                self._submit_generate(plan, part)
        if self.elastic is not None:
            self.elastic.tick()

    def _generated(self, plan: StepPlan, part: int, report, busy: float = 0.0,
                   worker: int = -1) -> None:
        nxt = core.part_generated(plan, part, report, busy, time.perf_counter())
        if nxt is PartNext.DUPLICATE:
            return
        self._hook("after_part", step=plan.step, part=part, worker=worker)
        if nxt is PartNext.SCORE:
            for piece in core.to_score(plan, part):
                self._submit_score(plan, piece)

    def _seal(self) -> None:
        """Steps whose parts are all delivered become queue items, in step order, while the
        queue has room (backpressure: try again later)."""
        for plan in core.sealable(self.planner.plans):
            item = QueueItem(plan.step, plan.batch_id, plan.version, samples=plan.samples,
                             generated_tokens=sum(r.generated_tokens
                                                  for r in plan.delivered.values()))
            if not ray.get(self.groups.queue.seal.remote(item, plan.gen, plan.pieces)):
                return
            plan.sealed = True
            self._hook("after_seal", step=plan.step)

    def _replan(self, plan: StepPlan) -> None:
        """Generate every part of `plan` again (a new generation)."""
        self.dispatch.forget_step(plan.step)
        self.planner.replan(plan, core.replan_version(plan, self.publisher.published.version))
        self.state.reissued += plan.parts
        self._submit_parts(plan)

    # -- learning -----------------------------------------------------------------------------------

    def _train(self) -> None:
        """Hand the learner ranks the pieces of the current step that are there, in piece order
        (the step begins with its first piece: docs/STREAMING.md)."""
        t = self.state.training or core.start_training(self.state, self.planner.plans,
                                                       self.publisher.published.version)
        if t is None:
            return
        plan = self.planner.plans[t.step]
        job = plan.jobs[0]
        tokens = plan.samples * (int(job.tokens.shape[1]) - job.prefix_len)   # the step's N
        for part in core.pieces_to_train(t, plan):
            refs = fan_out(self.learners, "train_piece", plan.step, self.state.version, t.gen,
                           part, plan.pieces, tokens, t.prefetch)
            for r, ref in enumerate(refs):
                self.dispatch.track(ref, Task(TaskKind.TRAIN, "learner", plan.step, part=part,
                                              worker=r, version=t.handed[part]))

    def _trained(self, task: Task, value: PieceAnswer) -> None:
        t = self.state.training
        if t is None or t.step != task.step:
            return
        plan = self.planner.plans[t.step]
        nxt = core.piece_answered(t, plan, task.part, task.version, task.worker, value,
                                  len(self.learners))
        if nxt is core.PieceNext.AGAIN:              # its owner died before the ranks took it
            self.metrics.inc("opd_reissued_jobs")
            self.state.reissued += 1
            part = plan.part_of(task.part)
            if plan.scored and part in plan.generated:
                self._submit_score(plan, task.part)  # its input lost too: remade (_wait)
            else:                                    # its generator delivered it: make the part
                plan.generated.pop(part, None)
                for p in plan.pieces_of[part]:
                    if p >= task.part:
                        plan.delivered.pop(p, None)
                self._submit_generate(plan, part)
            return
        if nxt is core.PieceNext.REPLAN:
            self.state.training = None
            self.metrics.inc("opd_reissued_jobs")
            self._replan(plan)
            return
        if nxt is not core.PieceNext.TRAINED:
            return
        done = core.step_trained(self.state, plan, len(self.learners), time.perf_counter(),
                                 self.cfg)
        self.planner.finish(plan.step, self.state.version)
        row = self._row(plan, done)
        self.steps.record(row)
        self.nodes.stepped(plan.step)
        self._hook("after_step", step=plan.step, row=row)
        if self.elastic is not None:
            self.elastic.after_step(plan.step, row)
        if done.checkpoint:
            self._save_checkpoint()
        if done.publish:
            self.publisher.publish(self.state.version)
        self._evaluate()

    def _row(self, plan: StepPlan, done: core.StepDone) -> dict:
        pools, sync = self.dispatch.pools, self.publisher.last_sync
        row = core.step_metrics(plan, done, PoolCounts(len(pools["rollout"].alive()),
                                                       len(pools["rollout"].up()),
                                                       len(pools["teacher"].alive())),
                                sync_seconds=sync.seconds, sync_bytes=sync.bytes,
                                reissued=self.state.reissued)
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
            nodes=self.nodes.ran_on(), node_events=self.nodes.events)

    def _interrupted(self):
        """Ctrl-C: the step in training finishes, the current step is checkpointed; returns
        the `RunInterrupted` to raise."""
        if self.state.training is not None:
            for ref, task in list(self.dispatch.tasks.items()):
                if task.step == self.state.training.step and task.kind is TaskKind.TRAIN:
                    del self.dispatch.tasks[ref]
                    self._trained(task, ray.get(ref))
        if self.state.training is not None:       # pieces not made yet: the step is dropped
            fan_out(self.learners, "drop_step", self.state.training.step)
            self.state.training = None
        if not self.records.has_checkpoint(self.state.version):
            self._save_checkpoint()
        self._write_consumed()
        return self.steps.interrupted(self.state.version, self.records.last_checkpoint)

    # -- answers and faults -------------------------------------------------------------------------

    def _wait(self) -> None:
        probe = self.dispatch.idle_for()
        if not self.dispatch.tasks and probe is None and self.state.training is None:
            raise RuntimeError(f"the pipeline stalled at step {self.state.version}: "
                               f"nothing in flight")
        for answer in self.dispatch.wait(min(WAIT_S, probe or WAIT_S), self.interrupt):
            task, e = answer.task, answer.error
            if e is None:
                self._on_done(task, answer.ref, answer.value)
            elif isinstance(e, StaleWeightsError):
                self.publisher.load(task.worker)      # reload first (actor calls run in order)
                self._again(task)
            elif answer.lost_input:                   # the part it scored died with its worker
                plan = self.planner.current(task.step, task.gen)
                if plan is not None and (again := core.regenerate(task, plan)) is not None:
                    self._again(again)
            elif isinstance(e, RayActorError):
                self._on_actor_error(task, answer.ref, e)
            else:
                raise e

    def _on_done(self, task: Task, ref, value) -> None:
        now = time.perf_counter()
        if task.kind.makes_part:
            plan = self.planner.current(task.step, task.gen)
            if plan is None:
                return                               # a part of a plan since re-planned
            if task.kind is TaskKind.SCORE:
                core.part_scored(plan, task.part, value, now - task.submitted, now)
            else:
                self._generated(plan, task.part, value, now - task.submitted, task.worker)
        elif task.kind is TaskKind.PROBE:
            self.nodes.placed(task.role, task.worker, value["node_id"], value["node_ip"])
            if task.role == "rollout":
                self.publisher.load(task.worker)     # before it gets any job
            self.pools[task.role].probe_answered(task.worker)
        elif task.kind is TaskKind.LOAD:
            self.pools["rollout"].started(task.worker)
            self.publisher.loaded(ref)
        elif task.kind is TaskKind.PLACE:
            i = self.elastic.placed(ref)
            self.nodes.placed("rollout", i, bundle_node(self.elastic.added[i]))
        elif task.kind is TaskKind.TRAIN:
            self._trained(task, value)

    def _on_actor_error(self, task: Task, ref, error: RayActorError) -> None:
        if task.kind is TaskKind.TRAIN:
            raise self.records.learner_failure("train", task.step, error) from error
        pool = self.pools[task.role]
        if task.kind is TaskKind.PROBE:
            pool.probe_failed(task.worker, died=isinstance(error, ActorDiedError))
            return
        pool.failed(task.worker)
        if task.role == "rollout":
            self.publisher.fall_back_to_object_store()
        if task.kind is TaskKind.LOAD:           # the probe that brings it back reloads it
            self.publisher.loaded(ref)
            return
        self.metrics.inc("opd_reissued_jobs")
        self._again(task)

    def _again(self, task: Task) -> None:
        """Issue a failed part again, or re-plan its step (`core.retry`)."""
        plan = self.planner.current(task.step, task.gen)
        what = core.retry(task, plan, self.publisher.published.version)
        if what is Retry.REPLAN:
            self._replan(plan)
        elif what is Retry.AGAIN:
            self.state.reissued += 1
            if task.kind is TaskKind.SCORE:
                self._submit_score(plan, task.part)
            else:
                self._submit_generate(plan, task.part)

    def _watch_nodes(self) -> None:
        """Workers on a node that was lost are out of the rotation until a probe answers (from
        the node Ray restarted them on; a rollout worker then reloads the weights)."""
        for role, i in self.nodes.poll(self.state.version):
            if role in self.pools:
                self.pools[role].failed(i)
            if role == "rollout":
                self.publisher.fall_back_to_object_store()

    def _hook(self, name: str, **info) -> None:
        fn = self.hooks.get(name)
        if fn is not None:
            fn(self, **info)


def run_distributed(cfg: RunConfig, run_dir: str | Path, *, progress: bool = True,
                    resume: bool = False, stop_after: int | None = None,
                    hooks: dict[str, Callable] | None = None, interrupt=None) -> list[dict]:
    """Run cfg.distill.steps OPD steps on Ray; returns the per-step metric rows (also in
    run_dir/metrics.parquet), like `opd.run.reference.run_reference`.  `resume` continues from the
    run's latest checkpoint; `stop_after` ends after that many steps; `hooks` maps event names
    ("after_submit", "after_part" (a part generated), "after_seal" (a step's parts all in the
    queue), "after_step") to callables(pipeline, **info) (tests inject faults there),
    and "rollout_wait" to a callable(pipeline, step=, row=) -> float that an elastic pool's
    policy uses instead of the measured row["rollout_wait"] (tests: actors/driver/elastic.py);
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
        pipeline = Pipeline(cfg, run_dir, groups, resume=resume, stop_after=stop_after,
                            progress=progress, hooks=hooks, interrupt=interrupt)
        return pipeline.run()
    finally:
        if pipeline is not None and pipeline.elastic is not None:
            pipeline.elastic.close()
        groups.shutdown()
        if started_ray:
            ray.shutdown()
