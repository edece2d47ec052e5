"""`WorkerPool`: the driver's view of one role's workers — which are up, how busy, when to probe.

Ray restarts a failed actor by itself (`max_restarts`); while it restarts, calls to it fail at
once with `ActorUnavailableError`.  So a worker that failed is taken out of the rotation
("down"), probed with a cheap call after a back-off, and put back ("up") when the probe
answers — for a rollout worker only after its weights reload has been submitted.  A worker
whose probes keep failing with `ActorDiedError` (its restarts used up) is "dead".

An elastic pool also has workers being added ("starting": placed and constructing, given their
weights before any job, up when the load answers) and workers taken out for good while idle
("retired").

A pool with a `depth` gives a worker at most that many tasks at once; the driver keeps the
rest and hands them out as workers free up (dispatch.py: a teacher worker holds two scorings,
so the pieces the learner needs first are scored first).
"""
from __future__ import annotations

import time
from collections import Counter

UP, DOWN, DEAD, STARTING, RETIRED = "up", "down", "dead", "starting", "retired"


class WorkerPool:
    def __init__(self, role: str, actors: list, *, backoff_s: float = 0.5, died_probes: int = 3,
                 depth: int | None = None):
        self.role, self.actors, self.depth = role, actors, depth
        self.state = [UP] * len(actors)
        self.busy: Counter[int] = Counter()          # tasks in flight per worker
        self.probe_at: dict[int, float] = {}
        self.probing: set[int] = set()
        self.died: Counter[int] = Counter()          # consecutive probes that found it dead
        self.failures = 0
        self.backoff_s, self.died_probes = backoff_s, died_probes
        self._turn = 0

    def __len__(self) -> int:
        return len(self.actors)

    def up(self) -> list[int]:
        return [i for i, s in enumerate(self.state) if s == UP]

    def alive(self) -> list[int]:
        """Workers that are or will be up again (not dead, not retired)."""
        return [i for i, s in enumerate(self.state) if s not in (DEAD, RETIRED)]

    def starting(self) -> list[int]:
        return [i for i, s in enumerate(self.state) if s == STARTING]

    def loadable(self) -> list[int]:
        """Workers that take weight loads: up or starting."""
        return [i for i, s in enumerate(self.state) if s in (UP, STARTING)]

    def add(self, actor) -> int:
        """Append a new worker to `actors` (for the rollout pool that is the `ActorGroups`
        list), starting: no jobs until `started`; returns its index."""
        self.actors.append(actor)
        self.state.append(STARTING)
        return len(self.actors) - 1

    def started(self, i: int) -> None:
        if self.state[i] == STARTING:
            self.state[i] = UP

    def retire(self, i: int) -> None:
        """Take worker i out for good (it gets no jobs and no probes)."""
        self.state[i] = RETIRED
        self.probe_at.pop(i, None)
        self.probing.discard(i)

    @property
    def exhausted(self) -> bool:
        return not self.alive()

    def pick(self, pinned: int | None = None) -> int | None:
        """The up worker with the fewest tasks in flight (taking turns on ties), or None; with
        a `depth`, only a worker with fewer than `depth` tasks in flight.  Work pinned to worker
        `pinned` (a rollout call's spans and pieces: actors/driver/spans.py; -1, not placed
        yet) goes to it while it is up, else to the least busy up worker, whatever the depth."""
        if pinned is not None and pinned >= 0 and self.state[pinned] == UP:
            return pinned
        up = [i for i in self.up()
              if self.depth is None or pinned is not None or self.busy[i] < self.depth]
        if not up:
            return None
        self._turn += 1
        return min(up, key=lambda i: (self.busy[i], (i - self._turn) % len(self.actors)))

    def failed(self, i: int) -> None:
        """Worker i failed a call: out of the rotation until a probe answers."""
        if self.state[i] == UP:
            self.failures += 1
        if self.state[i] not in (DEAD, RETIRED):
            self.state[i] = DOWN
            if i not in self.probing:
                self.probe_at.setdefault(i, time.perf_counter() + self.backoff_s)

    def due(self) -> list[int]:
        """Workers whose probe should be sent now (removed from the schedule)."""
        now = time.perf_counter()
        ready = [i for i, t in self.probe_at.items() if t <= now]
        for i in ready:
            del self.probe_at[i]
            self.probing.add(i)
        return ready

    def next_probe_in(self) -> float | None:
        if not self.probe_at:
            return None
        return max(0.0, min(self.probe_at.values()) - time.perf_counter())

    def probe_answered(self, i: int) -> None:
        self.probing.discard(i)
        self.died[i] = 0
        if self.state[i] != RETIRED:
            self.state[i] = UP

    def probe_failed(self, i: int, died: bool) -> None:
        """A probe failed: restarting (try again later) or, `died_probes` times in a row with
        ActorDiedError, dead for good."""
        self.probing.discard(i)
        self.died[i] = self.died[i] + 1 if died else 0
        if self.died[i] >= self.died_probes:
            self.state[i] = DEAD
            return
        self.probe_at[i] = time.perf_counter() + self.backoff_s
