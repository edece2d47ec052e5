"""One planned step's life as a state machine: `Step` owns the step's plan and everything known
of it, takes the events of its tasks and returns the commands the pipeline carries out
(actors/driver/pipeline.py).  Nothing else changes a step; no Ray here, so every path is
unit-tested with made-up events (tests/actors/test_step.py).  Its place in its life is one field,
`phase` (`StepPhase`: PLANNED, GENERATING, STREAMING, SEALED, TRAINING, DONE), changed only by
`_enter` against the table of legal transitions (progress.py `NEXT`); its events, commands and
phases are drawn in docs/ARCHITECTURE.md ("A step's life on Ray").

Its batch is made in parts (rollout calls: `part` numbers one) that stream its pieces (`piece`,
opd/distill/pieces.py); answers of an earlier issue of a part (`issues[part]`: a call that died
and was issued again) are dropped, so nothing is counted twice.
"""
from __future__ import annotations

import time

from actors.driver.commands import (Command, Generate, HandOut, Replan, Score, ScoreSpan, Seal,
                                     Trainable, Trained)
from actors.driver.progress import PieceState, StepPhase, Training, check_transition
from actors.driver.spans import CallSpans
from actors.driver.tasks import StageTimer
from actors.transport.delivery import PartReport, PieceReport, SpanReport
from opd.distill.pieces import Layout
from opd.distill.results import PieceAnswer
from opd.distill.rollout_stats import RolloutStats
from opd.distill.steps import RolloutJob
from opd.distill.teachers import Teachers


class Step:
    """Step `step`'s prefix batch `batch_id` from `source` at policy `version`, generated as
    `jobs` (one per part of `layout`), scored when `scored`; `gen` its plan generation."""

    def __init__(self, step: int, batch_id: int, source: str, version: int,
                 jobs: list[RolloutJob], layout: Layout, *, gen: int, scored: bool,
                 schedule: str, teachers: Teachers | None = None, span: int = 0):
        self.step, self.batch_id, self.source = step, batch_id, source
        self.jobs, self.layout, self.scored = jobs, layout, scored
        self.schedule = schedule                       # the name of its schedule phase
        self.phase = StepPhase.PLANNED                 # its place in its life: `_enter`
        self.version, self.gen = version, gen
        self.issues = [0] * len(jobs)                  # part -> its current issue
        self.generating: set[int] = set()              # parts with a call in flight
        self.ended: dict[int, PartReport] = {}         # part -> the report of its call's end
        self.scorers = ([(0,)] * layout.pieces if teachers is None else
                        teachers.piece_scorers([j.labels for j in jobs], layout))
        self.span = span if scored and source != "data" else 0     # rollout.span
        self.spans = CallSpans(jobs, self.span) if self.span else None
        self.pieces = [PieceState(s) for s in self.scorers]
        self.training: Training | None = None          # the learner's work, once it began
        self.times = StageTimer()
        self.origin: int | None = None                 # reusing the rollout of this step

    @classmethod
    def reusing(cls, origin: Step, step: int, *, gen: int, schedule: str) -> Step:
        """Step `step` on the buffered rollout of trained step `origin` (opd/distill/reuse.py):
        its pieces delivered and sealed; the learner ranks hold their rows, so it only trains."""
        s = cls(step, origin.batch_id, origin.source, origin.version, origin.jobs, origin.layout,
                gen=gen, scored=origin.scored, schedule=schedule)
        s.origin, s.ended, s.pieces = origin.step, dict(origin.ended), origin.pieces
        s._enter(StepPhase.SEALED)
        return s

    def _enter(self, phase: StepPhase) -> None:
        """Go to `phase`: raises `IllegalTransition` unless `NEXT` leads there from its own."""
        self.phase = check_transition(self.step, self.phase, phase)

    # -- what it is ------------------------------------------------------------------------------

    @property
    def parts(self) -> int:
        return len(self.jobs)

    @property
    def samples(self) -> int:
        return sum(int(j.labels.shape[0]) for j in self.jobs)

    @property
    def complete(self) -> bool:
        """Every piece is delivered into the queue."""
        return all(p.delivered is not None for p in self.pieces)

    @property
    def sealed(self) -> bool:
        return self.phase >= StepPhase.SEALED

    @property
    def sealable(self) -> bool:
        return self.complete and not self.sealed

    @property
    def trains(self) -> bool:
        """The learner group is on it (`begin_training`) and it is not done."""
        return self.phase in (StepPhase.STREAMING, StepPhase.TRAINING)

    def version_at(self, published: int) -> int:
        """The version its trajectories can be made at now: a student rollout's is the
        published one (rollout workers hold only that); other sources' are their step's own."""
        return published if self.source == "student" else self.version

    def streamable(self, published: int) -> bool:
        """Whether the learner may train on it piece by piece as pieces arrive: only if a piece
        lost on the way can be made again exactly as it was (`version_at`).  Otherwise it
        trains once sealed, and a piece lost then re-plans it."""
        return self.version == self.version_at(published)

    # -- generation -----------------------------------------------------------------------------

    def start(self) -> list[Command]:
        if self.origin is not None:                    # a reused rollout: nothing to make
            return [Trainable()]
        self._enter(StepPhase.GENERATING)
        return self._make()

    def _make(self) -> list[Command]:
        if self.source == "data":
            return self._from_data()
        self.times.begin("rollout", time.perf_counter())
        return [self._generate(c) for c in range(self.parts)]

    def _from_data(self) -> list[Command]:
        """A step on data runs no rollout call: its parts end as they begin (their suffixes are
        the data's), and each piece is built from its part's job by the teacher worker that
        scores it -> Score(piece, teacher) for every share."""
        out: list[Command] = []
        for c, job in enumerate(self.jobs):
            self.ended[c] = self._unreported(c)
            for p in self.layout.parts[c]:
                ps, rows = self.pieces[p], self.layout.sizes[p]
                ps.made, ps.issue = PieceReport(p, rows, rows * job.suffix_len), self.issues[c]
                out += self._unscored(p)
        return out

    def _unreported(self, part: int) -> PartReport:
        """The end of `part` known without its call's report: its rows and tokens, no stats."""
        rows = int(self.jobs[part].labels.shape[0])
        return PartReport(rows, rows * self.jobs[part].suffix_len, RolloutStats())

    def replanned(self, version: int, gen: int) -> list[Command]:
        """Everything again at `version`, as generation `gen`: GENERATING again (`start`), and
        the learner group, if it was on it, stops (a prefetching step that lost a piece)."""
        self._enter(StepPhase.GENERATING)              # raises before anything changes
        self.version, self.gen, self.training = version, gen, None
        self.generating.clear()
        self.ended.clear()
        self.pieces = [PieceState(s) for s in self.scorers]
        self.spans = CallSpans(self.jobs, self.span) if self.span else None
        return self._make()

    def _generate(self, part: int) -> Generate:
        """Issue `part` again: its pieces not delivered yet wait for the new call's payloads."""
        self.issues[part] += 1
        self.generating.add(part)
        self.ended.pop(part, None)
        for p in self.layout.parts[part]:
            if self.pieces[p].delivered is None:
                self.pieces[p].made = None
        return Generate(part, self.issues[part])

    def piece_made(self, part: int, issue: int, report: PieceReport) -> list[Command]:
        """Issue `issue` of `part` handed out piece `report.piece`: score it, or (no scores
        needed) the worker delivered it."""
        ps = self.pieces[report.piece]
        if issue != self.issues[part] or ps.delivered is not None:
            return []                                  # an earlier issue's, or delivered already
        ps.made, ps.issue = report, issue
        if not self.scored:
            return self._delivered(report.piece, report)
        return self._unscored(report.piece)

    def _unscored(self, piece: int) -> list[Command]:
        """Score the shares of `piece` not scored yet: a share scored, or being scored from an
        earlier payload (if that one is lost, score_lost scores this one), is not scored again."""
        ps = self.pieces[piece]
        return self._scores(piece, [t for t in ps.scorers
                                    if t not in ps.scored and t not in ps.scoring])

    def span_made(self, part: int, issue: int, report: SpanReport) -> list[Command]:
        """Issue `issue` of `part` handed out its next span: the teachers of the call's rows
        score it now; once the call's spans are all in, its pieces made so far are scored."""
        if self.spans is None or issue != self.issues[part] or not self.spans.add(part, issue,
                                                                                 report):
            return []
        self.times.begin("teacher", time.perf_counter())
        teachers = sorted({t for p in self.layout.parts[part] for t in self.pieces[p].scorers})
        out: list[Command] = [ScoreSpan(part, issue, t, report.index) for t in teachers]
        for p in self.layout.parts[part]:
            ps = self.pieces[p]
            if ps.made is not None and ps.delivered is None and ps.issue == issue:
                out += self._unscored(p)
        return out

    def span_scored(self, part: int, issue: int, span: int, seconds: float) -> None:
        """A teacher scored span `span` of issue `issue` of `part` in `seconds`."""
        if self.spans is not None and (part, issue) in self.spans.made:
            self.times.busy["teacher"] += seconds
            self.spans.scored(part, issue, span, seconds)

    def part_made(self, part: int, issue: int, report: PartReport, busy: float) -> list[Command]:
        """Issue `issue` of `part` ended (`busy`: seconds from its submission to its end; the
        worker's own, `report.seconds`, count when it measured them) -> Trained, if it was the
        last report the trained step waited for (its row reads every call's: `_done`)."""
        if issue != self.issues[part] or part in self.ended:
            return []
        self.generating.discard(part)
        self.ended[part] = report
        self.times.busy["rollout"] += report.seconds or busy
        if len(self.ended) == self.parts:
            self.times.end("rollout", time.perf_counter())
        return self._done()

    def part_failed(self, part: int, issue: int, published: int) -> list[Command]:
        """Issue `issue` of `part` failed (its worker died, or held other weights).  A call that
        cannot be made again at its version (`streamable`) re-plans the whole step; the call of
        a step trained already (`_done` waits for its report) ends without its statistics."""
        if issue != self.issues[part]:
            return []                                  # issued again since
        self.generating.discard(part)
        if self.training is not None and self.training.results is not None:
            return self.part_made(part, issue, self._unreported(part), 0.0)  # its stats lost
        if not self.streamable(published):
            return [Replan()]
        return [self._generate(part)]

    # -- scoring --------------------------------------------------------------------------------

    def _scores(self, piece: int, teachers: list[int]) -> list[Command]:
        """Score these teachers' shares of `piece`; with spans, only once every span of the
        call that made its payload is in (`span_made` scores it then)."""
        ps = self.pieces[piece]
        if self.spans is not None and not self.spans.complete(self.layout.part_of(piece),
                                                              ps.issue):
            return []
        return [self._score(piece, t) for t in teachers]

    def _score(self, piece: int, teacher: int) -> Score:
        ps = self.pieces[piece]
        ps.scoring[teacher] = ps.issue
        self.times.begin("teacher", time.perf_counter())
        return Score(piece, ps.issue, teacher)

    def piece_scored(self, piece: int, report: PieceReport, busy: float,
                     teacher: int = 0) -> list[Command]:
        """`teacher` scored its share of `piece` and delivered it into the queue; the piece is
        delivered with its last share, its report the shares' merged (one share or several:
        the piece's rows and tokens from the layout, the shares' bytes and seconds summed)."""
        ps = self.pieces[piece]
        ps.scoring.pop(teacher, None)
        if ps.delivered is not None or teacher in ps.scored:
            return []
        ps.scored[teacher] = report
        self.times.busy["teacher"] += report.seconds or busy
        if len(ps.scored) < len(ps.scorers):
            return []
        job = self.jobs[self.layout.part_of(piece)]
        return self._delivered(piece, ps.merged(piece, self.layout.sizes[piece], job.suffix_len))

    def _delivered(self, piece: int, report: PieceReport) -> list[Command]:
        """`piece` is in the queue -> HandOut for what the learner ranks can train now (the
        step trains), or Trainable (its first piece); and Seal with the step's last piece."""
        ps = self.pieces[piece]
        if ps.delivered is not None:
            return []
        ps.delivered = report
        if self.scored and self.complete:
            self.times.end("teacher", time.perf_counter())
        out: list[Command] = (self.hand_out() if self.trains else
                              [Trainable()] if piece == 0 else [])
        return out + [Seal()] if self.sealable else out

    def score_due(self, piece: int, issue: int, teacher: int = 0) -> list[Command]:
        """A scoring that waited for a free worker of `teacher`'s pool (issued for the payload
        of issue `issue`) is due: score the piece's latest payload, or nothing when the share is
        in, or the piece's call was issued again since (its new payload is scored when made)."""
        if self.pieces[piece].scoring.get(teacher) != issue:
            return []
        return self.score_failed(piece, teacher)       # the same: again, if still needed

    def score_failed(self, piece: int, teacher: int = 0) -> list[Command]:
        """The worker of `teacher`'s pool scoring `piece` failed: score that share again (its
        payload lives on); the other teachers' shares stand."""
        ps = self.pieces[piece]
        ps.scoring.pop(teacher, None)
        if ps.delivered is not None or teacher in ps.scored or ps.made is None:
            return []                                  # delivered, or being made again
        return self._scores(piece, [teacher])

    def score_lost(self, piece: int, issue: int, teacher: int = 0) -> list[Command]:
        """The payload of `piece` from issue `issue` of its part was lost with the rollout
        worker that owned it, while `teacher` scored it: score a newer payload, wait for the
        call making it again, or issue the part again (shares scored already stand: a part
        makes the same rows again).  A piece of a step on data is built from its job again."""
        ps = self.pieces[piece]
        ps.scoring.pop(teacher, None)
        if ps.delivered is not None or teacher in ps.scored:
            return []
        if ps.made is not None and (ps.issue > issue or self.source == "data"):
            return self._scores(piece, [teacher])
        ps.made = None
        return self._remake(self.layout.part_of(piece), issue)

    # -- the queue and the learner ---------------------------------------------------------------

    def seal(self) -> list[Command]:
        """The queue holds the step's pieces as one item -> HandOut of its last piece (the step
        trains), or Trainable."""
        if self.phase is StepPhase.STREAMING:
            self._enter(StepPhase.TRAINING)
            return self.hand_out()
        self._enter(StepPhase.SEALED)
        return [Trainable()]

    def begin_training(self, published: int) -> Training | None:
        """The learner group starts on this step: as soon as its first piece is delivered if it
        is `streamable`, else once it is sealed (None: not yet)."""
        stream = self.streamable(published)
        if self.phase is StepPhase.SEALED:
            self._enter(StepPhase.TRAINING)
        elif stream and self.phase is StepPhase.GENERATING and self.pieces[0].delivered is not None:
            self._enter(StepPhase.STREAMING)
        else:
            return None
        self.training = Training(self.gen, prefetch=not stream)
        return self.training

    def hand_out(self) -> list[Command]:
        """The pieces to hand to the learner ranks now, in piece order up to the first missing
        one; the last only once the step is sealed (taking it hands the step out of the queue)."""
        t, out = self.training, []
        P = self.layout.pieces
        while t.submitted < P:
            p = t.submitted
            if self.pieces[p].delivered is None or (p == P - 1 and not self.sealed):
                break
            t.submitted += 1
            t.handed[p] = t.handed.get(p, 0) + 1
            out.append(HandOut(p, t.handed[p], t.prefetch))
        return out

    def piece_trained(self, piece: int, handing: int, rank: int, answer: PieceAnswer,
                      ranks: int) -> list[Command]:
        """Learner rank `rank` answered the `handing`-th hand-out of `piece`."""
        t = self.training
        if t is None or handing != t.handed.get(piece):
            return []                                  # an answer to an earlier hand-out
        answers = t.answers.setdefault(piece, {})
        answers[rank] = answer
        if len(answers) < ranks:
            return []
        del t.answers[piece]
        first = answers[0]
        if first.skipped:                              # handed after a lost piece: again later
            return []
        if first.lost:
            return self._lost(piece, {k for a in answers.values() for k in a.lost_at})
        if piece == self.layout.pieces - 1:
            t.results = [answers[r].result for r in range(ranks)]
            return self._done()
        return []

    def _done(self) -> list[Command]:
        """DONE -> Trained, once every rank answered the last piece and every call's report is in
        (a report travels after its call's last piece, which may be trained first)."""
        t = self.training
        if t is None or t.results is None or len(self.ended) < self.parts:
            return []
        self._enter(StepPhase.DONE)
        return [Trained(t.results)]

    def _lost(self, piece: int, lost_at: set[int]) -> list[Command]:
        """Every rank found `piece` lost (a worker that delivered it died; `lost_at`: the
        positions of the lost shares among the piece's, in teacher order; all when unknown):
        make it again and hand it out again; those handed after it come back skipped.  A
        prefetching step lost it before training anything: the step is re-planned."""
        t = self.training
        if t.prefetch:
            self.training = None
            return [Replan()]
        t.submitted = piece
        ps = self.pieces[piece]
        ps.delivered = None
        part = self.layout.part_of(piece)
        if self.scored and ps.made is not None:        # delivered by teachers: score it again
            lost = [t for k, t in enumerate(ps.scorers) if not lost_at or k in lost_at]
            for t in lost:
                ps.scored.pop(t, None)
            return self._scores(piece, lost)
        if not self.scored:                            # delivered by its rollout call's worker,
            for p in self.layout.parts[part]:          # with the rest of that call's pieces
                if p >= piece:
                    self.pieces[p].delivered = None
        return self._remake(part, ps.issue)

    def _remake(self, part: int, lost: int) -> list[Command]:
        """Issue `part` again after what issue `lost` made was lost, unless a later issue is
        making it already (its pieces then come from that call)."""
        if part in self.generating and self.issues[part] > lost:
            return []
        return [self._generate(part)]

