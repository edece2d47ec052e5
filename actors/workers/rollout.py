"""`RolloutWorker`: a student copy in eval mode plus the configured engine (HB-SJD by default).

Strict about versions: `generate(job, version, ...)` runs only if the worker holds exactly that
policy version (loaded by `load_weights` or received by `receive_weights`), else it raises
`StaleWeightsError`.  It is a Ray streaming generator (called with `num_returns="streaming"`):
one engine call over the part's rows hands out each piece as soon as its rows are complete,
into the object store from here (this worker owns it), whole for a teacher worker to score or
delivered to the trajectory queue (actors/transport/delivery.py), while the other rows go on
decoding; the driver gets a `PieceReport` per piece, then the call's `PartReport`.  If this
worker dies, what it owns is lost and the driver makes those pieces again.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

from actors.transport.delivery import (PartReport, PieceReport, PieceTag, SpanReport, hand_out,
                                       kept_payloads)
from actors.transport.weights import BroadcastGroup, Bucket
from actors.workers.base import Worker
from opd.models import precision
from opd.run.calibration import prepare_calibration, rollout_batch_sizes
from opd.config.schema import RunConfig
from opd.models import create_model
from opd.models.factory import model_overrides
from opd.distill.steps import RolloutJob, build_engine
from opd.distill.stream import PartStream


class StaleWeightsError(RuntimeError):
    """A rollout was asked for a policy version the worker does not hold."""


def job_tokens(job: RolloutJob) -> int:
    return int(job.labels.shape[0]) * (int(job.tokens.shape[1]) - job.prefix_len)


class RolloutWorker(Worker):
    """One rollout worker (`load_weights`, `info`, `io_stats`: actors/workers/base.py)."""
    role = "rollout"

    def __init__(self, cfg: RunConfig | dict, index: int = 0):
        super().__init__(cfg, index)
        self.model = precision.to_role(create_model(self.cfg.model.student, **model_overrides(self.cfg)),
                                       self.cfg, "rollout", self.device)
        self.engine = build_engine(self.cfg)
        self.kept = kept_payloads()           # what its calls put, held: delivery.py
        self.broadcast: tuple[BroadcastGroup, list[Bucket]] | None = None
        # gamma=auto: every sub-batch size of the run, measured once by the first worker
        prepare_calibration(self.model, self.cfg, rollout_batch_sizes(self.cfg))

    def join_broadcast(self, host: str, port: int, rank: int, size: int, backend: str,
                       buckets: list[Bucket]) -> bool:
        """Become member `rank` of the collective weight-broadcast group."""
        self.broadcast = (BroadcastGroup(host, port, rank, size, backend), buckets)
        return True

    def receive_weights(self, version: int) -> float:
        """Receive `version` from the broadcast group (learner rank 0 sends at the same time)."""
        if self.broadcast is None:
            raise RuntimeError("receive_weights before join_broadcast")
        start = time.perf_counter()
        group, buckets = self.broadcast
        self.version = None
        group.receive(self.model, buckets)
        self.version = int(version)
        return time.perf_counter() - start

    def generate(self, job: RolloutJob, version: int, tags: list[PieceTag], queue,
                 scored: bool, span: int = 0) -> Iterator[SpanReport | PieceReport | PartReport]:
        """The trajectory of `job` (one part) by the student of `version`, piece by piece as
        its rows complete (`tags`: the part's pieces, in order): each put whole for a teacher to
        score (`scored`), else delivered into `queue`; with `span` S > 0 also every S positions
        of every row as they are committed; then the part's report
        (actors/transport/delivery.py `hand_out`)."""
        if self.version != version:
            raise StaleWeightsError(f"rollout worker {self.index} holds policy version {self.version}, "
                                    f"asked to generate batch {job.batch_id} at version {version}")
        self.io.received(job)
        stream = PartStream(self.model, self.engine, job, self.cfg, version,
                            [t.rows for t in tags], span)
        for made in hand_out(stream, tags, queue, scored, self.io, self.kept):
            if isinstance(made, PartReport):
                self._report(made, job_tokens(job))
            yield made

    def _report(self, made: PartReport, tokens: int) -> None:
        """The rollout call's metrics (actors/ray_metrics.py)."""
        s, seconds = made.stats, made.seconds
        self.metrics.report(rollout_seconds=seconds, rollout_tokens=tokens,
                            rollout_tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
                            rollout_rounds=s.rounds, rollout_mean_committed=s.mean_committed,
                            rollout_longest_single_run=s.longest_single_run,
                            rollout_image_rounds_max=s.image_rounds_max)
        for k, count in enumerate(s.commit_hist or []):        # acceptance lengths
            for _ in range(count):
                self.metrics.observe("opd_rollout_commit_length", k + 1)
        for k, count in enumerate(s.window_hist or []):        # the window of each round
            for _ in range(count):
                self.metrics.observe("opd_rollout_window", k + 1)
        for r in s.image_rounds:
            self.metrics.observe("opd_rollout_image_rounds", r)
