"""`Dispatcher`: the driver's tasks in flight on the workers, and what happened to them.

It hands a task to the least busy worker of its pool that is up (or keeps it waiting until one
is), probes failed workers when they are due, and waits for answers.  What waits is handed out
again only when its pool changed (`changed`: a task of the pool ended, a worker came up after a
probe or a weights load, or one died for good), never by polling.  A teacher worker holds
at most two scorings (the one it runs and the next, so it never waits for the driver between
two), and the waiting ones go out lowest (step, piece) first: a step's pieces complete in any
order, but its learner ranks train them in piece order, so a piece 0 queued behind the others
on a teacher worker would hold the step back.  A rollout call is a Ray streaming generator
(`num_returns="streaming"`): it answers once per piece it hands out, then once with its
`PartReport`, and counts against its worker until then.  Each answer comes back
as an `Answer`: done (with its small value), or the error that ended it — the worker held
other weights (`StaleWeightsError`), the worker failed (`RayActorError`: Ray restarts it; the
pool takes it out until a probe answers), or a payload its task needed was lost with the worker
that owned it (`ObjectLostError`).  What to do about each is the pipeline's business.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import ray
from ray.exceptions import ObjectLostError, RayActorError

from actors.driver.pool import DEAD, WorkerPool
from actors.driver.tasks import Probe, Task
from actors.transport.delivery import PartReport
from actors.workers.rollout import StaleWeightsError


class WorkerPoolExhausted(RuntimeError):
    """Every worker of a pool died for good (its restarts used up)."""


@dataclass
class Answer:
    task: Task
    ref: ray.ObjectRef
    value: object = None
    error: BaseException | None = None

    @property
    def lost_input(self) -> bool:
        """A payload the task needed was lost (its owner died), not this worker's fault."""
        e = self.error
        return isinstance(e, ObjectLostError) or isinstance(getattr(e, "cause", None), ObjectLostError)


class Dispatcher:
    def __init__(self, groups, max_restarts: int):
        self.max_restarts = max_restarts
        self.pools = {"rollout": WorkerPool("rollout", groups.rollout),
                      **{name: WorkerPool(name, actors, depth=2)   # running + next
                         for name, actors in groups.teacher_pools.items()}}
        self.tasks: dict[ray.ObjectRef | ray.ObjectRefGenerator, Task] = {}
        self.backlog: list[tuple[Task, object]] = []   # (task, command) waiting for a worker
        self.changed: set[str] = set()     # pools whose workers changed since `take_changed`

    def track(self, ref: ray.ObjectRef | ray.ObjectRefGenerator, task: Task) -> None:
        """Wait on `ref` (a rollout call's stream: on each of its answers); a rollout call, a
        scoring or a weights load counts against its worker's load."""
        self.tasks[ref] = task
        if task.role in self.pools and task.counted:
            self.pools[task.role].busy[task.worker] += 1

    def submit(self, task: Task, command, call: Callable, pool: str,
               pinned: int | None = None) -> int | None:
        """`call(actor)` on the least busy worker of `pool` that is up, or on worker `pinned`
        while it is up, or with -1 on any (`WorkerPool.pick`; returns its index), else keep
        `command` waiting (None: `waiting` gives it back)."""
        role, pool = pool, self.pools[pool]
        if pool.exhausted:
            raise WorkerPoolExhausted(f"every {role} worker died (cluster.max_restarts="
                                      f"{self.max_restarts} restarts each were used up)")
        i = pool.pick(pinned)
        if i is None:
            task.role = role
            self.backlog.append((task, command))
            return None
        task.role, task.worker = role, i
        self.track(call(pool.actors[i]), task)
        return i

    def forget_step(self, step: int) -> None:
        """Commands of `step` waiting for a worker are dropped (the step is re-planned)."""
        self.backlog = [w for w in self.backlog if w[0].step != step]

    def probe(self) -> None:
        """Probe the failed workers that are due (`idle_for` says when the next one is)."""
        for role, pool in self.pools.items():
            for i in pool.due():
                self.track(pool.actors[i].info.remote(), Probe(role=role, worker=i))

    def probe_answered(self, role: str, i: int) -> None:
        self.pools[role].probe_answered(i)
        self.changed.add(role)

    def probe_failed(self, role: str, i: int, died: bool) -> None:
        pool = self.pools[role]
        pool.probe_failed(i, died)
        if pool.state[i] == DEAD:          # its waiting commands: to the others, or exhausted
            self.changed.add(role)

    def started(self, i: int) -> None:
        """Rollout worker i answered its first weights load (an elastic pool's new worker)."""
        self.pools["rollout"].started(i)
        self.changed.add("rollout")

    def take_changed(self) -> set[str]:
        """The pools that changed since the last call (cleared)."""
        changed, self.changed = self.changed, set()
        return changed

    def waiting(self, pools: set[str]) -> list[tuple[Task, object]]:
        """Return (and clear) the commands waiting for a worker of `pools`, lowest (step,
        piece) first (a rollout call, which has no piece, before its step's scorings)."""
        waiting = [w for w in self.backlog if w[0].role in pools]
        self.backlog = [w for w in self.backlog if w[0].role not in pools]
        return sorted(waiting, key=lambda w: w[0].order())

    def idle_for(self) -> float | None:
        """Seconds until the next probe is due (None: none)."""
        probes = [t for t in (p.next_probe_in() for p in self.pools.values()) if t is not None]
        return min(probes) if probes else None

    def wait(self, timeout: float, interrupt) -> list[Answer]:
        """The answers that arrive within `timeout` seconds (at least one if any is in flight)."""
        if not self.tasks:
            with interrupt.safe():
                time.sleep(timeout)
            return []
        with interrupt.safe():
            done, _ = ray.wait(list(self.tasks), num_returns=1, timeout=timeout)
        answers = []
        for ref in done:
            task = self.tasks[ref]
            if isinstance(ref, ray.ObjectRefGenerator):
                try:
                    item = next(ref)
                except StopIteration:                # ended without its report (not ours)
                    self._finished(ref)
                    continue
            else:
                item = ref
            try:
                value = ray.get(item)
            except (StaleWeightsError, RayActorError, ObjectLostError) as e:
                answers.append(Answer(task, item, error=e))
                self._finished(ref)
                continue
            except ray.exceptions.RayTaskError as e:
                if not isinstance(getattr(e, "cause", None), ObjectLostError):
                    raise
                answers.append(Answer(task, item, error=e))
                self._finished(ref)
                continue
            answers.append(Answer(task, item, value))
            if not task.streams or isinstance(value, PartReport):
                self._finished(ref)
        return answers

    def _finished(self, ref) -> None:
        task = self.tasks.pop(ref)
        if task.counted and task.role in self.pools:
            self.pools[task.role].busy[task.worker] -= 1
            self.changed.add(task.role)
