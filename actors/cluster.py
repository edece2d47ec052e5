"""Ray connection, placement groups and the actor groups of one distributed run.

    groups = ActorGroups.start(cfg)      # learners (one DeepSpeed group), rollout, teacher, queue
    ...
    groups.shutdown()
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.learner import StudentLearner
from actors.queue import TrajectoryQueue
from actors.rollout_worker import RolloutWorker
from actors.teacher_worker import TeacherWorker
from opd.config import ConfigError, RunConfig, config_to_dict
from opd.pretrain import cache_dir, load_role_model

PLACEMENT_TIMEOUT_S = 120.0
"""How long a local Ray may take to place the workers."""
CLUSTER_PLACEMENT_TIMEOUT_S = 1800.0
"""The same on a cluster joined at cluster.address (an autoscaler may have to start nodes)."""


def check_distributed(cfg: RunConfig) -> None:
    """What the Ray pipeline needs beyond the schema's own checks (ConfigError naming the key)."""
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


def actor_config(cfg: RunConfig) -> dict:
    """The config as a plain dict for the actors, relative file paths made absolute (actors may
    run in another working directory)."""
    tree = config_to_dict(cfg)
    for section, key in (("data", "data_dir"), ("data", "train"), ("data", "heldout"),
                         ("model", "student_ckpt"), ("model", "teacher_ckpt"), ("model", "vq_ckpt")):
        value = tree[section][key]
        if value:
            tree[section][key] = str(Path(value).expanduser().resolve())
    return tree


def joins_cluster(cfg: RunConfig) -> bool:
    """True when the run joins an existing cluster: cluster.address, or RAY_ADDRESS (set for
    drivers started by `ray job submit`)."""
    return cfg.cluster.address is not None or bool(os.environ.get("RAY_ADDRESS"))


def connect(cfg: RunConfig) -> bool:
    """Connect to cluster.address (or RAY_ADDRESS), or start a local Ray on loopback; True if
    this call started Ray (and so should shut it down)."""
    if ray.is_initialized():
        return False
    c = cfg.cluster
    if joins_cluster(cfg):
        ray.init(address=c.address)              # None: RAY_ADDRESS
        return False
    ray.init(num_cpus=c.num_cpus, include_dashboard=c.include_dashboard,
             dashboard_host=c.dashboard_host, _node_ip_address="127.0.0.1")
    return True


def pool_size(n: int | tuple[int, int]) -> int:
    """Workers to start: the count, or the upper end of an elastic "min..max" range."""
    return n[1] if isinstance(n, tuple) else n


def bundle(num_cpus: float, num_gpus: float, custom: str | None = None) -> dict:
    b = {"CPU": num_cpus if num_cpus > 0 else 0.01}      # a bundle must ask for something
    if num_gpus > 0:
        b["GPU"] = num_gpus
    if custom:
        b[custom] = 1.0
    return b


@dataclass
class ActorGroups:
    learners: list = field(default_factory=list)
    rollout: list = field(default_factory=list)
    teacher: list = field(default_factory=list)
    queue: object = None
    pgs: list = field(default_factory=list)

    @classmethod
    def start(cls, cfg: RunConfig, *, progress: bool = False) -> ActorGroups:
        """Place and start every actor; the learner group is set up (DeepSpeed engines built).
        On a local Ray (no cluster.address) resources that cannot fit are refused at once."""
        for role in ("teacher", "student"):     # train or find the cached pretrained models once
            if not (cfg.model.teacher_ckpt if role == "teacher" else cfg.model.student_ckpt):
                load_role_model(cfg, role, progress=progress)
        groups = cls()
        try:
            groups._start(cfg)
        except BaseException:
            groups.shutdown()
            raise
        return groups

    def _start(self, cfg: RunConfig) -> None:
        c = actor_config(cfg)
        env = {"env_vars": {"OPD_CACHE": str(cache_dir())}}
        roles = (("learner", StudentLearner, cfg.learner.world_size, cfg.learner, 0),
                 ("rollout", RolloutWorker, pool_size(cfg.rollout.num_workers), cfg.rollout,
                  cfg.cluster.max_restarts),
                 ("teacher", TeacherWorker, cfg.teacher.num_workers, cfg.teacher,
                  cfg.cluster.max_restarts))
        need = {"CPU": sum(bundle(sec.num_cpus, sec.num_gpus)["CPU"] * n for _, _, n, sec, _ in roles),
                "GPU": sum(sec.num_gpus * n for _, _, n, sec, _ in roles)}
        have = ray.cluster_resources()
        local = not joins_cluster(cfg)           # an autoscaler may add nodes to a cluster
        for res, amount in need.items():
            if local and amount > have.get(res, 0.0) + 1e-9:
                raise ConfigError(
                    f"the workers need {amount:g} {res} (learner.world_size x learner.num_{res.lower()}s + "
                    f"rollout.num_workers x rollout.num_{res.lower()}s + teacher.num_workers x "
                    f"teacher.num_{res.lower()}s) but the Ray cluster has {have.get(res, 0.0):g}; "
                    f"use fractions (e.g. rollout.num_{res.lower()}s=0.5) or a larger cluster "
                    f"(cluster.num_cpus)", f"rollout.num_{res.lower()}s")
        custom = cfg.cluster.role_resources
        pgs = {}
        for name, _, count, sec, _ in roles:
            b = [bundle(sec.num_cpus, sec.num_gpus, f"opd_{name}" if custom else None)
                 for _ in range(count)]
            pgs[name] = placement_group(b, strategy="PACK")
            self.pgs.append(pgs[name])
        for name, pg in pgs.items():
            if not pg.wait(timeout_seconds=PLACEMENT_TIMEOUT_S if local else CLUSTER_PLACEMENT_TIMEOUT_S):
                raise ConfigError(f"the Ray cluster cannot place the {name} workers (see {name}.num_cpus, "
                                  f"{name}.num_gpus and the worker counts); it has "
                                  f"{ray.cluster_resources()}", f"{name}.num_cpus")
        for name, cls_, count, sec, restarts in roles:
            actors = [ray.remote(cls_).options(
                num_cpus=sec.num_cpus, num_gpus=sec.num_gpus, runtime_env=env,
                max_restarts=restarts, max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pgs[name], placement_group_bundle_index=i)).remote(c, i)
                for i in range(count)]
            setattr(self, name if name != "learner" else "learners", actors)
        self.queue = ray.remote(TrajectoryQueue).options(num_cpus=0).remote(
            cfg.distill.queue_capacity, cfg.distill.staleness)
        infos = ray.get([a.info.remote() for a in self.learners])
        loopback = len({i["node_id"] for i in infos}) == 1
        host, port = ray.get(self.learners[0].master_address.remote(loopback))
        ray.get([a.setup.remote(host, port) for a in self.learners])
        ray.get([a.info.remote() for a in self.rollout + self.teacher])   # constructed

    def join_broadcast(self, cfg: RunConfig) -> None:
        """Learner rank 0 (member 0) and every rollout worker form the weight-broadcast group."""
        backend = "nccl" if cfg.learner.num_gpus > 0 and cfg.rollout.num_gpus > 0 else "gloo"
        infos = ray.get([a.info.remote() for a in [self.learners[0], *self.rollout]])
        host, port = ray.get(self.learners[0].master_address.remote(
            len({i["node_id"] for i in infos}) == 1))
        size = len(self.rollout) + 1
        plan = ray.get(self.learners[0].bucket_plan.remote())
        ray.get([self.learners[0].join_broadcast.remote(host, port, size, backend)]
                + [w.join_broadcast.remote(host, port, i + 1, size, backend, plan)
                   for i, w in enumerate(self.rollout)])

    def shutdown(self) -> None:
        for actor in [*self.rollout, *self.teacher, *self.learners, self.queue]:
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
        self.learners, self.rollout, self.teacher, self.queue, self.pgs = [], [], [], None, []
