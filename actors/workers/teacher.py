"""`TeacherWorker`: the frozen teacher; scores the pieces of student rollouts, or of a step on
data (built here from the step's job: `score_data`), or (SeqKD) generates teacher rollouts with
the configured engine, streamed piece by piece as the rollout worker's
(actors/workers/rollout.py).  Pieces go to the learner ranks through the trajectory queue
(actors/transport/delivery.py); the driver gets reports only.  Each of the run's teachers
(opd/distill/teachers.py) has its own pool, `opd/teacher/<name>/<i>`, whose workers score that
teacher's share of a piece (routing: the rows of its classes; mixing: every row).

With `rollout.span` a worker scores a rollout call's spans as they come (`score_span`, a KV
cache per row: opd/distill/span_scoring.py) and then the call's pieces from them
(`score_spanned`).  The driver sends one call's spans and pieces to one worker, in order; a
worker that lacks some of a call's spans (it took over from one that failed, or dropped the
call's scorer) scores them from their refs first, so the scores never depend on where they
ran."""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator

import ray
import torch

from actors.transport.delivery import (PartReport, PieceReport, PieceTag, SpanReport,
                                       deliver_share, hand_out, kept_payloads, span_from_payload)
from actors.ray_metrics import RoleMetrics
from actors.workers.base import Worker, actor_name
from actors.workers.heap import release_free_heap
from actors.workers.rollout import job_tokens
from opd.models import precision
from opd.distill.batch import TrajectoryBatch
from opd.config.schema import RunConfig
from opd.models.factory import load_role_model
from opd.distill.span_scoring import PartScoring
from opd.distill.pieces import take_rows
from opd.distill.steps import RolloutJob, build_engine, generate, score
from opd.distill.stream import PartStream
from opd.distill.teachers import Share, run_teachers, score_share


KEPT_CALLS = 8
"""How many rollout calls' span scorings (their KV caches) a teacher worker keeps."""


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
        self.calls: OrderedDict[tuple, PartScoring] = OrderedDict()   # span scorings by call

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
        return self._score(batch, tag, queue, start)

    def score_data(self, job: RolloutJob, rows: tuple[int, int], tag: PieceTag,
                   queue) -> PieceReport:
        """`score` for a piece of a step on data: the piece is `job`'s rows [a, b), their
        suffixes the data's (no model runs), tagged with the step's policy version."""
        start = time.perf_counter()
        batch = take_rows(generate(None, None, self.io.received(job), self.cfg, tag.version),
                          *rows)
        return self._score(batch, tag, queue, start)

    def _score(self, batch: TrajectoryBatch, tag: PieceTag, queue, start: float) -> PieceReport:
        self.version = batch.policy_version
        share = score_share(self.model, batch, self.cfg, self.teacher,
                            self.teachers.share_rows(self.teacher, batch.labels), score)
        del batch
        return self._deliver(share, tag, queue, start)

    def _deliver(self, share: Share, tag: PieceTag, queue, start: float) -> PieceReport:
        """Report a scored share's metrics and deliver it into `queue` (`start`: when the
        scoring call began)."""
        seconds, tokens = share.seconds, share.batch.batch_size * share.batch.seq_len
        self.metrics.report(teacher_seconds=seconds, teacher_tokens=tokens,
                            teacher_tokens_per_s=tokens / seconds if seconds > 0 else 0.0)
        report = deliver_share(share, tag, queue, time.perf_counter() - start)
        self.io.put(report.nbytes)
        del share
        release_free_heap()          # its freed buffers, which glibc would keep (heap.py)
        return report

    def score_span(self, call: tuple, job: RolloutJob, span: dict) -> float:
        """Score the next span (its payload, put by the rollout worker) of rollout call `call`
        ((step, gen, part, issue); `job` its rows and prefix); a span it has, or one after a
        span it lacks, waits for `score_spanned`.  Returns the seconds it took."""
        scoring = self._scoring(call, job)
        if int(span["start"]) != scoring.stop:
            return 0.0
        start = time.perf_counter()
        scoring.score(span_from_payload(self.io.received(span)))
        return time.perf_counter() - start

    def score_spanned(self, call: tuple, job: RolloutJob, spans: list[tuple[int, object]],
                      traj: dict, rows: tuple[int, int], tag: PieceTag, queue) -> PieceReport:
        """Deliver this teacher's share of the piece of call `call`'s rows [a, b) (its trajectory
        `traj`, put by the rollout worker) into `queue`, from the call's scored spans: first
        those of `spans` ((start, ref) of every span of the call, in order) it lacks."""
        start = time.perf_counter()
        scoring = self._scoring(call, job)
        todo = [ref for a, ref in spans if a >= scoring.stop]
        for d in ray.get(todo):
            scoring.score(span_from_payload(self.io.received(d)))
        batch = TrajectoryBatch.from_numpy_dict(self.io.received(traj))
        self.version = batch.policy_version
        share = scoring.share(self.teacher, torch.arange(*rows), batch)
        del batch
        return self._deliver(share, tag, queue, start)

    def _scoring(self, call: tuple, job: RolloutJob) -> PartScoring:
        """The span scoring of rollout call `call` on this worker: the last KEPT_CALLS calls'
        are kept (an older one is scored again from its spans' refs if asked)."""
        scoring = self.calls.get(call)
        if scoring is None:
            scoring = self.calls[call] = PartScoring({self.teacher: self.model}, self.cfg,
                                                     self.teachers, job, only=[self.teacher])
            while len(self.calls) > KEPT_CALLS:
                self.calls.popitem(last=False)
        self.calls.move_to_end(call)
        return scoring

    def generate(self, job: RolloutJob, version: int, tags: list[PieceTag], queue,
                 scored: bool, span: int = 0) -> Iterator[SpanReport | PieceReport | PartReport]:
        """A teacher rollout (source "teacher", SeqKD), tagged with policy version `version`;
        streamed piece by piece (and span by span) as `RolloutWorker.generate`."""
        self.version = version
        self.io.received(job)
        stream = PartStream(self.model, self.engine, job, self.cfg, version,
                            [t.rows for t in tags], span)
        for made in hand_out(stream, tags, queue, scored, self.io, self.kept):
            if isinstance(made, PartReport):
                seconds, tokens = made.seconds, job_tokens(job)
                self.metrics.report(rollout_seconds=seconds, rollout_tokens=tokens,
                                    rollout_tokens_per_s=tokens / seconds if seconds > 0 else 0.0)
                release_free_heap()
            yield made
