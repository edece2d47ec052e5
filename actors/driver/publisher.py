"""`WeightPublisher`: makes a policy version the weights rollout workers generate with.

Object store (the default): learner rank 0 makes one tagged payload object and counts its
bytes where it is made; the driver waits for the count only and passes the payload's ref on to
each rollout worker's `load_weights`, submitted before any later job (actor calls run in
order), so it never fetches the weights.  Collective (`learner.weight_sync=collective`): rank 0
broadcasts to the rollout workers' group; a member that dies ends the group and the weights go
through the object store from then on.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayActorError

from actors.driver.group import fan_out
from actors.driver.tasks import WeightsLoad
from actors.transport.weights import PublishedWeights

BROADCAST_GRACE_S = 60.0


@dataclass
class Sync:
    """One publish: its version, when it began, the loads not answered yet, bytes, seconds."""
    version: int
    start: float = field(default_factory=time.perf_counter)
    pending: set = field(default_factory=set)
    bytes: int = 0
    seconds: float = 0.0


class WeightPublisher:
    def __init__(self, cfg, groups, dispatch, metrics, records):
        """Loads are tracked by `dispatch`; a learner call that fails raises
        `records.learner_failure(...)` (actors/driver/records.py)."""
        self.groups, self.dispatch, self.metrics, self.records = groups, dispatch, metrics, records
        self.pool = dispatch.pools["rollout"]
        self.collective = cfg.learner.weight_sync == "collective"
        self.published: PublishedWeights | None = None
        self.sync: Sync | None = None             # the publish in progress
        self.last_sync = Sync(-1)

    def publish(self, version: int) -> None:
        if not self.groups.rollout:              # no phase samples the student: nobody to send to
            self.published = PublishedWeights(version, None)
            return
        self.sync = Sync(version)
        if self.collective and self._broadcast(version):
            self.published = PublishedWeights(version, None, self.sync.bytes)
            self._sync_done()
            return
        ref, nbytes = self._weights_from_learners(version)
        self.sync.bytes = nbytes
        self.published = PublishedWeights(version, ref, nbytes, time.perf_counter() - self.sync.start)
        for i in self.pool.loadable():
            self.sync.pending.add(self.load(i))
        if not self.sync.pending:
            self._sync_done()

    def load(self, i: int) -> ray.ObjectRef:
        """Send rollout worker i the published weights (before any job it gets)."""
        ref = self.groups.rollout[i].load_weights.remote(self.published.version, self.published.ref)
        self.dispatch.track(ref, WeightsLoad(role="rollout", worker=i,
                                             version=self.published.version))
        return ref

    def loaded(self, ref: ray.ObjectRef) -> None:
        """A load answered (or failed): the publish is done when every load has."""
        if self.sync is not None and ref in self.sync.pending:
            self.sync.pending.discard(ref)
            if not self.sync.pending:
                self._sync_done()

    def fall_back_to_object_store(self) -> None:
        """A broadcast group cannot re-admit a restarted member: object-store weights from now on."""
        if not self.collective:
            return
        self.collective = False
        self.groups.learners[0].leave_broadcast.remote()
        ref, nbytes = self._weights_from_learners(self.published.version)
        self.published = PublishedWeights(self.published.version, ref, nbytes)

    def _sync_done(self) -> None:
        s, self.sync = self.sync, None
        s.seconds = time.perf_counter() - s.start
        self.last_sync = s
        self.metrics.report(weight_sync_seconds=s.seconds, weight_sync_bytes=s.bytes,
                            policy_version=s.version)

    def _weights_from_learners(self, version: int) -> tuple[ray.ObjectRef, int]:
        """The ref of `version`'s weights payload (made by learner rank 0; every rank takes part,
        ZeRO-3 gathers) and its size in bytes, counted by the learner."""
        calls = fan_out(self.groups.learners, "publish_weights", version)   # [payload, nbytes]
        try:
            nbytes = ray.get([size for _, size in calls])[0]
        except RayActorError as e:
            raise self.records.learner_failure("weights", version, e) from e
        return calls[0][0], int(nbytes)

    def _broadcast(self, version: int) -> bool:
        """Send `version` through the broadcast group; False if a member had died (the group
        is then given up: receivers that did not finish are restarted, the weights go through
        the object store from now on)."""
        rollout = self.groups.rollout
        sends = fan_out(self.groups.learners, "send_weights", version)
        receives = {i: rollout[i].receive_weights.remote(version) for i in self.pool.up()}
        try:
            self.sync.bytes = ray.get(sends)[0]
            ok = True
        except RayActorError as e:
            raise self.records.learner_failure("weight broadcast", version, e) from e
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
                    ray.kill(rollout[i], no_restart=False)
                self.pool.failed(i)
        if not ok:
            self.collective = False
            ray.get(self.groups.learners[0].leave_broadcast.remote())
        return ok
