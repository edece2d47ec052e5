"""Ray connection, placement groups and the actor groups of one distributed run.

    groups = ActorGroups.start(cfg, run_dir)   # learners (one DeepSpeed group), rollout, teacher,
                                               # queue, and the evaluation worker (eval.track)
    ...
    groups.shutdown()

Every actor is named by role and index — `opd/learner/0`, `opd/rollout/1`,
`opd/teacher/default/0` (a teacher's pool by its name), `opd/queue`, `opd/eval` (`actor_name`) —
in a namespace of the run's own (`run_namespace`: `opd-<run dir name>-<8 random hex digits>`),
so the Ray dashboard's Actors page reads by role,
two runs on one cluster (or a run resumed while the old one's actors are still dying) never
collide, and `ray.get_actor("opd/rollout/0", namespace=groups.namespace)` finds a worker.  A
worker that Ray restarts after a fault keeps its name; a worker added later (elastic pools)
takes the next index, so no name is ever given twice within a run.
"""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import (NodeAffinitySchedulingStrategy,
                                            PlacementGroupSchedulingStrategy)

from actors.driver.group import call_all
from actors.workers.base import actor_name
from actors.workers.evaluation import EvaluationWorker
from actors.workers.learner import StudentLearner
from actors.workers.queue import TrajectoryQueue
from actors.workers.rollout import RolloutWorker
from actors.workers.teacher import TeacherWorker
from rollout.calibrate import cache_root
from opd.config.schema import RunConfig
from opd.config.loader import ConfigError
from opd.config.files import config_to_dict
from opd.distill.phases import rolls_out
from opd.distill.teachers import run_teachers
from opd.models.factory import load_role_model

PLACEMENT_TIMEOUT_S = 120.0
"""How long a local Ray may take to place the workers."""
CLUSTER_PLACEMENT_TIMEOUT_S = 1800.0
"""The same on a cluster joined at cluster.address (an autoscaler may have to start nodes)."""


def check_distributed(cfg: RunConfig) -> None:
    """What the Ray pipeline needs beyond the schema's own checks (ConfigError naming the key):
    checked when a Ray run starts, since only the Ray pipeline asks it of a config."""
    B, R = cfg.data.batch_size, cfg.learner.world_size
    if B % R:
        raise ConfigError(f"data.batch_size={B} must be a multiple of learner.world_size={R} "
                          f"(each rank trains on an equal shard)", "data.batch_size")
    d = cfg.distill
    if d.broadcast_every - 1 > d.staleness:
        raise ConfigError(f"distill.broadcast_every={d.broadcast_every} lets rollouts lag "
                          f"{d.broadcast_every - 1} versions behind, more than distill.staleness="
                          f"{d.staleness} allows; set distill.staleness >= broadcast_every - 1",
                          "distill.broadcast_every")
    r = cfg.rollout
    if isinstance(r.num_workers, tuple):
        lo, hi = r.num_workers
        if cfg.learner.weight_sync == "collective":
            raise ConfigError(f"rollout.num_workers='{lo}..{hi}' (elastic) cannot use "
                              f"learner.weight_sync='collective': a broadcast group has a fixed "
                              f"size; use learner.weight_sync=object_store or a fixed worker count",
                              "learner.weight_sync")
        if r.elastic_shrink_wait >= r.elastic_grow_wait:
            raise ConfigError(f"rollout.elastic_shrink_wait={r.elastic_shrink_wait:g} must be below "
                              f"rollout.elastic_grow_wait={r.elastic_grow_wait:g} (else the pool "
                              f"would grow and shrink on the same steps)",
                              "rollout.elastic_shrink_wait")


def actor_config(cfg: RunConfig) -> dict:
    """The config as a plain dict for the actors, relative file paths made absolute (actors may
    run in another working directory)."""
    tree = config_to_dict(cfg)
    for section, key in (("data", "data_dir"), ("data", "train"), ("data", "heldout"),
                         ("model", "student_ckpt"), ("model", "teacher_ckpt"), ("model", "vq_ckpt")):
        value = tree[section][key]
        if value:
            tree[section][key] = str(Path(value).expanduser().resolve())
    for t in tree.get("teachers") or []:
        if t.get("ckpt"):
            t["ckpt"] = str(Path(t["ckpt"]).expanduser().resolve())
    return tree


def joins_cluster(cfg: RunConfig) -> bool:
    """True when the run joins an existing cluster: cluster.address, or RAY_ADDRESS (set for
    drivers started by `ray job submit`)."""
    return cfg.cluster.address is not None or bool(os.environ.get("RAY_ADDRESS"))


def connect(cfg: RunConfig) -> bool:
    """Connect to cluster.address (or RAY_ADDRESS, which `ray job submit` sets for the job's
    driver), or start a new local Ray on loopback; True if this call started Ray (and so
    should shut it down)."""
    if ray.is_initialized():
        return False
    c = cfg.cluster
    if joins_cluster(cfg):
        ray.init(address=c.address)              # None: RAY_ADDRESS
        return False
    # address="local": a new Ray even when `ray start` left a cluster address on this machine
    ray.init(address="local", num_cpus=c.num_cpus, include_dashboard=c.include_dashboard,
             dashboard_host=c.dashboard_host, _node_ip_address="127.0.0.1")
    return True


def run_namespace(run_dir: str | Path | None = None) -> str:
    """A Ray namespace of one run's own: `opd-<run dir name>-<8 random hex digits>` (the
    random part keeps two starts of the same run directory apart)."""
    stem = f"opd-{Path(run_dir).name}" if run_dir is not None else "opd"
    return f"{stem}-{uuid.uuid4().hex[:8]}"


def pool_size(n: int | tuple[int, int]) -> int:
    """Workers to start: the count, or the lower end of an elastic "min..max" range (the
    driver adds the others while rollouts hold the run up: actors/driver/elastic.py)."""
    return n[0] if isinstance(n, tuple) else n


def rollout_pool_size(cfg: RunConfig) -> int:
    """Rollout workers a run starts with: none when no phase trains on student rollouts
    (opd/distill/phases.py: KD, SeqKD and GKD at λ 0 never sample from the student)."""
    return pool_size(cfg.rollout.num_workers) if rolls_out(cfg) else 0


def bundle(num_cpus: float, num_gpus: float, custom: str | None = None) -> dict:
    b = {"CPU": num_cpus if num_cpus > 0 else 0.01}      # a bundle must ask for something
    if num_gpus > 0:
        b["GPU"] = num_gpus
    if custom:
        b[custom] = 1.0
    return b


def role_bundle(cfg: RunConfig, role: str, sec=None) -> dict:
    """The resources of one worker of `role` (learner | rollout; a teacher: its entry of
    cfg.teachers, `sec`)."""
    sec = sec or {"learner": cfg.learner, "rollout": cfg.rollout}[role]
    return bundle(sec.num_cpus, sec.num_gpus, f"opd_{role}" if cfg.cluster.role_resources else None)


def run_bundles(cfg: RunConfig, rollout_workers: int) -> list[dict]:
    """Every worker's bundle with `rollout_workers` rollout workers (an autoscaler request)."""
    return ([role_bundle(cfg, "learner")] * cfg.learner.world_size
            + [role_bundle(cfg, "teacher", t) for t in cfg.teachers
               for _ in range(t.num_workers)]
            + [role_bundle(cfg, "rollout")] * rollout_workers)


def bundle_node(pg, index: int = 0) -> str:
    """The id of the node that holds bundle `index` of the placed group `pg`."""
    from ray.util import placement_group_table
    return placement_group_table(pg)["bundles_to_node_id"][index]


def fits(need: dict, available: dict) -> bool:
    return all(available.get(k, 0.0) + 1e-9 >= v for k, v in need.items())


@dataclass
class ActorGroups:
    learners: list = field(default_factory=list)
    rollout: list = field(default_factory=list)
    teacher_pools: dict = field(default_factory=dict)   # pool name -> its teacher workers
    queue: object = None
    evaluator: object = None
    pgs: list = field(default_factory=list)
    namespace: str = ""                         # the run's Ray namespace (run_namespace)
    infos: dict = field(default_factory=dict)   # role -> each worker's `info` when it started

    @property
    def teacher(self) -> list:
        """Every teacher worker, pool after pool."""
        return [a for actors in self.teacher_pools.values() for a in actors]

    @classmethod
    def start(cls, cfg: RunConfig, run_dir: str | Path | None = None, *,
              progress: bool = False) -> ActorGroups:
        """Place and start every actor; the learner group is set up (DeepSpeed engines built).
        With eval.track and a `run_dir`, an evaluation worker too (it writes the run's sample
        grids).  On a local Ray (no cluster.address) resources that cannot fit are refused at
        once."""
        for t in cfg.teachers:
            if not (t.ckpt or cfg.model.teacher_ckpt):   # train or find the cached pretrained
                load_role_model(cfg, "teacher", teacher=t, progress=progress)   # models once
        if not cfg.model.student_ckpt:
            load_role_model(cfg, "student", progress=progress)
        groups = cls(namespace=run_namespace(run_dir))
        try:
            groups._start(cfg, run_dir if cfg.eval.track else None)
        except BaseException:
            groups.shutdown()
            raise
        return groups

    def _start(self, cfg: RunConfig, run_dir: str | Path | None) -> None:
        c = actor_config(cfg)
        teachers = run_teachers(cfg)
        roles = (("learner", StudentLearner, cfg.learner.world_size, cfg.learner, 0),
                 ("rollout", RolloutWorker, rollout_pool_size(cfg), cfg.rollout,
                  cfg.cluster.max_restarts),
                 *((teachers.pool(i), TeacherWorker, t.num_workers, t, cfg.cluster.max_restarts)
                   for i, t in enumerate(teachers.entries)))
        sections = [(sec, n) for _, _, n, sec, _ in roles] + ([(cfg.eval, 1)] if run_dir else [])
        need = {"CPU": sum(bundle(sec.num_cpus, sec.num_gpus)["CPU"] * n for sec, n in sections),
                "GPU": sum(sec.num_gpus * n for sec, n in sections)}
        have = ray.cluster_resources()
        local = not joins_cluster(cfg)           # an autoscaler may add nodes to a cluster
        for res, amount in need.items():
            if local and amount > have.get(res, 0.0) + 1e-9:
                raise ConfigError(
                    f"the workers need {amount:g} {res} (learner.world_size x learner.num_{res.lower()}s + "
                    f"rollout.num_workers x rollout.num_{res.lower()}s + teacher.num_workers x "
                    f"teacher.num_{res.lower()}s + eval.num_{res.lower()}s with eval.track) but "
                    f"the Ray cluster has {have.get(res, 0.0):g}; "
                    f"use fractions (e.g. rollout.num_{res.lower()}s=0.5) or a larger cluster "
                    f"(cluster.num_cpus)", f"rollout.num_{res.lower()}s")
        pgs = {}
        for name, _, count, sec, _ in roles:
            if count == 0:                       # no rollout worker: no phase samples the student
                continue
            pgs[name] = placement_group([role_bundle(cfg, name.split("/")[0], sec)] * count,
                                        strategy="PACK")
            self.pgs.append(pgs[name])
        for name, pg in pgs.items():
            if not pg.wait(timeout_seconds=PLACEMENT_TIMEOUT_S if local else CLUSTER_PLACEMENT_TIMEOUT_S):
                raise ConfigError(f"the Ray cluster cannot place the {name} workers (see {name}.num_cpus, "
                                  f"{name}.num_gpus and the worker counts); it has "
                                  f"{ray.cluster_resources()}", f"{name}.num_cpus")
        for name, cls_, count, sec, restarts in roles:
            extra = (teachers.names.index(sec.name),) if cls_ is TeacherWorker else ()
            actors = [_spawn(cls_, c, i, sec, restarts, pgs.get(name), i,
                             actor_name(name, i), self.namespace, extra) for i in range(count)]
            if cls_ is TeacherWorker:
                self.teacher_pools[name] = actors
            else:
                setattr(self, name if name != "learner" else "learners", actors)
        if run_dir is not None:
            self.evaluator = self._start_evaluator(cfg, c, run_dir, local)
        infos = call_all(self.learners, "info")
        # the queue shares learner rank 0's node, whose loss stops the run anyway: left to
        # Ray's default placement it may land on a rollout or teacher node and die with it
        self.queue = ray.remote(TrajectoryQueue).options(
            num_cpus=0, name=actor_name("queue"), namespace=self.namespace,
            scheduling_strategy=NodeAffinitySchedulingStrategy(infos[0]["node_id"], soft=False)
        ).remote(cfg.distill.staleness, cfg.learner.world_size)
        loopback = len({i["node_id"] for i in infos}) == 1
        host, port = ray.get(self.learners[0].master_address.remote(loopback))
        call_all(self.learners, "setup", host, port)
        call_all(self.learners, "attach_queue", self.queue)
        self.infos = {"learner": infos, "rollout": call_all(self.rollout, "info"),  # constructed
                      **{name: call_all(actors, "info")
                         for name, actors in self.teacher_pools.items()}}

    def _start_evaluator(self, cfg: RunConfig, c: dict, run_dir: str | Path, local: bool):
        """The evaluation worker in a one-bundle group of its own (not waited for: its first
        call answers once it is built; it starts beside the learner setup)."""
        e = cfg.eval
        pg = self.new_group(bundle(e.num_cpus, e.num_gpus))
        if not pg.wait(timeout_seconds=PLACEMENT_TIMEOUT_S if local else CLUSTER_PLACEMENT_TIMEOUT_S):
            raise ConfigError(f"the Ray cluster cannot place the evaluation worker (eval.num_cpus="
                              f"{e.num_cpus:g}, eval.num_gpus={e.num_gpus:g}); lower them or set "
                              f"eval.track=false", "eval.num_cpus")
        return ray.remote(EvaluationWorker).options(
            num_cpus=e.num_cpus, num_gpus=e.num_gpus,
            runtime_env={"env_vars": {"OPD_CACHE": str(cache_root())}},
            max_restarts=0, max_task_retries=0,
            name=actor_name("evaluation"), namespace=self.namespace,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=0),
        ).remote(c, str(Path(run_dir).resolve()))

    def new_group(self, bundle_: dict):
        """A one-bundle placement group, given back at shutdown (or by `remove_group`)."""
        pg = placement_group([bundle_])
        self.pgs.append(pg)
        return pg

    def new_rollout_worker(self, cfg: RunConfig, pg, index: int) -> object:
        """Start rollout worker `index` in the placed one-bundle group `pg` (not waited for:
        its first call answers once it is built).  The caller appends it to self.rollout."""
        return _spawn(RolloutWorker, actor_config(cfg), index, cfg.rollout,
                      cfg.cluster.max_restarts, pg, 0, actor_name("rollout", index), self.namespace)

    def remove_group(self, pg) -> None:
        """Give back a placement group started by this run (its actor is gone)."""
        if pg in self.pgs:
            self.pgs.remove(pg)
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - already removed
            pass

    def join_broadcast(self, cfg: RunConfig) -> None:
        """Learner rank 0 (member 0) and every rollout worker form the weight-broadcast group."""
        backend = "nccl" if cfg.learner.num_gpus > 0 and cfg.rollout.num_gpus > 0 else "gloo"
        infos = call_all([self.learners[0], *self.rollout], "info")
        host, port = ray.get(self.learners[0].master_address.remote(
            len({i["node_id"] for i in infos}) == 1))
        size = len(self.rollout) + 1
        plan = ray.get(self.learners[0].bucket_plan.remote())
        ray.get([self.learners[0].join_broadcast.remote(host, port, size, backend)]
                + [w.join_broadcast.remote(host, port, i + 1, size, backend, plan)
                   for i, w in enumerate(self.rollout)])

    def shutdown(self) -> None:
        for actor in [*self.rollout, *self.teacher, *self.learners, self.queue, self.evaluator]:
            if actor is not None:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass
        self.learners, self.rollout, self.teacher_pools, self.queue, self.pgs = [], [], {}, None, []
        self.evaluator = None


def _spawn(cls_, c: dict, index: int, sec, restarts: int, pg, bundle_index: int, name: str,
           namespace: str, extra: tuple = ()):
    """One worker actor of class `cls_` in bundle `bundle_index` of placement group `pg`, named
    `name` in `namespace` (`extra`: arguments after its index: a teacher's)."""
    return ray.remote(cls_).options(
        num_cpus=sec.num_cpus, num_gpus=sec.num_gpus, name=name, namespace=namespace,
        runtime_env={"env_vars": {"OPD_CACHE": str(cache_root())}},
        max_restarts=restarts, max_task_retries=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle_index)).remote(c, index, *extra)
