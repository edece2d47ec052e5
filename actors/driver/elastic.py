"""Elastic rollout workers: `rollout.num_workers = "min..max"`.

The run starts `min` rollout workers (actors/driver/cluster.py).  Every step row says how long the
learner waited on that step's student rollouts (`rollout_wait`, a fraction of the step's wall
time; `actors.driver.core.rollout_wait_fraction`).  After each learner step:

    rollout_wait >= rollout.elastic_grow_wait  for rollout.elastic_patience steps in a row
        -> add one worker if fewer than max are alive, none is being added, and the cluster
           has room for its bundle (`ray.available_resources()`); on a cluster joined at an
           address, a bundle that does not fit is asked of the autoscaler instead
           (`ray.autoscaler.sdk.request_resources`, the whole run's bundles) and added once
           a node brings it
    rollout_wait <  rollout.elastic_shrink_wait for rollout.elastic_idle_steps steps in a row
        -> retire one added worker that has nothing in flight (never below min); the
           autoscaler request is lowered to the workers left, and at min a request for
           room that has not come yet is withdrawn the same way (else the autoscaler would
           keep that node, idle, for the rest of the run)

An added worker gets its own one-bundle placement group (`opd_rollout` with
cluster.role_resources), is constructed, and is sent `load_weights` of the current version
before anything else (actor calls run in order); it takes jobs once that load answered.  Jobs
carry their image ids and random keys, so which worker generates a part never changes its
tokens: strict runs still equal the reference loop, and every batch id is still consumed once.

The decisions read the wait from the step's row after the run's `after_step` hook has seen it
(actors/driver/pipeline.py), so a test's hook can set the row's `rollout_wait` and the step that
grows or shrinks the pool follows from the test, not from how fast the machine is.

It works on what it is given: the run's actor groups (placement groups, new workers), the
dispatcher (its rollout pool; it waits on placements) and the weight publisher (a new
worker's first load).
"""
from __future__ import annotations

import logging
import ray

from actors.driver.cluster import fits, joins_cluster, role_bundle, run_bundles
from actors.driver.pool import DEAD, UP
from actors.driver.tasks import Placement
from opd.config.schema import RunConfig
from opd.distill.phases import rolls_out

log = logging.getLogger(__name__)


class ElasticRollout:
    """Grows and shrinks the rollout pool (`dispatch.pools["rollout"]`) between `lo` and `hi`
    workers."""

    def __init__(self, cfg: RunConfig, groups, dispatch, publisher, lo: int, hi: int):
        self.cfg, self.groups, self.dispatch, self.publisher = cfg, groups, dispatch, publisher
        self.lo, self.hi = lo, hi
        self.pool = dispatch.pools["rollout"]
        self.autoscale = joins_cluster(self.cfg)
        self.grow_streak = self.idle_streak = 0
        self.placing: dict[ray.ObjectRef, object] = {}    # pg.ready() -> placement group
        self.added: dict[int, object] = {}                # worker index -> its placement group
        self.retire_wanted = 0
        self.requested = 0                                # rollout workers asked of the autoscaler
        self.events: list[dict] = []                      # {"step", "event", "workers"}
        self.step = -1

    @classmethod
    def for_run(cls, cfg: RunConfig, groups, dispatch, publisher) -> ElasticRollout | None:
        """The policy of an elastic run (None for a fixed pool)."""
        n = cfg.rollout.num_workers
        if not (isinstance(n, tuple) and n[0] < n[1]) or not rolls_out(cfg):
            return None
        return cls(cfg, groups, dispatch, publisher, *n)

    def workers(self) -> int:
        """Workers that are or will be up (starting, up, or restarting after a failure)."""
        return len(self.pool.alive())

    # -- decisions (after every learner step) ------------------------------------------------

    def after_step(self, step: int, row: dict) -> None:
        o = self.cfg.rollout
        self.step = step
        wait = row["rollout_wait"]
        self.grow_streak = self.grow_streak + 1 if wait >= o.elastic_grow_wait else 0
        self.idle_streak = self.idle_streak + 1 if wait < o.elastic_shrink_wait else 0
        n = self.workers()
        if (self.grow_streak >= o.elastic_patience and n < self.hi and not self.placing
                and not self.pool.starting()):
            self._grow(n + 1)
        elif self.idle_streak >= o.elastic_idle_steps:
            if n - self.retire_wanted > self.lo:
                self.retire_wanted += 1
                self.idle_streak = 0
            elif self.autoscale and self.requested > n:
                self._request(n)            # room asked for and no longer wanted: give it back
        self.tick()

    def _grow(self, target: int) -> None:
        need = role_bundle(self.cfg, "rollout")
        if fits(need, ray.available_resources()):
            pg = self.groups.new_group(need)
            ref = pg.ready()
            self.placing[ref] = pg
            self.dispatch.track(ref, Placement())
            self.grow_streak = 0
            self._event("place", target)
        elif self.autoscale and target > self.requested:
            self._request(target)

    def _request(self, target: int) -> None:
        """Ask the autoscaler for the run's bundles with `target` rollout workers."""
        from ray.autoscaler.sdk import request_resources
        try:
            request_resources(bundles=run_bundles(self.cfg, target))
        except Exception as e:  # noqa: BLE001 - a cluster without an autoscaler
            log.warning("request_resources failed: %s", e)
            return
        self.requested = target
        self._event("request", target)

    # -- actions --------------------------------------------------------------------------------

    def placed(self, ref: ray.ObjectRef) -> int:
        """A placement group is ready: start the worker in it and send it the weights; returns
        the worker's index."""
        pg = self.placing.pop(ref)
        i = len(self.pool)
        actor = self.groups.new_rollout_worker(self.cfg, pg, i)
        assert self.pool.add(actor) == i
        self.added[i] = pg
        self.publisher.load(i)
        self._event("add", self.workers(), worker=i)
        return i

    def tick(self) -> None:
        """Retire wanted workers once one of the added ones has nothing in flight; give back
        the placement groups of added workers that died for good."""
        for i, pg in list(self.added.items()):
            if self.pool.state[i] == DEAD:
                del self.added[i]
                self.groups.remove_group(pg)
        self.retire_wanted = min(self.retire_wanted, max(0, self.workers() - self.lo))
        while self.retire_wanted:
            idle = [i for i in self.added if self.pool.state[i] == UP and not self.pool.busy[i]]
            if not idle:
                return
            i = max(idle)
            self.pool.retire(i)
            ray.kill(self.pool.actors[i], no_restart=True)
            self.groups.remove_group(self.added.pop(i))
            self.retire_wanted -= 1
            self._event("retire", self.workers(), worker=i)
            if self.autoscale and self.requested > self.workers():
                self._request(self.workers())

    def close(self) -> None:
        """Withdraw the autoscaler request (nodes may go back once idle)."""
        if self.requested:
            from ray.autoscaler.sdk import request_resources
            try:
                request_resources(bundles=[])
            except Exception:  # noqa: BLE001
                pass
            self.requested = 0

    def summary(self) -> dict:
        return {"min": self.lo, "max": self.hi, "events": self.events,
                "added": sum(e["event"] == "add" for e in self.events),
                "retired": sum(e["event"] == "retire" for e in self.events)}

    def _event(self, event: str, workers: int, **extra) -> None:
        self.events.append({"step": self.step, "event": event, "workers": workers, **extra})
        log.info("elastic rollout: %s (workers %d) after step %d", event, workers, self.step)
