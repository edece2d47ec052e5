"""The driver's run-wide decisions as plain functions over its typed state: no Ray, no actors.

A step's own life (its parts, pieces, faults and training) is its state machine,
actors/driver/step.py.  What spans steps is here, tested without Ray (tests/actors/test_core.py):

    DriverState         the policy version, the batches consumed and reused
    in_training         the step the learner group is on (read from the steps' phases)
    start_training      the step the learner group trains next (one at a time, in step order)
    step_trained        the last piece trained: the step is done (what follows)
    step_metrics        the step's metrics.parquet row, from its reports and the ranks' results
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Callable
from dataclasses import dataclass, field

from actors.driver.progress import Training
from actors.driver.step import Step
from opd.distill.results import LearnerResult
from opd.distill.rollout_stats import RolloutStats
from opd.config.schema import RunConfig
from opd.run.loop import checkpoint_due, step_row


@dataclass
class DriverState:
    """What the driver's step loop knows besides its steps (actors/driver/planner.py)."""
    version: int                          # learner steps done = the current policy version
    end: int                              # the step the run stops before
    consumed: Counter[int] = field(default_factory=Counter)   # prefix batch id -> times trained
    reused: Counter[int] = field(default_factory=Counter)     # step -> times its rollout was
    #                                                           trained again (opd/distill/reuse.py)
    reissued: int = 0                     # calls and pieces issued again (faults, re-plans)
    last_step_end: float = field(default_factory=time.perf_counter)

    @property
    def done(self) -> bool:
        return self.version >= self.end


def in_training(plans: dict[int, Step]) -> Step | None:
    """The step the learner group is on: the planned step STREAMING or TRAINING (one at a
    time; a step leaves `plans` once trained, and a re-planned one is GENERATING again)."""
    return next((p for p in plans.values() if p.trains), None)


def start_training(state: DriverState, plans: dict[int, Step],
                   published: int) -> Training | None:
    """The current version's step begins training when the learner group is free
    (`Step.begin_training` says when it can); raises if its prefix batch was trained before
    (every batch id is consumed once; a step reusing a buffered rollout consumes none)."""
    if state.done or in_training(plans) is not None:
        return None
    step = plans.get(state.version)
    if step is None:
        return None
    if state.consumed[step.batch_id] and step.origin is None:
        raise RuntimeError(f"batch {step.batch_id} would be consumed twice (step {step.step})")
    return step.begin_training(published)


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


def step_trained(state: DriverState, plan: Step, results: list[LearnerResult], now: float,
                 cfg: RunConfig, rollouts_at: Callable[[int], bool]) -> StepDone:
    """Every learner rank answered the last piece of step `plan` (`results`, rank order): the
    step is counted, its batch consumed (or, reusing a buffered rollout, that rollout's reuse
    counted), the version one up.  The new version is published on the broadcast cadence if
    `rollouts_at(version)` says a fresh student rollout may be made with it
    (`StepPlanner.rollouts_at`)."""
    t = plan.training
    if plan.origin is None:
        state.consumed[plan.batch_id] += 1
    else:
        state.reused[plan.origin] += 1
    wall, state.last_step_end = now - state.last_step_end, now
    state.version += 1
    v = state.version
    return StepDone(results, t.start, now, wall, checkpoint=checkpoint_due(cfg, v),
                    publish=(v < state.end and v % cfg.distill.broadcast_every == 0
                             and rollouts_at(v)))


def rollout_wait_fraction(source: str, issued: float, rollout_done: float, learner_free: float,
                          train_start: float, wall: float) -> float:
    """Fraction of a step's wall time the learner was free and waiting on the step's student
    rollouts: from max(issue, learner free) to min(last part generated, training start)."""
    if source != "student" or wall <= 0:
        return 0.0
    return max(0.0, min(rollout_done, train_start) - max(issued, learner_free)) / wall


@dataclass
class BatchSummary:
    """What a step row needs of the trained batch, from its rollout calls' reports (no
    payload)."""
    batch_id: int
    policy_version: int
    source: str
    prefix_len: int
    rollout_stats: RolloutStats
    num_generated_tokens: int
    batch_size: int
    seq_len: int

    @classmethod
    def of(cls, plan: Step) -> BatchSummary:
        reports = [plan.ended[c] for c in range(plan.parts)]  # the rollout calls'
        job = plan.jobs[0]
        return cls(plan.batch_id, plan.version, plan.source, job.prefix_len,
                   RolloutStats() if plan.origin is not None else   # reused: no rollout ran
                   RolloutStats.merge([r.stats for r in reports]),
                   sum(r.generated_tokens for r in reports), sum(r.rows for r in reports),
                   int(job.tokens.shape[1]))


@dataclass
class PoolCounts:
    """Workers the row's idle ratios are taken over."""
    rollout_alive: int
    rollout_up: int
    teacher_alive: int


def step_metrics(plan: Step, done: StepDone, pools: PoolCounts, *, sync_seconds: float,
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
    row = step_row(plan.step, traj, LearnerResult.step_metrics(results), seconds,
                   phase=plan.schedule, reused=plan.origin is not None)
    R, M = pools.rollout_alive, pools.teacher_alive
    row.update({
        "step_s": wall, "published": done.publish, "weight_sync_s": sync_seconds,
        "weight_bytes": sync_bytes, "queue_depth": results[0].queue_depth,
        "policy_lag": plan.step - plan.version, "samples_per_s": plan.samples / wall,
        "teacher_tokens_per_s": (traj.batch_size * traj.seq_len / seconds["teacher"]
                                 if seconds["teacher"] > 0 else 0.0),
        "rollout_idle": max(0.0, 1 - t.busy["rollout"] / (R * wall)) if R else 1.0,
        "teacher_idle": max(0.0, 1 - t.busy["teacher"] / (M * wall)) if M else 1.0,
        "learner_idle": max(0.0, 1 - seconds["learner"] / wall), "reissued": reissued,
        "rollout_busy_s": t.busy["rollout"], "teacher_busy_s": t.busy["teacher"],
        "learner_busy_s": seconds["learner"], "learner_span_s": done.now - done.learner_start,
        "pieces": plan.layout.pieces,
        "teacher_in_rollout_s": plan.spans.in_rollout if plan.spans is not None else 0.0,
        "rollout_workers": pools.rollout_up,
        "delivered_bytes": 0 if plan.origin is not None else sum(p.delivered.nbytes
                                                                 for p in plan.pieces),
        "learner_received_bytes": [int(r.received_bytes) for r in results],
        "rollout_wait": rollout_wait_fraction(plan.source, t.began.get("rollout", 0.0),
                                              t.ended.get("rollout", 0.0), done.now - wall,
                                              done.learner_start, wall)})
    return row
