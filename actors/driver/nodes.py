"""`NodeWatch`: which Ray node each worker runs on, and the nodes lost or added during a run.

Every worker's `info` names its node (actors/workers/base.py).  The driver records it when the
run starts (`placed`), when a failed worker's probe answers (a worker that Ray restarted after
its node was lost answers from its new node) and when an elastic worker is added.  Between
steps it compares the cluster's live nodes (`ray.nodes()`, at most once a second: `poll`) with
its last look, and prints one line per change:

    node 10.0.0.7 (3f2a9c1d) lost at step 12: rollout worker 1; their parts are issued again
    rollout worker 1 re-made on node 10.0.0.9 (77b0e2aa), 6.3 s after node 3f2a9c1d was lost
    node 10.0.0.9 (77b0e2aa) added: opd_rollout 1, CPU 16

What happens to the work of a lost node is the pipeline's (docs/ARCHITECTURE.md, "Faults"):
parts a lost worker was making and pieces its object store held are issued again, Ray restarts
the worker wherever its placement-group bundle can be placed again, and the learner group's
loss stops the run at its last checkpoint.  This class only watches and records:
`events` (consumed.json "node_events": each loss with the workers it held, when the next step
trained after it and when each of its workers answered again; each added node) and `ran_on()`
(consumed.json "nodes": the nodes each role ran on, which the run summary prints).

`update(step, live)` is the plain bookkeeping (tested without Ray); `poll(step)` feeds it Ray's
node table.
"""
from __future__ import annotations

import time
from typing import Callable

POLL_S = 1.0
ROLES = ("learner", "rollout", "teacher")


def short(node_id: str) -> str:
    return node_id[:8]


def opd_resources(resources: dict) -> str:
    """The resources a node brings to a run, `opd_rollout 1, CPU 16` (opd_* first)."""
    keys = sorted((k for k in resources if k.startswith("opd_")), key=str) + [
        k for k in ("CPU", "GPU") if resources.get(k)]
    return ", ".join(f"{k} {resources[k]:g}" for k in keys)


class NodeWatch:
    def __init__(self, *, log: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.monotonic, poll_s: float = POLL_S,
                 table: Callable[[], list[dict]] | None = None):
        """`table`: Ray's node table (`ray.nodes()`, the default) or a stand-in (tests)."""
        self.log, self.clock, self.poll_s, self.table = log, clock, poll_s, table
        self.start = clock()
        self.where: dict[tuple[str, int], str] = {}          # (role, index) -> node id
        self.ips: dict[str, str] = {}                         # node id -> ip
        self.history: dict[str, list[str]] = {r: [] for r in ROLES}   # role -> node ids, in order
        self.live: dict[str, dict] | None = None              # node id -> {"ip", "resources"}
        self.awaiting: dict[tuple[str, int], dict] = {}       # worker -> the loss event it was in
        self.events: list[dict] = []
        self._polled = -float("inf")

    # -- where workers run ------------------------------------------------------------------

    def placed(self, role: str, index: int, node_id: str, ip: str = "") -> None:
        """Worker (role, index) runs on `node_id` (its `info` answered from there)."""
        if ip:
            self.ips[node_id] = ip
        self.where[(role, index)] = node_id
        if node_id not in self.history.setdefault(role, []):
            self.history[role].append(node_id)
        lost = self.awaiting.pop((role, index), None)
        if lost is not None:
            after = round(self._now() - lost["t"], 3)
            lost["remade"][f"{role}/{index}"] = {"node": node_id, "after_s": after}
            self.log(f"{role} worker {index} re-made on node {self._name(node_id)}, {after:.1f} s "
                     f"after node {short(lost['node'])} was lost")

    def ran_on(self) -> dict[str, list[dict]]:
        """The nodes ({"node": id, "ip"}) each role's workers ran on, in the order first seen."""
        return {r: [{"node": n, "ip": self.ips.get(n, "")} for n in ids]
                for r, ids in self.history.items() if ids}

    # -- the cluster's nodes ----------------------------------------------------------------

    def poll(self, step: int) -> list[tuple[str, int]]:
        """Look at Ray's node table (at most every `poll_s` seconds) and record what changed;
        returns the workers (role, index) whose node was lost."""
        now = self.clock()
        if now - self._polled < self.poll_s:
            return []
        self._polled = now
        if self.table is None:
            import ray
            self.table = ray.nodes
        return self.update(step, {n["NodeID"]: {"ip": n.get("NodeManagerAddress", ""),
                                                "resources": n.get("Resources", {})}
                                  for n in self.table() if n.get("Alive")})

    def update(self, step: int, live: dict[str, dict]) -> list[tuple[str, int]]:
        """`live`: node id -> {"ip", "resources"} of the nodes alive now; the first call only
        remembers them.  Returns the workers (role, index) on the nodes lost since the last."""
        for node_id, n in live.items():
            self.ips.setdefault(node_id, n.get("ip", ""))
        lost = []
        if self.live is not None:
            for node_id in [n for n in self.live if n not in live]:
                lost += self._lost(step, node_id)
            for node_id in [n for n in live if n not in self.live]:
                self._added(step, node_id, live[node_id].get("resources", {}))
        self.live = dict(live)
        return lost

    def stepped(self, step: int) -> None:
        """A step trained: the first after a loss says how long the run was held up."""
        for e in self.events:
            if e["event"] == "lost" and e["next_step_s"] is None:
                e["next_step"], e["next_step_s"] = step, round(self._now() - e["t"], 3)

    # -- events -----------------------------------------------------------------------------

    def _lost(self, step: int, node_id: str) -> list[tuple[str, int]]:
        held = sorted(k for k, n in self.where.items() if n == node_id)
        event = {"event": "lost", "node": node_id, "ip": self.ips.get(node_id, ""),
                 "step": step, "t": round(self._now(), 3),
                 "workers": [f"{r}/{i}" for r, i in held], "remade": {},
                 "next_step": None, "next_step_s": None}
        self.events.append(event)
        for key in held:
            self.awaiting[key] = event
        what = ", ".join(f"{r} worker {i}" for r, i in held) or "no worker of this run"
        tail = "; their parts are issued again" if held else ""
        if any(r == "learner" for r, _ in held):
            tail = "; the learner group is lost, the run stops at its last checkpoint"
        self.log(f"node {self._name(node_id)} lost at step {step}: {what}{tail}")
        return held

    def _added(self, step: int, node_id: str, resources: dict) -> None:
        self.events.append({"event": "added", "node": node_id, "ip": self.ips.get(node_id, ""),
                            "step": step, "t": round(self._now(), 3),
                            "resources": {k: v for k, v in resources.items()
                                          if k.startswith("opd_") or k in ("CPU", "GPU")}})
        self.log(f"node {self._name(node_id)} added at step {step}: "
                 f"{opd_resources(resources) or 'no resources'}")

    def _name(self, node_id: str) -> str:
        ip = self.ips.get(node_id)
        return f"{ip} ({short(node_id)})" if ip else short(node_id)

    def _now(self) -> float:
        return self.clock() - self.start
