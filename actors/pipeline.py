"""The driver: `run_distributed(cfg, run_dir)` runs OPD on Ray and returns the per-step metric
rows, like `opd.reference.run_reference` (same rows, same losses in strict mode: invariant 5;
the invariants, roles and one step's data flow are in docs/ARCHITECTURE.md).

Per step k, the reference's order of work:

    pb     = next prefix batch                      (the driver owns the data cursor)
    source = objective.choose_source(k, seed)
    jobs   = RolloutJob(pb, ...) cut into row ranges (rows keep their image ids)
    trajs  = RolloutWorker.generate(job, k)         (student version k; "teacher": TeacherWorker;
                                                     "data": the dataset suffix, no model)
    scored = TeacherWorker.score(traj)              (each part as soon as it is generated)
    queue  ← (k, batch id, version, scored refs)    (bounded; strict: only version k leaves it)
    learn  = StudentLearner.train_step(*scored)     (every rank; merges parts, takes its shard)
    publish weights k + 1                           (one object-store object, or a broadcast;
                                                     its size counted by the learner)

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
job).  A part of a plan older than the published weights is not generated again at its old
version (no worker holds it): the whole plan is re-planned at the published version and late
answers for the old plan are dropped.  A learner failure stops the run and names the last
checkpoint.  Every prefix batch id is consumed exactly once: counted, written to
`consumed.json` in the run directory, and checked.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import ray
from ray.exceptions import ActorDiedError, RayActorError
from tqdm import tqdm

from actors.cluster import ActorGroups, check_distributed, connect
from actors.elastic import ElasticRollout, rollout_wait_fraction
from actors.evaluation import QualityTracking
from actors.interrupt import NoInterrupt
from actors.learner import combine_rank_metrics
from actors.metrics import RoleMetrics
from actors.pool import WorkerPool
from actors.queue import QueueItem
from actors.records import CHECKPOINTS, CONSUMED_FILE, LearnerFailure, RunRecords  # noqa: F401
from actors.rollout_worker import StaleWeightsError
from actors.shards import split_job
from actors.weights import PublishedWeights
from opd.batch import TrajectoryBatch
from opd.checkpoints import latest_checkpoint
from opd.config import RunConfig
from opd.data import PrefixBatcher
from opd.metrics import MetricsLog
from opd.pretrain import open_dataset
from opd.reference import check_objective, step_row
from opd.steps import (RolloutJob, batch_prefix_len, batch_source, build_objective,
                       needs_teacher_scores, rollout)

WAIT_S = 30.0
BROADCAST_GRACE_S = 60.0


class WorkerPoolExhausted(RuntimeError):
    """Every worker of a pool died for good (its restarts used up)."""


@dataclass
class Task:
    kind: str        # rollout | teacher-rollout | score | load | probe | train | place
    role: str = ""   # the pool of the worker (rollout | teacher | learner)
    step: int = -1
    part: int = -1
    worker: int = -1
    version: int = -1   # the plan's policy version when it was submitted (rollout, score)
    submitted: float = field(default_factory=time.perf_counter)


@dataclass
class StepPlan:
    """One step's prefix batch, cut into parts, and where each part is."""
    step: int
    batch_id: int
    source: str
    version: int                       # policy version of its trajectories
    jobs: list[RolloutJob]
    trajs: dict[int, ray.ObjectRef] = field(default_factory=dict)
    scored: dict[int, ray.ObjectRef] = field(default_factory=dict)
    issued: float = field(default_factory=time.perf_counter)
    rollout_done: float = 0.0
    score_started: float = 0.0
    score_done: float = 0.0
    rollout_busy: float = 0.0
    teacher_busy: float = 0.0
    queued: bool = False

    @property
    def samples(self) -> int:
        return sum(int(j.labels.shape[0]) for j in self.jobs)


class Pipeline(RunRecords):
    """The event loop of one distributed run (actors in `self.groups`); checkpoints, the
    consumed-ids record and Ctrl-C in actors/records.py."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, *, progress: bool = True,
                 hooks: dict[str, Callable] | None = None, interrupt=None):
        check_distributed(cfg)
        self.cfg, self.run_dir, self.progress = cfg, Path(run_dir), progress
        self.hooks = hooks or {}
        self.interrupt = interrupt or NoInterrupt()
        self.elastic: ElasticRollout | None = None
        self.objective = build_objective(cfg)
        check_objective(cfg, self.objective)
        self.scores = needs_teacher_scores(self.objective)
        self.collective = cfg.learner.weight_sync == "collective"
        self.started_ray = False
        self.groups = ActorGroups()
        self.quality: QualityTracking | None = None

    # -- actors as the hooks see them ----------------------------------------------------------

    @property
    def rollout(self) -> list:
        return self.groups.rollout

    @property
    def teacher(self) -> list:
        return self.groups.teacher

    @property
    def learners(self) -> list:
        return self.groups.learners

    # -- the run ----------------------------------------------------------------------------------

    def run(self, *, resume: bool = False, stop_after: int | None = None) -> list[dict]:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.started_ray = connect(cfg)
        self.groups = ActorGroups.start(cfg, self.run_dir, progress=self.progress)
        if self.collective:
            self.groups.join_broadcast(cfg)
        self.pools = {"rollout": WorkerPool("rollout", self.rollout),
                      "teacher": WorkerPool("teacher", self.teacher)}
        self.elastic = ElasticRollout.for_run(self)
        train = open_dataset(cfg, "train")
        self.batcher = PrefixBatcher(train, cfg.data.batch_size, cfg.run.seed)
        self.seq_len = train.seq_len
        self.log = MetricsLog(self.run_dir, flush_every=cfg.run.log_every, resume=resume)
        self.consumed: Counter[int] = Counter()
        self.last_checkpoint: str | None = None
        start = 0
        if resume:
            ckpt = latest_checkpoint(self.run_dir)
            if ckpt is not None:
                start = self._load_checkpoint(ckpt)
            self.log.truncate(start)
        self.version = start               # learner steps done = the current policy version
        self.next_issue = start
        self.end = cfg.distill.steps if stop_after is None else min(cfg.distill.steps, start + stop_after)
        self.cursor = {start: self.batcher.state_dict()}   # data cursor before step s's batch
        self.plans: dict[int, StepPlan] = {}
        self.tasks: dict[ray.ObjectRef, Task] = {}
        self.backlog: list[tuple[str, int, int]] = []       # (kind, step, part) waiting for a worker
        self.training: dict | None = None
        self.sync: dict | None = None
        self.last_sync: dict = {}
        self.reissued = 0
        self.metrics = RoleMetrics("driver", 0)
        self.idle = {r: RoleMetrics(r, "all") for r in ("rollout", "teacher", "learner")}
        self.last_step_end = time.perf_counter()
        self.bar = tqdm(total=cfg.distill.steps, initial=start, desc="opd ray",
                        disable=not self.progress, dynamic_ncols=True)
        self._publish(self.version)
        if self.groups.evaluator is not None:
            self.quality = QualityTracking(cfg, self.run_dir, self.groups.evaluator,
                                           resume=resume, start=start)
            self._evaluate()
        try:
            with self.interrupt.armed():
                while self.version < self.end:
                    if self.interrupt.pending():
                        raise KeyboardInterrupt
                    self._issue()
                    self._dispatch()
                    self._enqueue()
                    self._train()
                    self._wait()
                    if self.quality is not None:
                        self.quality.poll()
        except KeyboardInterrupt:
            interrupted = self._interrupted()
            if self.quality is not None:
                self.quality.finish(wait=False)
            raise interrupted from None
        self.bar.close()
        every = cfg.run.checkpoint_every
        if self.version == cfg.distill.steps and not (every and self.version % every == 0):
            self._save_checkpoint()
        if self.quality is not None:
            self.quality.finish()              # the evaluations still running
        self.log.flush()
        self._write_consumed()
        return self.log.rows

    def shutdown(self) -> None:
        if self.elastic is not None:
            self.elastic.close()
        self.groups.shutdown()
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False

    # -- weights ------------------------------------------------------------------------------------

    def _publish(self, version: int) -> None:
        """Make `version` the weights rollout workers generate with: one object-store object
        (loads are submitted before any later job, and actor calls run in order), or a
        collective broadcast."""
        start = time.perf_counter()
        self.sync = {"version": version, "start": start, "pending": set(), "bytes": 0}
        if self.collective and self._broadcast(version):
            self.published = PublishedWeights(version, None, self.sync["bytes"])
            self._sync_done()
            return
        ref, nbytes = self._weights_from_learners(version)
        self.sync["bytes"] = nbytes
        self.published = PublishedWeights(version, ref, nbytes, time.perf_counter() - start)
        for i in self.pools["rollout"].loadable():
            self.sync["pending"].add(self._load(i))
        if not self.sync["pending"]:
            self._sync_done()

    def _weights_from_learners(self, version: int) -> tuple[ray.ObjectRef, int]:
        """The ref of `version`'s weights payload (made by learner rank 0; every rank takes part,
        ZeRO-3 gathers) and its size in bytes, counted by the learner: the driver waits for the
        size only and never fetches the weights."""
        calls = [a.publish_weights.remote(version) for a in self.learners]   # [payload, nbytes]
        try:
            nbytes = ray.get([size for _, size in calls])[0]
        except RayActorError as e:
            raise self._learner_failure("weights", version, e) from e
        return calls[0][0], int(nbytes)

    def _broadcast(self, version: int) -> bool:
        """Send `version` through the broadcast group; False if a member had died (the group
        is then given up: receivers that did not finish are restarted, the weights go through
        the object store from now on)."""
        up = self.pools["rollout"].up()
        sends = [a.send_weights.remote(version) for a in self.learners]
        receives = {i: self.rollout[i].receive_weights.remote(version) for i in up}
        try:
            self.sync["bytes"] = ray.get(sends)[0]
            ok = True
        except RayActorError as e:
            raise self._learner_failure("weight broadcast", version, e) from e
        except ray.exceptions.RayTaskError:
            ok = False                           # a receiver died: the send failed
        done, _ = ray.wait(list(receives.values()), num_returns=len(receives),
                           timeout=BROADCAST_GRACE_S if ok else 2.0)
        for i, ref in receives.items():
            try:
                if ref not in done:
                    raise TimeoutError
                ray.get(ref)
            except (ray.exceptions.RayError, TimeoutError):
                ok = False
                if ref not in done:              # stuck in the broken group: restart it
                    ray.kill(self.rollout[i], no_restart=False)
                self.pools["rollout"].failed(i)
        if not ok:
            self.collective = False
            ray.get(self.learners[0].leave_broadcast.remote())
        return ok

    def track(self, ref: ray.ObjectRef, kind: str) -> None:
        """Wait on `ref` in the event loop (an elastic worker's placement group: "place")."""
        self.tasks[ref] = Task(kind)

    def load_into(self, i: int) -> ray.ObjectRef:
        """Send rollout worker i the published weights (before any job it gets)."""
        return self._load(i)

    def _load(self, i: int) -> ray.ObjectRef:
        ref = self.rollout[i].load_weights.remote(self.published.version, self.published.ref)
        self.tasks[ref] = Task("load", "rollout", step=self.published.version, worker=i)
        self.pools["rollout"].busy[i] += 1
        return ref

    def _sync_done(self) -> None:
        s, self.sync = self.sync, None
        s["seconds"] = time.perf_counter() - s["start"]
        self.last_sync = s
        self.metrics.report(weight_sync_seconds=s["seconds"], weight_sync_bytes=s["bytes"],
                            policy_version=s["version"])

    def _fall_back_to_object_store(self) -> None:
        """A broadcast group cannot re-admit a restarted member: object-store weights from now on."""
        self.collective = False
        self.learners[0].leave_broadcast.remote()
        ref, nbytes = self._weights_from_learners(self.published.version)
        self.published = PublishedWeights(self.published.version, ref, nbytes)

    # -- issuing work -------------------------------------------------------------------------------

    def _issue(self) -> None:
        """Plan the next steps that the queue bound and the staleness bound allow."""
        cfg = self.cfg
        while self.next_issue < self.end and self.next_issue - self.version < cfg.distill.queue_capacity:
            s = self.next_issue
            source = batch_source(self.objective, s, cfg.run.seed)
            version = s
            if source == "student":
                version = self.published.version
                if s - version > cfg.distill.staleness:
                    return
            pb = next(self.batcher)
            self.cursor[s + 1] = self.batcher.state_dict()
            job = RolloutJob(pb.batch_id, pb.labels, pb.tokens,
                             batch_prefix_len(cfg, pb.batch_id, self.seq_len), source, cfg.run.seed)
            pool = self.pools["rollout"]             # workers still starting take no part yet
            parts = cfg.rollout.sub_batches or max(len(pool.alive()) - len(pool.starting()),
                                                   len(self.teacher))
            plan = self.plans[s] = StepPlan(s, pb.batch_id, source, version, split_job(job, parts))
            self.next_issue += 1
            for part in range(len(plan.jobs)):
                self._submit_rollout(plan, part)

    def _submit(self, kind: str, plan: StepPlan, part: int) -> None:
        """Submit a rollout or scoring part to the least busy worker that is up (else wait)."""
        role = "rollout" if kind == "rollout" else "teacher"
        pool = self.pools[role]
        if pool.exhausted:
            raise WorkerPoolExhausted(f"every {role} worker died (cluster.max_restarts="
                                      f"{self.cfg.cluster.max_restarts} restarts each were used up)")
        i = pool.pick()
        if i is None:
            self.backlog.append((kind, plan.step, part))
            return
        if kind == "score":
            ref = self.teacher[i].score.remote(plan.trajs[part])
            plan.score_started = plan.score_started or time.perf_counter()
        else:
            actor = self.rollout[i] if kind == "rollout" else self.teacher[i]
            ref = actor.generate.remote(plan.jobs[part], plan.version)
        self.tasks[ref] = Task(kind, role, plan.step, part, i, plan.version)
        pool.busy[i] += 1
        self._hook("after_submit", kind=kind, step=plan.step, part=part, worker=i)

    def _submit_rollout(self, plan: StepPlan, part: int) -> None:
        if plan.source == "data":               # no model: the suffix comes from the data
            traj = rollout(None, None, plan.jobs[part], self.cfg, policy_version=plan.version)
            self._rollout_finished(plan, part, ray.put(traj.to_numpy_dict()), 0.0)
        else:
            self._submit("rollout" if plan.source == "student" else "teacher-rollout", plan, part)

    def _dispatch(self) -> None:
        """Probe failed workers that are due, and hand waiting parts to workers that are up."""
        for role, pool in self.pools.items():
            for i in pool.due():
                self.tasks[pool.actors[i].info.remote()] = Task("probe", role, worker=i)
        waiting, self.backlog = self.backlog, []
        for kind, step, part in waiting:
            if step in self.plans:
                self._submit(kind, self.plans[step], part)
        if self.elastic is not None:
            self.elastic.tick()

    def _rollout_finished(self, plan: StepPlan, part: int, ref, busy: float) -> None:
        plan.trajs[part] = ref
        plan.rollout_busy += busy
        if len(plan.trajs) == len(plan.jobs):
            plan.rollout_done = time.perf_counter()
        if self.scores:
            self._submit("score", plan, part)
        else:
            plan.scored[part] = ref
            plan.score_done = plan.rollout_done

    def _enqueue(self) -> None:
        for s in sorted(self.plans):
            plan = self.plans[s]
            if len(plan.scored) == len(plan.jobs) and not plan.queued:
                refs = [plan.scored[p] for p in range(len(plan.jobs))]
                if not ray.get(self.groups.queue.put.remote(
                        QueueItem(s, plan.batch_id, plan.version, refs, plan.samples))):
                    return                          # full: backpressure, try again later
                plan.queued = True

    # -- learning -----------------------------------------------------------------------------------

    def _train(self) -> None:
        if self.training is not None or self.version >= self.end:
            return
        plan = self.plans.get(self.version)
        if plan is None or not plan.queued:
            return
        item = ray.get(self.groups.queue.get.remote(self.version, self.version))
        for old in ray.get(self.groups.queue.take_expired.remote()):
            self._reissue(self.plans[old.step])
        if item is None:
            return
        if self.consumed[item.batch_id]:
            raise RuntimeError(f"batch {item.batch_id} would be consumed twice (step {item.step})")
        refs = [a.train_step.remote(*item.refs) for a in self.learners]
        self.training = {"item": item, "results": {}, "start": time.perf_counter()}
        for r, ref in enumerate(refs):
            self.tasks[ref] = Task("train", "learner", item.step, worker=r)

    def _reissue(self, plan: StepPlan) -> None:
        """A batch that became too old in the queue: generate it again at the current version."""
        plan.trajs.clear()
        plan.scored.clear()
        self.backlog = [w for w in self.backlog if w[1] != plan.step]   # all parts go again
        plan.queued, plan.version = False, self.published.version
        self.reissued += len(plan.jobs)
        for part in range(len(plan.jobs)):
            self._submit_rollout(plan, part)

    def _train_finished(self) -> None:
        t, self.training = self.training, None
        item: QueueItem = t["item"]
        results = [t["results"][r] for r in range(len(self.learners))]
        self.consumed[item.batch_id] += 1
        plan = self.plans.pop(item.step)
        now = time.perf_counter()
        free, self.last_step_end = self.last_step_end, now
        self.version += 1
        self.cursor = {s: c for s, c in self.cursor.items() if s >= self.version}
        row = self._row(item, plan, results, now - t["start"], now - free)
        row["rollout_wait"] = rollout_wait_fraction(plan.source, plan.issued, plan.rollout_done,
                                                    free, t["start"], now - free)
        self.log.append(row)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['rollout_tokens_per_s']:.0f}",
                             commit=f"{row['mean_committed']:.2f}")
        self._hook("after_step", step=item.step, row=row)
        if self.elastic is not None:
            self.elastic.after_step(item.step, row)
        every = self.cfg.run.checkpoint_every
        if every and self.version % every == 0:
            self._save_checkpoint()
        if self.version < self.end and self.version % self.cfg.distill.broadcast_every == 0:
            self._publish(self.version)
        self._evaluate()

    def _evaluate(self) -> None:
        """Hand the current version to the evaluation worker when it is an evaluation step:
        the published weights object when it holds this version, else one taken from the
        learners now (before they get the next step; every rank, ZeRO-3 gathers)."""
        if self.quality is None or not self.quality.due(self.version):
            return
        p = self.published
        if p.version == self.version and p.ref is not None:
            ref = p.ref
        else:
            ref = [a.get_weights.remote(self.version) for a in self.learners][0]
        self.quality.submit(self.version, self.version, ref)

    def _row(self, item: QueueItem, plan: StepPlan, results: list[dict], learner_s: float,
             wall: float) -> dict:
        """The metrics.parquet row: the reference's columns plus the pipeline's own."""
        traj = TrajectoryBatch.from_numpy_dict(results[0]["batch"])
        seconds = {"rollout": max(0.0, plan.rollout_done - plan.issued),
                   "teacher": max(0.0, plan.score_done - plan.score_started) if self.scores else 0.0,
                   "learner": learner_s}
        row = step_row(item.step, traj, combine_rank_metrics(results), seconds)
        depth = ray.get(self.groups.queue.stats.remote())["depth"]
        R, M = len(self.pools["rollout"].alive()), len(self.pools["teacher"].alive())
        row.update({
            "step_s": wall, "weight_sync_s": self.last_sync.get("seconds", 0.0),
            "weight_bytes": self.last_sync.get("bytes", 0), "queue_depth": depth,
            "policy_lag": item.step - item.version, "samples_per_s": item.samples / wall,
            "teacher_tokens_per_s": (traj.batch_size * traj.seq_len / seconds["teacher"]
                                     if seconds["teacher"] > 0 else 0.0),
            "rollout_idle": max(0.0, 1 - plan.rollout_busy / (R * wall)) if R else 1.0,
            "teacher_idle": max(0.0, 1 - plan.teacher_busy / (M * wall)) if M else 1.0,
            "learner_idle": max(0.0, 1 - learner_s / wall), "reissued": self.reissued,
            "rollout_workers": len(self.pools["rollout"].up())})
        self.metrics.report(step_seconds=wall, queue_depth=depth, policy_lag=row["policy_lag"])
        for role in ("rollout", "teacher", "learner"):
            self.idle[role].set("opd_idle_ratio", row[f"{role}_idle"])
        return row

    # -- waiting and faults -------------------------------------------------------------------------

    def _wait(self) -> None:
        probes = [t for t in (p.next_probe_in() for p in self.pools.values()) if t is not None]
        timeout = min([WAIT_S, *probes])
        if not self.tasks:
            if not probes and self.training is None:
                raise RuntimeError(f"the pipeline stalled at step {self.version}: nothing in flight")
            with self.interrupt.safe():
                time.sleep(timeout)
            return
        with self.interrupt.safe():
            done, _ = ray.wait(list(self.tasks), num_returns=1, timeout=timeout)
        for ref in done:
            task = self.tasks.pop(ref)
            if task.kind != "probe" and task.role in self.pools:
                self.pools[task.role].busy[task.worker] -= 1
            try:
                value = ray.get(ref)
            except StaleWeightsError:
                self._load(task.worker)          # reload first (actor calls run in order)
                self._again(task)
            except RayActorError as e:
                self._on_actor_error(task, ref, e)
            else:
                self._on_done(task, ref, value)

    def _on_done(self, task: Task, ref, value) -> None:
        now = time.perf_counter()
        plan = self.plans.get(task.step)
        if plan is not None and task.kind in ("rollout", "teacher-rollout", "score") \
                and task.version != plan.version:
            return                               # a part of a plan since re-planned (_again)
        if task.kind in ("rollout", "teacher-rollout"):
            if plan is not None and task.part not in plan.trajs:     # first answer wins
                self._rollout_finished(plan, task.part, ref, now - task.submitted)
        elif task.kind == "score":
            if plan is not None and task.part not in plan.scored:
                plan.scored[task.part] = ref
                plan.teacher_busy += now - task.submitted
                if len(plan.scored) == len(plan.jobs):
                    plan.score_done = now
        elif task.kind == "probe":
            if task.role == "rollout":
                self._load(task.worker)          # before it gets any job
            self.pools[task.role].probe_answered(task.worker)
        elif task.kind == "load":
            self.pools["rollout"].started(task.worker)
            self._sync_progress(ref)
        elif task.kind == "place":
            self.elastic.placed(ref)
        elif task.kind == "train":
            self.training["results"][task.worker] = value
            if len(self.training["results"]) == len(self.learners):
                self._train_finished()

    def _sync_progress(self, ref) -> None:
        if self.sync is not None and ref in self.sync["pending"]:
            self.sync["pending"].discard(ref)
            if not self.sync["pending"]:
                self._sync_done()

    def _on_actor_error(self, task: Task, ref, error: RayActorError) -> None:
        if task.kind == "train":
            raise self._learner_failure("train", task.step, error) from error
        pool = self.pools[task.role]
        if task.kind == "probe":
            pool.probe_failed(task.worker, died=isinstance(error, ActorDiedError))
            return
        pool.failed(task.worker)
        if task.role == "rollout" and self.collective:
            self._fall_back_to_object_store()
        if task.kind == "load":                  # the probe that brings it back reloads it
            self._sync_progress(ref)
            return
        self.metrics.inc("opd_reissued_jobs")
        self._again(task)

    def _again(self, task: Task) -> None:
        """Issue a failed part again (same job, so the same tokens).  A student rollout whose
        plan is older than the published weights cannot be generated again (workers hold only
        the published version, and would answer StaleWeightsError for ever): the whole plan is
        re-planned at the published version, as for a batch that expired in the queue."""
        plan = self.plans.get(task.step)
        if plan is None or task.version != plan.version:
            return                               # gone, or re-planned since it was submitted
        if (task.kind == "rollout" and plan.source == "student"
                and plan.version != self.published.version):
            self._reissue(plan)
            return
        self.reissued += 1
        if task.kind == "score":
            self._submit("score", plan, task.part)
        else:
            self._submit_rollout(plan, task.part)

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
    ("after_submit", "after_step") to callables(pipeline, **info) (tests inject faults there),
    and "rollout_wait" to a callable(pipeline, step=, row=) -> float that an elastic pool's
    policy uses instead of the measured row["rollout_wait"] (tests: actors/elastic.py);
    `interrupt` (actors.interrupt.GracefulInterrupt) defers Ctrl-C to a checkpoint: the run then
    raises opd.reference.RunInterrupted (also on a plain KeyboardInterrupt)."""
    pipeline = Pipeline(cfg, run_dir, progress=progress, hooks=hooks, interrupt=interrupt)
    try:
        return pipeline.run(resume=resume, stop_after=stop_after)
    finally:
        pipeline.shutdown()
