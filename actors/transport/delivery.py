"""Handing a step's pieces from the worker that made them to the learner ranks that train on them.

A rollout call ("part") streams its pieces (opd/distill/stream.py); each piece goes on as soon as
its rows are complete: put whole into the object store for a teacher worker to score
(`put_payload`), or, when the objective needs no scores, delivered straight into the trajectory
queue (`deliver`).  Delivering cuts a piece into one object per learner rank — rank r's rows
`PieceTag.cuts[r]` — put by the worker that delivers it (it owns them) and handed to the queue as
refs; each rank fetches only its own rows.  With `rollout.span` a call also puts each position
span as it comes (`put_span`), which the teacher workers score while the call runs.  The driver
gets reports only (`SpanReport`, `PieceReport` for a piece, `PartReport` at the end of a call):
counts, statistics and refs, never a payload.  If a
worker dies, what it owns is lost; the driver makes those pieces again.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import ray
import torch

from actors.transport.iostats import payload_nbytes
from opd.distill.batch import TrajectoryBatch
from opd.distill.pieces import take_rows
from opd.distill.rollout_stats import RolloutStats
from opd.distill.stream import PartStream
from opd.distill.teachers import Share, ShareMeasure, cut_share, share_to_numpy
from rollout.spans import Span


@dataclass(frozen=True)
class PieceTag:
    """Where a piece goes: its step, plan generation, piece index in the step, each learner
    rank's [a, b) rows of it, and the policy version of its trajectories."""
    step: int
    gen: int
    piece: int
    cuts: tuple[tuple[int, int], ...]
    version: int = -1

    @property
    def rows(self) -> int:
        """The piece's rows (the ranks' cuts cover them in order)."""
        return self.cuts[-1][1]


@dataclass
class PieceReport:
    """A piece made (to score: `payload`, the ref of the whole piece, owned by the worker that put
    it) or delivered into the queue (`nbytes` put for the ranks)."""
    piece: int
    rows: int
    generated_tokens: int
    nbytes: int = 0
    seconds: float = 0.0              # the worker's busy time on it (scoring)
    payload: object = None
    measure: ShareMeasure | None = None   # a teacher's share: what scoring it measured


@dataclass
class PartReport:
    """The end of a rollout call: its rows, generated tokens, rollout statistics and the
    worker's busy seconds (the engine's)."""
    rows: int
    generated_tokens: int
    stats: RolloutStats
    seconds: float = 0.0


@dataclass
class SpanReport:
    """Span `index` of a rollout call (rollout/spans.py: every row's tokens [start, stop)),
    put whole for the teacher workers that score it as it comes (`payload`: its ref, owned by
    the worker that put it); `midway`: the call still had rounds to run."""
    index: int
    start: int
    stop: int
    midway: bool
    payload: object = None
    nbytes: int = 0


def put_span(span: Span, index: int) -> SpanReport:
    payload = {"start": span.start, "stop": span.stop, "midway": span.midway,
               "tokens": span.tokens.numpy(), "logprobs": span.logprobs.numpy()}
    return SpanReport(index, span.start, span.stop, span.midway, ray.put(payload),
                      payload_nbytes(payload))


def span_from_payload(d: dict) -> Span:
    return Span(int(d["start"]), int(d["stop"]), torch.from_numpy(d["tokens"]),
                torch.from_numpy(d["logprobs"]), bool(d["midway"]))


def put_payload(batch: TrajectoryBatch, piece: int) -> PieceReport:
    """A piece that a teacher worker scores next: one object owned by this worker."""
    payload = batch.to_numpy_dict()
    return PieceReport(piece, batch.batch_size, batch.num_generated_tokens,
                       payload_nbytes(payload), payload=ray.put(payload))


def deliver(batch: TrajectoryBatch, tag: PieceTag, queue, seconds: float = 0.0) -> PieceReport:
    """Cut `batch` (one piece) into its learner ranks' rows, put them and hand them to `queue`."""
    refs, nbytes = [], 0
    for a, b in tag.cuts:
        rows = take_rows(batch, a, b)
        rows.rollout_stats = RolloutStats()     # the driver has them from the part's report
        payload = rows.to_numpy_dict()
        nbytes += payload_nbytes(payload)
        refs.append(ray.put(payload))
    ray.get(queue.put_piece.remote(tag.step, tag.gen, tag.piece, refs, tag.version))
    return PieceReport(tag.piece, batch.batch_size, batch.num_generated_tokens, nbytes, seconds)


def deliver_share(share: Share, tag: PieceTag, queue, seconds: float) -> PieceReport:
    """Deliver one teacher's share of a piece (opd/distill/teachers.py): each
    learner rank's rows of it, with their positions in the rank's cut, as one object per rank,
    handed to `queue` as that teacher's share of the piece."""
    refs, nbytes = [], 0
    for a, b in tag.cuts:
        cut = cut_share(share, a, b)
        cut.batch.rollout_stats = RolloutStats()
        payload = share_to_numpy(cut)
        nbytes += payload_nbytes(payload)
        refs.append(ray.put(payload))
    ray.get(queue.put_piece.remote(tag.step, tag.gen, tag.piece, refs, tag.version,
                                   share.teacher))
    b = share.batch
    return PieceReport(tag.piece, b.batch_size, b.num_generated_tokens, nbytes, seconds,
                       measure=share.measure())


KEPT_CALLS = 4
"""How many of its last rollout calls' payloads a worker holds (`kept_payloads`)."""


def kept_payloads() -> deque[list]:
    """A worker's hold on the payloads its last `KEPT_CALLS` rollout calls put, one list of refs
    per call (`hand_out(..., kept=)`).  Ray can free an object that a worker put and yielded
    inside a streaming generator's item as soon as the worker drops its own reference, before
    the driver that got the item has registered as a borrower (ray-project/ray#58080): the
    scoring then fails with ReferenceCountingAssertionError and the call is made again (in 7
    of 24 runs of 40 on-policy steps here, with no worker failing; docs/RELIABILITY.md).  Held
    by the worker that put them, they live until the calls after them, long after their
    scorings fetched them."""
    return deque(maxlen=KEPT_CALLS)


def hand_out(stream: PartStream, tags: list[PieceTag], queue, scored: bool,
             io, kept: deque[list] | None = None
             ) -> Iterator[SpanReport | PieceReport | PartReport]:
    """Run a rollout call and hand out each of its pieces as it completes (`tags`: the part's
    pieces, in order): put whole for a teacher to score (`scored`), else delivered into `queue`;
    a stream by span also puts each span as it comes (`SpanReport`, in order); then the call's
    `PartReport`.  Bytes put are counted by `io` (IOCounter); the payloads put
    are held in `kept` (`kept_payloads`) by a worker that yields them."""
    rows = tokens = 0
    refs: list = []
    if kept is not None:
        kept.append(refs)
    spans = 0
    for piece in stream:
        if isinstance(piece, Span):
            span = put_span(piece, spans)
            spans += 1
            refs.append(span.payload)
            io.put(span.nbytes)
            yield span
            continue
        tag = tags[piece.index]
        made = put_payload(piece.batch, tag.piece) if scored else deliver(piece.batch, tag, queue)
        if made.payload is not None:
            refs.append(made.payload)
        io.put(made.nbytes)
        rows, tokens = rows + made.rows, tokens + made.generated_tokens
        yield made
    stats = stream.stats
    yield PartReport(rows, tokens, stats, float(stats.rollout_seconds))
