"""`AnswerRouter`: how the driver routes what comes back from the workers to the step it
belongs to: a rollout call's spans, pieces and end, a scoring, a learner rank's piece, a probe
or a weights load, and each kind of fault (a worker that held other weights, failed, or lost a
payload another task needed; a node lost).  A step's answer to a fault is carried out and what
is made again is counted.  Mixed into `Pipeline` (actors/driver/pipeline.py), whose constructor
sets what it reads; the commands go to `CommandExecutor._execute`."""
from __future__ import annotations

import time

from ray.exceptions import ActorDiedError, RayActorError

from actors.driver import core
from actors.driver.cluster import bundle_node
from actors.driver.commands import Command, Generate, Score
from actors.driver.dispatch import Answer
from actors.driver.step import Step
from actors.driver.tasks import (PieceScoring, PieceTraining, Placement, Probe, RolloutCall,
                                 SpanScoring, Task, WeightsLoad)
from actors.transport.delivery import PartReport, SpanReport
from actors.workers.rollout import StaleWeightsError
from opd.distill.results import PieceAnswer

WAIT_S = 30.0


class AnswerRouter:
    def _wait(self) -> None:
        """Send the probes that are due, route every answer that arrives to its step, then hand
        out what waited for a worker of the pools those answers changed (`_dispatch`)."""
        self.dispatch.probe()
        probe = self.dispatch.idle_for()
        training = core.in_training(self.planner.plans)
        if not self.dispatch.tasks and probe is None and training is None:
            raise RuntimeError(f"the pipeline stalled at step {self.state.version}: "
                               f"nothing in flight")
        for answer in self.dispatch.wait(min(WAIT_S, probe or WAIT_S), self.interrupt):
            self._route(answer)
        self._dispatch()

    def _route(self, answer: Answer) -> None:
        """One answer: a task done goes to its step (`_on_done`), a fault to what handles it."""
        task, e = answer.task, answer.error
        if e is None:
            self._on_done(task, answer.ref, answer.value)
        elif isinstance(e, StaleWeightsError):
            self.publisher.load(task.worker)      # reload first (actor calls run in order)
            self._failed(task)
        elif isinstance(task, SpanScoring) and not isinstance(e, RayActorError):
            pass                                  # a span lost: its pieces' scorings redo it
        elif answer.lost_input:                   # the piece it scored died with its worker
            step = self.planner.current(task.step, task.gen)
            if step is not None:
                self._again(step, step.score_lost(task.piece, task.issue, task.teacher))
        elif isinstance(e, RayActorError):
            self._on_actor_error(task, answer.ref, e)
        else:
            raise e

    def _on_done(self, task: Task, ref, value) -> None:
        now = time.perf_counter()
        if isinstance(task, (RolloutCall, PieceScoring, SpanScoring)):
            step = self.planner.current(task.step, task.gen)
            if step is None:
                return                               # an answer of a step since re-planned
            if isinstance(task, SpanScoring):
                step.span_scored(task.part, task.issue, task.span, value)
            elif isinstance(task, PieceScoring):
                commands = step.piece_scored(task.piece, value, now - task.submitted, task.teacher)
                self._hook("after_scored", step=step.step, piece=task.piece, worker=task.worker)
                self._execute(step, commands)
            else:
                self._made(step, task, value, now - task.submitted)
        elif isinstance(task, Probe):
            self.nodes.placed(task.role, task.worker, value["node_id"], value["node_ip"])
            if task.role == "rollout":
                self.publisher.load(task.worker)     # before it gets any job
            self.dispatch.probe_answered(task.role, task.worker)
        elif isinstance(task, WeightsLoad):
            self.dispatch.started(task.worker)
            self.publisher.loaded(ref)
        elif isinstance(task, Placement):
            i = self.elastic.placed(ref)
            self.nodes.placed("rollout", i, bundle_node(self.elastic.added[i]))
        elif isinstance(task, PieceTraining):
            self._piece_trained(task, value)

    def _made(self, step: Step, task: RolloutCall, made, busy: float) -> None:
        """An answer of a rollout call: a span or a piece it handed out, or its end."""
        if isinstance(made, SpanReport):
            self._execute(step, step.span_made(task.part, task.issue, made))
            return
        if isinstance(made, PartReport):
            commands = step.part_made(task.part, task.issue, made, busy)
            self._hook("after_part", step=step.step, part=task.part, worker=task.worker)
            self._execute(step, commands)
            return
        commands = step.piece_made(task.part, task.issue, made)
        self._hook("after_piece", step=step.step, piece=made.piece, worker=task.worker)
        self._execute(step, commands)

    def _piece_trained(self, task: PieceTraining, value: PieceAnswer) -> None:
        step = core.in_training(self.planner.plans)
        if step is None or step.step != task.step:
            return
        commands = step.piece_trained(task.piece, task.handing, task.worker, value,
                                      len(self.learners))
        self._again(step, commands)

    def _on_actor_error(self, task: Task, ref, error: RayActorError) -> None:
        if isinstance(task, PieceTraining):
            raise self.records.learner_failure("train", task.step, error) from error
        if isinstance(task, Probe):
            self.dispatch.probe_failed(task.role, task.worker,
                                       died=isinstance(error, ActorDiedError))
            return
        self.pools[task.role].failed(task.worker)
        if task.role == "rollout":
            self.publisher.fall_back_to_object_store()
        if isinstance(task, WeightsLoad):        # the probe that brings it back reloads it
            self.publisher.loaded(ref)
            return
        self._failed(task)

    def _failed(self, task: RolloutCall | PieceScoring | SpanScoring) -> None:
        """A rollout call or a scoring failed: its step says what to do again."""
        step = self.planner.current(task.step, task.gen)
        if step is None or isinstance(task, SpanScoring):
            return                                    # a span: its pieces' scorings score it
        if isinstance(task, RolloutCall):
            commands = step.part_failed(task.part, task.issue, self.publisher.published.version)
        else:
            commands = step.score_failed(task.piece, task.teacher)
        self._again(step, commands)

    def _again(self, step: Step, commands: list[Command]) -> None:
        """Carry out a step's answer to a fault, counting the calls and scorings made again."""
        calls = sum(isinstance(c, Generate) for c in commands)
        scorings = sum(isinstance(c, Score) for c in commands)
        self.metrics.inc("opd_reissued_calls", calls)
        self.metrics.inc("opd_rescored_pieces", scorings)
        self.state.reissued += calls + scorings
        self._execute(step, commands)

    def _watch_nodes(self) -> None:
        """Workers on a node that was lost are out of the rotation until a probe answers (from
        the node Ray restarted them on; a rollout worker then reloads the weights)."""
        for role, i in self.nodes.poll(self.state.version):
            if role in self.pools:
                self.pools[role].failed(i)
            if role == "rollout":
                self.publisher.fall_back_to_object_store()
