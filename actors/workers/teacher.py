"""`TeacherWorker`: the frozen teacher; scores the pieces of student rollouts, or (SeqKD)
generates teacher rollouts with the configured engine, streamed piece by piece as the rollout
worker's (actors/workers/rollout.py).  Pieces go to the learner ranks through the trajectory queue
(actors/transport/delivery.py); the driver gets reports only.  Each of the run's teachers
(opd/distill/teachers.py) has its own pool, `opd/teacher/<name>/<i>`, whose workers score that
teacher's share of a piece (routing: the rows of its classes; mixing, or one teacher: every
row)."""
from __future__ import annotations

import time
from collections.abc import Iterator

from actors.transport.delivery import (PartReport, PieceReport, PieceTag, deliver_share, hand_out,
                                       kept_payloads)
from actors.ray_metrics import RoleMetrics
from actors.workers.base import Worker, actor_name
from actors.workers.heap import release_free_heap
from actors.workers.rollout import job_tokens
from opd.models import precision
from opd.distill.batch import TrajectoryBatch
from opd.config.schema import RunConfig
from opd.models.factory import load_role_model
from opd.distill.steps import RolloutJob, build_engine, score
from opd.distill.stream import PartStream
from opd.distill.teachers import run_teachers, score_share


class TeacherWorker(Worker):
    """One teacher worker (`info`, `io_stats`: actors/workers/base.py); `version` is the policy
    version of the last trajectory it handled."""
    role = "teacher"

    def __init__(self, cfg: RunConfig | dict, index: int = 0, teacher: int = 0):
        self.teacher = teacher                        # its entry of cfg.teachers
        super().__init__(cfg, index)
        self.teachers = run_teachers(self.cfg)
        self.metrics = RoleMetrics("teacher", f"{self.teachers.names[teacher]}/{index}")
        entry = self.teachers.entries[teacher]
        self.model = precision.to_role(
            load_role_model(self.cfg, "teacher", teacher=entry, progress=False), self.cfg,
            "teacher", self.device)
        self.engine = build_engine(self.cfg)
        self.kept = kept_payloads()           # what its rollout calls put: delivery.py

    def section(self):
        """Its teacher's entry of cfg.teachers."""
        return self.cfg.teachers[self.teacher]

    @property
    def name(self) -> str:
        return actor_name(self.teachers.pool(self.teacher), self.index)

    def score(self, traj: dict, tag: PieceTag, queue) -> PieceReport:
        """Attach teacher scores (full or top-k, as `teacher.transport` says) to one piece
        (`to_numpy_dict()`, put by the worker that made it) and deliver it into `queue` as the
        learner ranks' rows."""
        start = time.perf_counter()
        batch = TrajectoryBatch.from_numpy_dict(self.io.received(traj))
        self.version = batch.policy_version
        share = score_share(self.model, batch, self.cfg, self.teacher,
                            self.teachers.share_rows(self.teacher, batch.labels), score)
        out, seconds = share.batch, share.seconds
        tokens = out.batch_size * out.seq_len
        self.metrics.report(teacher_seconds=seconds, teacher_tokens=tokens,
                            teacher_tokens_per_s=tokens / seconds if seconds > 0 else 0.0)
        report = deliver_share(share, tag, queue, time.perf_counter() - start)
        self.io.put(report.nbytes)
        del batch, out
        release_free_heap()          # its freed buffers, which glibc would keep (heap.py)
        return report

    def generate(self, job: RolloutJob, version: int, tags: list[PieceTag], queue,
                 scored: bool) -> Iterator[PieceReport | PartReport]:
        """A teacher rollout (source "teacher", SeqKD), tagged with policy version `version`;
        streamed piece by piece as `RolloutWorker.generate`."""
        self.version = version
        self.io.received(job)
        stream = PartStream(self.model, self.engine, job, self.cfg, version, [t.rows for t in tags])
        for made in hand_out(stream, tags, queue, scored, self.io, self.kept):
            if isinstance(made, PartReport):
                seconds, tokens = made.seconds, job_tokens(job)
                self.metrics.report(rollout_seconds=seconds, rollout_tokens=tokens,
                                    rollout_tokens_per_s=tokens / seconds if seconds > 0 else 0.0)
                release_free_heap()
            yield made
