"""The driver: `run_distributed(cfg, run_dir)` runs OPD on Ray and returns the per-step metric
rows, like `opd.reference.run_reference` (same rows, same losses in strict mode: invariant 5;
the invariants, roles and one step's data flow are in docs/ARCHITECTURE.md).

Per step k, the reference's order of work:

    pb     = next prefix batch                      (the driver owns the data cursor)
    source = objective.choose_source(k, seed)       (the step's phase's objective:
                                                     opd/phases.py)
    jobs   = RolloutJob(pb, ...) cut into row ranges (rows keep their image ids)
    part   = RolloutWorker.generate(job, k)         (student version k; "teacher": TeacherWorker;
                                                     "data": the dataset suffix, no model)
    TeacherWorker.score(part) -> queue.put_part     (each part as soon as it is generated; the
                                                     worker cuts it into one piece per learner
                                                     rank: actors/delivery.py)
    queue.seal(k, batch id, version)                (every part reported; bounded; strict: only
                                                     version k leaves it)
    StudentLearner.train_step(k, version)           (rank r takes its refs from the queue and
                                                     fetches only its rows)
    publish weights k + 1                           (one object-store object, or a broadcast;
                                                     its size counted by the learner)

The driver only orchestrates: it receives reports (rows, tokens, rollout stats, bytes) and
metrics, never a trajectory or a weight payload.  Its parts: actors/planner.py (plans, data
cursor), actors/dispatch.py (tasks, workers, faults), actors/publisher.py (weights),
actors/records.py (checkpoints, consumed ids, rows); opd/loop.py (progress, checkpoint cadence,
Ctrl-C) is shared with the reference loop.

Parts of a step are generated and scored side by side on different workers.  Steps whose
sequences do not come from the student are prepared ahead (up to `distill.queue_capacity`
batches); with `distill.staleness` k > 0 student rollouts run up to k versions ahead.

Quality (eval.track): at step 0, every `eval.every` steps and at the last step the weights of
that version go to the evaluation worker (actors/evaluation.py) with the same object-store
payload the rollout workers load; the loop does not wait for it, and the run collects every
evaluation before it ends (quality.parquet).

Elastic rollout workers (`rollout.num_workers = "min..max"`): actors/elastic.py adds workers
while the learner waits on rollouts and retires idle ones.  Ctrl-C (`interrupt`, see
actors/interrupt.py): the step in training finishes, its checkpoint is written, and the run
raises `RunInterrupted` naming it.

Faults: rollout and teacher workers restart (`cluster.max_restarts`); the driver probes a
failed worker until it answers, a rollout worker reloads the current weights before it
generates again, and work in flight on a dead worker is issued again (the driver keeps every
job).  Parts lost with the worker that owned them are made again: a scoring whose input part
died, or a step whose pieces a learner rank could not fetch (the step is re-planned).  A part of a plan older than the published weights is not generated again at its old
version (no worker holds it): the whole plan is re-planned at the published version and late
answers for the old plan are dropped.  A learner failure stops the run and names the last
checkpoint.  Every prefix batch id is consumed exactly once: counted, written to
`consumed.json` in the run directory, and checked.
"""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Callable

import ray
from ray.exceptions import ActorDiedError, RayActorError

from actors.cluster import ActorGroups, check_distributed, connect
from actors.delivery import PartTag, deliver, part_cuts, put_payload
from actors.dispatch import Dispatcher, WorkerPoolExhausted  # noqa: F401 (re-exported)
from actors.elastic import ElasticRollout
from actors.evaluation import QualityTracking
from actors.interrupt import NoInterrupt
from actors.metrics import RoleMetrics
from actors.planner import StepPlanner
from actors.publisher import WeightPublisher
from actors.queue import QueueItem
from actors.records import CHECKPOINTS, CONSUMED_FILE, LearnerFailure, RunRecords  # noqa: F401
from actors.rollout_worker import StaleWeightsError
from actors.shards import shard_rows
from actors.tasks import StepPlan, Task, TaskKind, Training
from opd.checkpoints import latest_checkpoint
from opd.config import RunConfig
from opd.data import PrefixBatcher
from opd.loop import StepLog
from opd.pretrain import open_dataset
from opd.reference import check_objectives
from opd.steps import rollout

WAIT_S = 30.0


class Pipeline(RunRecords):
    """One distributed run: the step loop and what it does with each answer.  Its parts:
    `planner` (actors/planner.py), `dispatch` (actors/dispatch.py), `publisher`
    (actors/publisher.py); checkpoints, consumed ids and rows in actors/records.py."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, *, progress: bool = True,
                 hooks: dict[str, Callable] | None = None, interrupt=None):
        check_distributed(cfg)
        self.cfg, self.run_dir, self.progress = cfg, Path(run_dir), progress
        self.hooks = hooks or {}
        self.interrupt = interrupt or NoInterrupt()
        self.elastic: ElasticRollout | None = None
        check_objectives(cfg)
        self.started_ray = False
        self.groups = ActorGroups()
        self.quality: QualityTracking | None = None

    # -- actors and parts as the hooks and the elastic pool see them ------------------------------

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

    def track(self, ref: ray.ObjectRef, kind: str) -> None:
        """Wait on `ref` in the event loop (an elastic worker's placement group: "place")."""
        self.dispatch.track(ref, Task(TaskKind(kind)))

    def load_into(self, i: int) -> ray.ObjectRef:
        """Send rollout worker i the published weights (before any job it gets)."""
        return self.publisher.load(i)

    # -- the run ----------------------------------------------------------------------------------

    def run(self, *, resume: bool = False, stop_after: int | None = None) -> list[dict]:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.started_ray = connect(cfg)
        self.groups = ActorGroups.start(cfg, self.run_dir, progress=self.progress)
        self.dispatch = Dispatcher(cfg, self.groups, self._hook)
        self.metrics = RoleMetrics("driver", 0)
        self.idle = {r: RoleMetrics(r, "all") for r in ("rollout", "teacher", "learner")}
        self.publisher = WeightPublisher(cfg, self.groups, self.dispatch, self.metrics,
                                         self._learner_failure)
        if self.publisher.collective and self.groups.rollout:
            self.groups.join_broadcast(cfg)
        self.elastic = ElasticRollout.for_run(self)
        train = open_dataset(cfg, "train")
        batcher = PrefixBatcher(train, cfg.data.batch_size, cfg.run.seed)
        self.consumed: Counter[int] = Counter()
        self.last_checkpoint: str | None = None
        start = 0
        if resume and (ckpt := latest_checkpoint(self.run_dir)) is not None:
            start = self._load_checkpoint(ckpt, batcher)
        self.steps = StepLog(cfg, self.run_dir, start=start, stop_after=stop_after,
                             resume=resume, desc="opd ray", progress=self.progress)
        self.planner = StepPlanner(cfg, batcher, train.seq_len, start)
        self.shards = shard_rows(cfg.data.batch_size, cfg.learner.world_size)
        self.version = start               # learner steps done = the current policy version
        self.training: Training | None = None
        self.reissued = 0
        self.last_step_end = time.perf_counter()
        self.publisher.publish(self.version)
        if self.groups.evaluator is not None:
            self.quality = QualityTracking(cfg, self.run_dir, self.groups.evaluator,
                                           resume=resume, start=start)
            self._evaluate()
        with self.steps:                       # a failure ends the progress bar's line
            try:
                with self.interrupt.armed():
                    while self.version < self.steps.end:
                        if self.interrupt.pending():
                            raise KeyboardInterrupt
                        self._issue()
                        self._dispatch()
                        self._seal()
                        self._train()
                        self._wait()
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

    def shutdown(self) -> None:
        if self.elastic is not None:
            self.elastic.close()
        self.groups.shutdown()
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False

    # -- issuing work -------------------------------------------------------------------------------

    def _issue(self) -> None:
        """Plan the next steps that the queue bound and the staleness bound allow."""
        pool = self.pools["rollout"]               # workers still starting take no part yet
        parts = self.cfg.rollout.sub_batches or max(len(pool.alive()) - len(pool.starting()),
                                                    len(self.teacher))
        while (plan := self.planner.plan(self.version, self.publisher.published.version,
                                         self.steps.end, parts)) is not None:
            self._submit_parts(plan)

    def _submit_parts(self, plan: StepPlan) -> None:
        for part in range(plan.parts):
            self._submit_generate(plan, part)

    def _tag(self, plan: StepPlan, part: int) -> PartTag:
        a = sum(int(j.labels.shape[0]) for j in plan.jobs[:part])
        b = a + int(plan.jobs[part].labels.shape[0])
        return PartTag(plan.step, plan.gen, part, part_cuts((a, b), self.shards))

    def _submit_generate(self, plan: StepPlan, part: int) -> None:
        """Generate a part: delivered straight into the queue, or whole for a teacher to score."""
        tag = None if plan.scored else self._tag(plan, part)
        job, queue, version = plan.jobs[part], self.groups.queue, plan.version
        if plan.source == "data":               # no model: the suffix comes from the data
            traj = rollout(None, None, job, self.cfg, policy_version=plan.version)
            made = put_payload(traj, 0.0) if tag is None else deliver(traj, tag, queue, 0.0)
            self._generated(plan, part, made)
            return
        kind = TaskKind.ROLLOUT if plan.source == "student" else TaskKind.TEACHER_ROLLOUT
        self.dispatch.submit(kind, plan, part,
                             lambda actor: actor.generate.remote(job, version, tag, queue))

    def _submit_score(self, plan: StepPlan, part: int) -> None:
        plan.score_started = plan.score_started or time.perf_counter()
        payload, tag, queue = plan.generated[part].payload, self._tag(plan, part), self.groups.queue
        self.dispatch.submit(TaskKind.SCORE, plan, part,
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
        if part in plan.generated:
            return                                   # first answer wins
        plan.generated[part] = report
        self._hook("after_part", step=plan.step, part=part, worker=worker)
        plan.rollout_busy += busy
        if len(plan.generated) == plan.parts:
            plan.rollout_done = time.perf_counter()
        if plan.scored:
            self._submit_score(plan, part)
        else:
            plan.delivered[part] = report
            plan.score_done = plan.rollout_done

    def _seal(self) -> None:
        """Steps whose parts are all delivered become queue items, in step order, while the
        queue has room (backpressure: try again later)."""
        for s in sorted(self.planner.plans):
            plan = self.planner.plans[s]
            if plan.complete and not plan.sealed:
                item = QueueItem(s, plan.batch_id, plan.version, samples=plan.samples,
                                 generated_tokens=sum(r.generated_tokens
                                                      for r in plan.delivered.values()))
                if not ray.get(self.groups.queue.seal.remote(item, plan.gen, plan.parts)):
                    return
                plan.sealed = True
                self._hook("after_seal", step=s)

    def _replan(self, plan: StepPlan) -> None:
        """Generate every part of `plan` again (a new generation): student rollouts at the
        published version, other sources at their step's own."""
        self.dispatch.forget_step(plan.step)
        self.planner.replan(plan, self.publisher.published.version if plan.source == "student"
                            else plan.version)
        self.reissued += plan.parts
        self._submit_parts(plan)

    # -- learning -----------------------------------------------------------------------------------

    def _train(self) -> None:
        if self.training is not None or self.version >= self.steps.end:
            return
        plan = self.planner.plans.get(self.version)
        if plan is None or not plan.sealed:
            return
        if self.consumed[plan.batch_id]:
            raise RuntimeError(f"batch {plan.batch_id} would be consumed twice (step {plan.step})")
        self.training = Training(plan.step)
        for r, a in enumerate(self.learners):
            self.dispatch.track(a.train_step.remote(plan.step, self.version),
                                Task(TaskKind.TRAIN, "learner", plan.step, worker=r))

    def _trained(self, task: Task, value: dict) -> None:
        t = self.training
        t.results[task.worker] = value
        if len(t.results) < len(self.learners):
            return
        self.training = None
        results = [t.results[r] for r in range(len(self.learners))]
        plan = self.planner.plans[t.step]
        if any(r.get("lost") for r in results):      # a worker that owned its rows died
            self.metrics.inc("opd_reissued_jobs")
            self._replan(plan)
            return
        self.consumed[plan.batch_id] += 1
        now = time.perf_counter()
        free, self.last_step_end = self.last_step_end, now
        self.version += 1
        self.planner.finish(plan.step, self.version)
        row = self._row(plan, results, t.start, now, now - free)
        self.steps.record(row)
        self._hook("after_step", step=plan.step, row=row)
        if self.elastic is not None:
            self.elastic.after_step(plan.step, row)
        if self.steps.checkpoint_due(self.version):
            self._save_checkpoint()
        if self.version < self.steps.end and self.version % self.cfg.distill.broadcast_every == 0:
            self.publisher.publish(self.version)
        self._evaluate()

    def _evaluate(self) -> None:
        """Hand the current version to the evaluation worker when it is an evaluation step:
        the published weights object when it holds this version, else one taken from the
        learners now (before they get the next step; every rank, ZeRO-3 gathers)."""
        if self.quality is None or not self.quality.due(self.version):
            return
        p = self.publisher.published
        if p.version == self.version and p.ref is not None:
            ref = p.ref
        else:
            ref = [a.get_weights.remote(self.version) for a in self.learners][0]
        self.quality.submit(self.version, self.version, ref)

    # -- answers and faults -------------------------------------------------------------------------

    def _wait(self) -> None:
        probe = self.dispatch.idle_for()
        if not self.dispatch.tasks and probe is None and self.training is None:
            raise RuntimeError(f"the pipeline stalled at step {self.version}: nothing in flight")
        for answer in self.dispatch.wait(min(WAIT_S, probe or WAIT_S), self.interrupt):
            task, e = answer.task, answer.error
            if e is None:
                self._on_done(task, answer.ref, answer.value)
            elif isinstance(e, StaleWeightsError):
                self.publisher.load(task.worker)      # reload first (actor calls run in order)
                self._again(task)
            elif answer.lost_input:                   # the part it scored died with its worker
                plan = self.planner.current(task.step, task.gen)
                if plan is not None:
                    plan.generated.pop(task.part, None)
                    self._again(Task(TaskKind.ROLLOUT if plan.source == "student" else
                                     TaskKind.TEACHER_ROLLOUT, step=task.step, part=task.part,
                                     version=task.version, gen=task.gen))
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
                if task.part not in plan.delivered:
                    plan.delivered[task.part] = value
                    plan.teacher_busy += now - task.submitted
                    if plan.complete:
                        plan.score_done = now
            else:
                self._generated(plan, task.part, value, now - task.submitted, task.worker)
        elif task.kind is TaskKind.PROBE:
            if task.role == "rollout":
                self.publisher.load(task.worker)     # before it gets any job
            self.pools[task.role].probe_answered(task.worker)
        elif task.kind is TaskKind.LOAD:
            self.pools["rollout"].started(task.worker)
            self.publisher.loaded(ref)
        elif task.kind is TaskKind.PLACE:
            self.elastic.placed(ref)
        elif task.kind is TaskKind.TRAIN:
            self._trained(task, value)

    def _on_actor_error(self, task: Task, ref, error: RayActorError) -> None:
        if task.kind is TaskKind.TRAIN:
            raise self._learner_failure("train", task.step, error) from error
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
        """Issue a failed part again (same job, so the same tokens).  A student rollout whose
        plan is older than the published weights cannot be generated again (workers hold only
        the published version, and would answer StaleWeightsError for ever): the whole plan is
        re-planned at the published version, as for a batch that expired in the queue."""
        plan = self.planner.current(task.step, task.gen)
        if plan is None:
            return                               # gone, or re-planned since it was submitted
        if (task.kind is TaskKind.ROLLOUT and plan.source == "student"
                and plan.version != self.publisher.published.version):
            self._replan(plan)
            return
        self.reissued += 1
        if task.kind is TaskKind.SCORE:
            self._submit_score(plan, task.part)
        else:
            self._submit_generate(plan, task.part)

    def _hook(self, name: str, **info) -> None:
        fn = self.hooks.get(name)
        if fn is not None:
            fn(self, **info)


def run_distributed(cfg: RunConfig, run_dir: str | Path, *, progress: bool = True,
                    resume: bool = False, stop_after: int | None = None,
                    hooks: dict[str, Callable] | None = None, interrupt=None) -> list[dict]:
    """Run cfg.distill.steps OPD steps on Ray; returns the per-step metric rows (also in
    run_dir/metrics.parquet), like `opd.reference.run_reference`.  `resume` continues from the
    run's latest checkpoint; `stop_after` ends after that many steps; `hooks` maps event names
    ("after_submit", "after_part" (a part generated), "after_seal" (a step's parts all in the
    queue), "after_step") to callables(pipeline, **info) (tests inject faults there),
    and "rollout_wait" to a callable(pipeline, step=, row=) -> float that an elastic pool's
    policy uses instead of the measured row["rollout_wait"] (tests: actors/elastic.py);
    `interrupt` (actors.interrupt.GracefulInterrupt) defers Ctrl-C to a checkpoint: the run then
    raises opd.reference.RunInterrupted (also on a plain KeyboardInterrupt)."""
    pipeline = Pipeline(cfg, run_dir, progress=progress, hooks=hooks, interrupt=interrupt)
    try:
        return pipeline.run(resume=resume, stop_after=stop_after)
    finally:
        pipeline.shutdown()
