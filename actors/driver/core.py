"""The driver's decisions as plain functions over its typed state: no Ray, no actors.

`actors/driver/pipeline.py` executes them (submits calls, seals queue items, publishes weights,
writes rows); every function here only reads and updates the records of `actors/driver/tasks.py`
(`StepPlan`, `Task`, `PartReport`, `Training`) and the `DriverState` below, so each decision is
unit-tested on its own (tests/actors/test_core.py):

    part_generated      a part's report arrived: score it next, or it is delivered already
    to_score            the pieces of a generated part to score
    part_scored         a piece's scoring arrived
    retry               a part failed: issue it again, re-plan its whole step, or drop it
    regenerate          a scoring whose input part died: the generation to issue again
    sealable            the steps whose parts are all delivered, in step order
    start_training      the step the learner group trains next (one in flight), once its first
                        piece is there (streaming, docs/STREAMING.md) or all of them
    pieces_to_train     the pieces to hand to the learner ranks now, in piece order
    piece_answered      every rank answered a piece: wait, make it again, re-plan, or trained
    step_trained        the last piece trained: the step is done (what follows)
    step_metrics        the step's metrics.parquet row, from its reports and the ranks' results
"""
from __future__ import annotations

import dataclasses
import enum
import time
from collections import Counter
from dataclasses import dataclass, field

from actors.driver.tasks import StepPlan, Task, TaskKind, Training
from actors.transport.delivery import PartReport
from opd.distill.results import LearnerResult, PieceAnswer
from opd.distill.rollout_stats import RolloutStats
from opd.config.schema import RunConfig
from opd.run.loop import checkpoint_due, step_row


@dataclass
class DriverState:
    """What the driver's step loop knows besides its plans (actors/driver/planner.py)."""
    version: int                          # learner steps done = the current policy version
    end: int                              # the step the run stops before
    consumed: Counter[int] = field(default_factory=Counter)   # prefix batch id -> times trained
    training: Training | None = None      # the learner step in flight
    reissued: int = 0                     # parts issued again (faults, re-plans)
    last_step_end: float = field(default_factory=time.perf_counter)

    @property
    def done(self) -> bool:
        return self.version >= self.end


class PartNext(enum.Enum):
    DUPLICATE = "duplicate"   # a part already generated (an answer issued twice): ignore
    SCORE = "score"           # submit its scoring
    DELIVERED = "delivered"   # the worker delivered it into the queue (no scoring)


def part_generated(plan: StepPlan, part: int, report: PartReport, busy: float,
                   now: float) -> PartNext:
    """Record part `part` of `plan` generated (`busy`: the seconds from its submission to its
    answer; the worker's own, `report.seconds`, count as its busy time when it measured them)."""
    if part in plan.generated:
        return PartNext.DUPLICATE                    # first answer wins
    plan.generated[part] = report
    plan.times.busy["rollout"] += report.seconds or busy
    if len(plan.generated) == plan.parts:
        plan.times.end("rollout", now)
    if plan.scored:
        return PartNext.SCORE
    for i, p in enumerate(plan.pieces_of[part]):     # the worker delivered its pieces
        plan.delivered[p] = report if i == 0 else dataclasses.replace(report, nbytes=0)
    return PartNext.DELIVERED


def to_score(plan: StepPlan, part: int) -> list[int]:
    """The pieces of a generated part to submit for scoring: those neither delivered nor being
    scored."""
    return [p for p in plan.pieces_of[part] if p not in plan.delivered and p not in plan.scoring]


def part_scored(plan: StepPlan, piece: int, report: PartReport, busy: float, now: float) -> None:
    """Record piece `piece` of `plan` scored and delivered into the queue."""
    plan.scoring.discard(piece)
    if piece in plan.delivered:
        return
    plan.delivered[piece] = report
    plan.times.busy["teacher"] += report.seconds or busy
    if plan.complete:
        plan.times.end("teacher", now)


class Retry(enum.Enum):
    DROP = "drop"         # its plan is gone or was re-planned since: nothing to do
    REPLAN = "replan"     # the whole plan again, at the published version (a new generation)
    AGAIN = "again"       # this part again: same job, so the same tokens


def retry(task: Task, plan: StepPlan | None, published: int) -> Retry:
    """What to do about a failed part (`plan`: its step's plan if still of the task's
    generation, else None).  A student rollout whose plan is older than the published weights
    cannot be generated again (workers hold only the published version and would answer
    StaleWeightsError for ever): its whole plan is re-planned, as a batch that expired."""
    if plan is None:
        return Retry.DROP
    if task.kind is TaskKind.ROLLOUT and plan.source == "student" and plan.version != published:
        return Retry.REPLAN
    return Retry.AGAIN


def replan_version(plan: StepPlan, published: int) -> int:
    """The version a re-planned step is generated at: student rollouts at the published
    version, other sources at their step's own."""
    return published if plan.source == "student" else plan.version


def regenerate(task: Task, plan: StepPlan) -> Task | None:
    """A scoring of piece `task.part` whose input part died with the worker that owned it:
    forget the part and return its generation to issue again (None: it is being made again
    already; its pieces are scored when it is)."""
    plan.scoring.discard(task.part)
    part = plan.part_of(task.part)
    if plan.generated.pop(part, None) is None:
        return None
    kind = TaskKind.ROLLOUT if plan.source == "student" else TaskKind.TEACHER_ROLLOUT
    return Task(kind, step=task.step, part=part, version=task.version, gen=task.gen)


def sealable(plans: dict[int, StepPlan]) -> list[StepPlan]:
    """Plans whose parts are all delivered and not sealed yet, in step order (the driver seals
    them in this order and stops at the first the queue refuses)."""
    return [plans[s] for s in sorted(plans) if plans[s].complete and not plans[s].sealed]


def streamable(plan: StepPlan, published: int) -> bool:
    """Whether the learner may train on `plan` piece by piece as its parts arrive: only if a
    part lost on the way can be made again exactly as it was (trajectories of the published
    version, or of no student).  Otherwise the step trains once every part is delivered, and
    a piece lost then re-plans the whole step."""
    return plan.source != "student" or plan.version == published


def start_training(state: DriverState, plans: dict[int, StepPlan],
                   published: int) -> Training | None:
    """The current version's step begins training when the learner group is free: as soon as
    its first part is delivered if it is `streamable`, else once it is sealed; raises if its
    prefix batch was trained before (every batch id is consumed once)."""
    if state.training is not None or state.done:
        return None
    plan = plans.get(state.version)
    if plan is None:
        return None
    stream = streamable(plan, published)
    if not (plan.sealed or (stream and 0 in plan.delivered)):
        return None
    if state.consumed[plan.batch_id]:
        raise RuntimeError(f"batch {plan.batch_id} would be consumed twice (step {plan.step})")
    state.training = Training(plan.step, plan.gen, prefetch=not stream)
    return state.training


def pieces_to_train(t: Training, plan: StepPlan) -> list[int]:
    """The pieces to hand to the learner ranks now, in piece order: each delivered one after
    those handed already, up to the first missing one; the last only once the step is sealed
    (taking it hands the step out of the queue)."""
    out = []
    while t.submitted < plan.pieces:
        p = t.submitted
        if p not in plan.delivered or (p == plan.pieces - 1 and not plan.sealed):
            break
        out.append(p)
        t.submitted += 1
        t.handed[p] = t.handed.get(p, 0) + 1
    return out


class PieceNext(enum.Enum):
    WAIT = "wait"         # not every rank answered, or a piece handed again since: nothing yet
    TRAINED = "trained"   # the step's last piece: every rank's result of the step is in
    AGAIN = "again"       # lost with the worker that owned it: make the part again, hand it again
    REPLAN = "replan"     # a prefetching step lost a piece before training: re-plan the step


def piece_answered(t: Training, plan: StepPlan, part: int, handing: int, rank: int,
                   value: PieceAnswer, ranks: int) -> PieceNext:
    """Record learner rank `rank`'s answer to the `handing`-th hand-out of piece `part`."""
    if handing != t.handed.get(part):
        return PieceNext.WAIT                        # an answer to an earlier hand-out
    answers = t.answers.setdefault(part, {})
    answers[rank] = value
    if len(answers) < ranks:
        return PieceNext.WAIT
    del t.answers[part]
    first = answers[0]
    if first.skipped:                                # handed after a lost piece: hand it again
        return PieceNext.WAIT
    if first.lost:
        if t.prefetch:
            return PieceNext.REPLAN
        t.submitted = part                           # those after it come back skipped
        plan.generated.pop(part, None)
        plan.delivered.pop(part, None)
        return PieceNext.AGAIN
    if part == plan.pieces - 1:
        t.results = {r: a.result for r, a in answers.items()}
        return PieceNext.TRAINED
    return PieceNext.WAIT


@dataclass
class StepDone:
    """A trained step: its ranks' results (rank order), when training began and ended, the
    step's wall time (from the previous step's end), and what follows it."""
    results: list[LearnerResult]
    learner_start: float
    now: float
    wall: float
    checkpoint: bool          # the checkpoint of the new version is due
    publish: bool             # publish the new version to the rollout workers


def step_trained(state: DriverState, plan: StepPlan, ranks: int, now: float,
                 cfg: RunConfig) -> StepDone:
    """Every one of `ranks` learner ranks answered the last piece of `state.training`: the step
    is counted, its batch consumed, the version one up."""
    t, state.training = state.training, None
    results = [t.results[r] for r in range(ranks)]
    state.consumed[plan.batch_id] += 1
    wall, state.last_step_end = now - state.last_step_end, now
    state.version += 1
    v = state.version
    return StepDone(results, t.start, now, wall, checkpoint=checkpoint_due(cfg, v),
                    publish=v < state.end and v % cfg.distill.broadcast_every == 0)


def rollout_wait_fraction(source: str, issued: float, rollout_done: float, learner_free: float,
                          train_start: float, wall: float) -> float:
    """Fraction of a step's wall time the learner was free and waiting on the step's student
    rollouts: from max(issue, learner free) to min(last part generated, training start)."""
    if source != "student" or wall <= 0:
        return 0.0
    return max(0.0, min(rollout_done, train_start) - max(issued, learner_free)) / wall


@dataclass
class BatchSummary:
    """What a step row needs of the trained batch, from its parts' reports (no payload)."""
    batch_id: int
    policy_version: int
    source: str
    prefix_len: int
    rollout_stats: RolloutStats
    num_generated_tokens: int
    batch_size: int
    seq_len: int

    @classmethod
    def of(cls, plan: StepPlan) -> BatchSummary:
        reports = [plan.generated[c] for c in range(plan.parts)]   # the rollout calls'
        job = plan.jobs[0]
        return cls(plan.batch_id, plan.version, plan.source, job.prefix_len,
                   RolloutStats.merge([r.stats for r in reports]),
                   sum(r.generated_tokens for r in reports), sum(r.rows for r in reports),
                   int(job.tokens.shape[1]))


@dataclass
class PoolCounts:
    """Workers the row's idle ratios are taken over."""
    rollout_alive: int
    rollout_up: int
    teacher_alive: int


def step_metrics(plan: StepPlan, done: StepDone, pools: PoolCounts, *, sync_seconds: float,
                 sync_bytes: int, reissued: int) -> dict:
    """The metrics.parquet row of a trained step: the reference loop's columns
    (`opd.run.loop.step_row`) plus the pipeline's own (queue depth, policy lag, idle ratios, bytes,
    the learner's wait on rollouts)."""
    wall, results = done.wall, done.results
    traj = BatchSummary.of(plan)
    t = plan.times
    seconds = {"rollout": t.seconds("rollout"),
               "teacher": t.seconds("teacher") if plan.scored else 0.0,
               "learner": max(r.busy_s for r in results)}
    row = step_row(plan.step, traj, LearnerResult.step_metrics(results), seconds, phase=plan.phase)
    R, M = pools.rollout_alive, pools.teacher_alive
    row.update({
        "step_s": wall, "weight_sync_s": sync_seconds,
        "weight_bytes": sync_bytes, "queue_depth": results[0].queue_depth,
        "policy_lag": plan.step - plan.version, "samples_per_s": plan.samples / wall,
        "teacher_tokens_per_s": (traj.batch_size * traj.seq_len / seconds["teacher"]
                                 if seconds["teacher"] > 0 else 0.0),
        "rollout_idle": max(0.0, 1 - t.busy["rollout"] / (R * wall)) if R else 1.0,
        "teacher_idle": max(0.0, 1 - t.busy["teacher"] / (M * wall)) if M else 1.0,
        "learner_idle": max(0.0, 1 - seconds["learner"] / wall), "reissued": reissued,
        "rollout_busy_s": t.busy["rollout"], "teacher_busy_s": t.busy["teacher"],
        "learner_busy_s": seconds["learner"], "learner_span_s": done.now - done.learner_start,
        "pieces": plan.pieces,
        "rollout_workers": pools.rollout_up,
        "delivered_bytes": sum(r.nbytes for r in plan.delivered.values()),
        "learner_received_bytes": [int(r.received_bytes) for r in results],
        "rollout_wait": rollout_wait_fraction(plan.source, t.began["rollout"],
                                              t.ended.get("rollout", 0.0), done.now - wall,
                                              done.learner_start, wall)})
    return row
