"""`Worker`: what every actor of a role has — its config, name, device, info, metrics and
payload counters — and the weight loading of a worker that holds a student copy (rollout and
evaluation workers; the broadcast group's receiving side is the rollout worker's).

    class RolloutWorker(Worker):
        role = "rollout"
        def __init__(self, cfg, index=0):
            super().__init__(cfg, index)       # cfg: a RunConfig or its plain dict
            self.model = ...                              # the student copy load_weights fills

Every actor is named by role and index (`actor_name`: `opd/rollout/0`, `opd/queue`,
`opd/eval`) in the run's Ray namespace (actors/driver/cluster.py); its repr says its role and the
policy version it holds, which the Ray dashboard shows (docs/ARCHITECTURE.md).
"""
from __future__ import annotations

import os
import time

import ray
import torch

from actors.ray_metrics import RoleMetrics
from actors.transport.iostats import IOCounter
from actors.transport.weights import load_numpy_weights, untag_weights
from opd.config.schema import RunConfig, config_from_dict

ROLE_NAMES = {"learner": "learner", "rollout": "rollout", "teacher": "teacher",
              "queue": "queue", "evaluation": "eval"}
SINGLE = ("queue", "evaluation")            # one actor of the role: no index in its name
SECTIONS = {"evaluation": "eval"}           # the config section of a role, where not its name


def actor_name(role: str, index: int | None = None) -> str:
    """The Ray name of a run's actor: `opd/<role>/<index>`, or `opd/<role>` for a single one
    (role: learner | rollout | teacher | queue | evaluation, which is named `opd/eval`; or a
    teacher's pool, `teacher/<name>`)."""
    name = f"opd/{ROLE_NAMES.get(role, role)}"
    return name if index is None else f"{name}/{index}"


def cpu_threads(num_cpus: float) -> int:
    """The torch threads of an actor with a Ray CPU share of `num_cpus`: the whole CPUs it was
    given, at least one (stages that overlap on a node then do not oversubscribe its cores)."""
    return max(1, int(num_cpus))


def role_device(num_gpus: float) -> torch.device:
    return torch.device("cuda", 0) if num_gpus > 0 and torch.cuda.is_available() else torch.device("cpu")


class Worker:
    """The base of the role actors (plain classes, wrapped by `ray.remote` in
    actors/driver/cluster.py).  `version` is the policy version it holds (None: none yet)."""
    role = ""
    version: int | None = None

    def __init__(self, cfg: RunConfig | dict, index: int):
        self.cfg = cfg if isinstance(cfg, RunConfig) else config_from_dict(cfg)
        self.index = index
        section = self.section()
        self.device = role_device(section.num_gpus)
        torch.set_num_threads(cpu_threads(section.num_cpus))   # its Ray CPU share, no more
        self.metrics = RoleMetrics(self.role, index)
        self.io = IOCounter()
        self.model: torch.nn.Module | None = None

    def section(self):
        """Its config section, which sets its resources: cfg.rollout, cfg.eval, ..."""
        return getattr(self.cfg, SECTIONS.get(self.role, self.role))

    @property
    def name(self) -> str:
        return actor_name(self.role, None if self.role in SINGLE else self.index)

    def info(self) -> dict:
        """Where it runs (pid, device, node, threads), the version it holds, its repr."""
        return {"role": self.role, "index": self.index, "pid": os.getpid(),
                "device": str(self.device), "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address(), "threads": torch.get_num_threads(),
                "version": self.version, "repr": repr(self)}

    def __repr__(self) -> str:
        """Role, index and the policy version it holds (Ray's dashboard shows the repr the
        actor had when it was built or restarted: version None)."""
        return f"{type(self).__name__}({self.name}, version={self.version})"

    def io_stats(self) -> dict:
        """Payload bytes received and sent, peak RSS (actors/transport/iostats.py)."""
        return self.io.stats()

    # -- weights of a student copy (`self.model`) ------------------------------------------------

    def load_weights(self, version: int, payload: dict) -> float:
        """Copy the tagged flat numpy weights of `version` (one object-store object) into the
        student copy; returns the seconds it took."""
        start = time.perf_counter()
        self.io.received(payload)
        load_numpy_weights(self.model, untag_weights(payload, version))
        self.version = int(version)
        return time.perf_counter() - start
