"""`CommandExecutor`: how the driver carries out the commands a step returns
(actors/driver/commands.py) on the workers: a rollout call as a Ray streaming generator, a
scoring on a worker of that teacher's pool (a call's spans and pieces on the one worker it is
pinned to: actors/driver/spans.py), a seal into the queue, the start of training when the
learner group is free, a hand-out to every learner rank, a re-plan.  Mixed into
`Pipeline` (actors/driver/pipeline.py), whose constructor sets what it reads: `cfg`, `groups`,
`dispatch`, `planner`, `state`, `publisher`, `metrics`, `elastic`, `learners`."""
from __future__ import annotations

from typing import Callable

import ray

from actors.driver import core
from actors.driver.commands import (Command, Generate, HandOut, Replan, Score, ScoreSpan, Seal,
                                    Trainable, Trained)
from actors.driver.group import fan_out
from actors.driver.step import Step
from actors.driver.tasks import (PieceScoring, PieceTraining, RolloutCall, SpanScoring,
                                 TeacherRolloutCall)
from actors.transport.delivery import PieceTag
from actors.workers.queue import QueueItem


class CommandExecutor:
    def _execute(self, step: Step, commands: list[Command]) -> None:
        for c in commands:
            if isinstance(c, Generate):
                self._generate(step, c)
            elif isinstance(c, Score):
                self._score(step, c)
            elif isinstance(c, ScoreSpan):
                self._score_span(step, c)
            elif isinstance(c, Seal):
                self._seal(step)
            elif isinstance(c, Trainable):
                self._start_training()
            elif isinstance(c, HandOut):
                self._hand_out(step, c)
            elif isinstance(c, Replan):
                self._replan(step)
            elif isinstance(c, Trained):
                self._step_done(step, c.results)

    def _tag(self, step: Step, piece: int) -> PieceTag:
        return PieceTag(step.step, step.gen, piece, step.layout.cuts(piece), step.version)

    def _submit(self, task: RolloutCall | PieceScoring | SpanScoring, command: Command,
                call: Callable, pool: str, pinned: int | None = None) -> int | None:
        worker = self.dispatch.submit(task, command, call, pool, pinned)
        if worker is not None:
            index = ({"piece": task.piece} if isinstance(task, PieceScoring)
                     else {"part": task.part})
            self._hook("after_submit", kind=task.kind, step=task.step, worker=worker,
                       pool=task.role, **index)
        return worker

    def _generate(self, step: Step, c: Generate) -> None:
        """Run rollout call `c.part`: its pieces stream to the teacher workers (or, unscored,
        into the queue) as their rows complete."""
        job, queue, version, scored = step.jobs[c.part], self.groups.queue, step.version, step.scored
        tags = [self._tag(step, p) for p in step.layout.parts[c.part]]
        task = RolloutCall(step=step.step, gen=step.gen, part=c.part, issue=c.issue)
        pool = "rollout"
        if step.source == "teacher":            # SeqKD: the one teacher's pool (config)
            task = TeacherRolloutCall(step=step.step, gen=step.gen, part=c.part, issue=c.issue)
            pool = self.planner.teachers.pool(0)
        self._submit(task, c, lambda actor: actor.generate.options(num_returns="streaming").remote(
            job, version, tags, queue, scored, step.span), pool)

    def _score(self, step: Step, c: Score) -> None:
        """One teacher's share of a piece, scored by a worker of that teacher's pool from the
        payload its rollout call handed out (a step on data: from its part's job)."""
        tag, queue = self._tag(step, c.piece), self.groups.queue
        task = PieceScoring(step=step.step, gen=step.gen, piece=c.piece, issue=c.issue,
                            teacher=c.teacher)
        pool = self.planner.teachers.pool(c.teacher)
        if step.source == "data":
            job, rows = step.jobs[step.layout.part_of(c.piece)], step.layout.rows_in_part(c.piece)
            self._submit(task, c, lambda actor: actor.score_data.remote(job, rows, tag, queue),
                         pool)
            return
        payload = step.pieces[c.piece].made.payload
        if step.spans is None:
            self._submit(task, c, lambda actor: actor.score.remote(payload, tag, queue), pool)
            return
        part = step.layout.part_of(c.piece)       # on the worker holding the call's spans
        call, job = (step.step, step.gen, part, c.issue), step.jobs[part]
        spans = step.spans.refs(part, c.issue)
        rows = step.layout.rows_in_part(c.piece)
        self._pin(step, part, c.teacher, self._submit(
            task, c, lambda actor: actor.score_spanned.remote(call, job, spans, payload, rows, tag,
                                                              queue),
            pool, step.spans.pins.get((part, c.teacher), -1)))

    def _score_span(self, step: Step, c: ScoreSpan) -> None:
        """One teacher scores the next span of a running rollout call, on the worker that
        scores the call's spans and pieces (actors/driver/spans.py)."""
        call, job = (step.step, step.gen, c.part, c.issue), step.jobs[c.part]
        payload = step.spans.report(c.part, c.issue, c.span).payload
        task = SpanScoring(step=step.step, gen=step.gen, part=c.part, issue=c.issue,
                           teacher=c.teacher, span=c.span)
        self._pin(step, c.part, c.teacher, self._submit(
            task, c, lambda actor: actor.score_span.remote(call, job, payload),
            self.planner.teachers.pool(c.teacher), step.spans.pins.get((c.part, c.teacher), -1)))

    @staticmethod
    def _pin(step: Step, part: int, teacher: int, worker: int | None) -> None:
        if worker is not None:
            step.spans.pins[part, teacher] = worker

    def _seal(self, step: Step) -> None:
        """Make the step's delivered pieces one queue item (the planner bounds how many there
        are: `distill.queue_capacity`)."""
        item = QueueItem(step.step, step.batch_id, step.version, samples=step.samples,
                         generated_tokens=sum(p.delivered.generated_tokens for p in step.pieces))
        ray.get(self.groups.queue.seal.remote(item, step.gen, step.layout.pieces))
        commands = step.seal()
        self._hook("after_seal", step=step.step)
        self._execute(step, commands)

    def _start_training(self) -> None:
        """The learner group, if free, begins the current version's step if it can
        (core.start_training), with the pieces delivered so far; not once Ctrl-C is pending
        (the run ends at the step in training)."""
        if self.interrupt.pending() or core.start_training(
                self.state, self.planner.plans, self.publisher.published.version) is None:
            return
        step = self.planner.plans[self.state.version]
        self._execute(step, step.hand_out())

    def _hand_out(self, step: Step, c: HandOut) -> None:
        """Hand one piece to every learner rank (they train in piece order)."""
        job = step.jobs[0]
        tokens = step.samples * (int(job.tokens.shape[1]) - job.prefix_len)   # the step's N
        refs = fan_out(self.learners, "train_piece", step.step, self.state.version,
                       step.training.gen, c.piece, step.layout.pieces, tokens, c.prefetch)
        for r, ref in enumerate(refs):
            self.dispatch.track(ref, PieceTraining(role="learner", worker=r, step=step.step,
                                                   piece=c.piece, handing=c.handing))

    def _replan(self, step: Step) -> None:
        """Generate the whole of `step` again at the published version (a new generation)."""
        self.dispatch.forget_step(step.step)
        version = step.version_at(self.publisher.published.version)
        self._again(step, step.replanned(version, self.planner.new_generation()))

    def _dispatch(self) -> None:
        """Hand the commands that wait for a worker of a pool that changed since the last call
        (a task of it ended, a worker came up or died: `Dispatcher.changed`) to its workers, lowest
        (step, piece) first; those of a step re-planned or made since are dropped.  An elastic
        pool retires a wanted worker once one is idle (`ElasticRollout.tick`)."""
        changed = self.dispatch.take_changed()
        for task, c in self.dispatch.waiting(changed):
            step = self.planner.current(task.step, task.gen)
            if step is None:
                continue
            if isinstance(c, Generate) and c.issue == step.issues[c.part]:
                self._generate(step, c)
            elif isinstance(c, Score):
                self._execute(step, step.score_due(c.piece, c.issue, c.teacher))
            elif isinstance(c, ScoreSpan) and c.issue == step.issues[c.part]:
                self._score_span(step, c)
        if self.elastic is not None and "rollout" in changed:
            self.elastic.tick()
