"""The driver's decisions (actors/driver/core.py) on made-up plans and answers: no Ray."""
from collections import Counter

import pytest
import torch

from actors.driver import core
from actors.driver.core import DriverState, PartNext, PoolCounts
from actors.driver.tasks import StageTimer, StepPlan, Task, TaskKind, Training
from actors.transport.delivery import PartReport
from opd.config.schema import load_config
from opd.distill.pieces import piece_rows, split_job
from opd.distill.results import LearnerResult, PieceAnswer
from opd.distill.rollout_stats import RolloutStats
from opd.distill.steps import RolloutJob


def plan_of(step: int, parts: int = 2, *, source: str = "student", scored: bool = True,
            version: int | None = None, batch_id: int | None = None) -> StepPlan:
    job = RolloutJob(step if batch_id is None else batch_id, torch.arange(4),
                     torch.zeros(4, 6, dtype=torch.int64), 3, source, 0)
    rows = piece_rows(4, 1, parts)                      # a rollout call per piece
    return StepPlan(step, job.batch_id, source, step if version is None else version,
                    split_job(job, rows), scored=scored, pieces_of=[[p] for p in range(parts)],
                    ranges=[(0, len(r)) for r in rows], cuts=[((0, len(r)),) for r in rows],
                    times=StageTimer(began={"rollout": 10.0}))


def report(rows=2, tokens=6, nbytes=100, stats=None) -> PartReport:
    return PartReport(rows, tokens, stats or RolloutStats(rounds=3, generated_tokens=tokens), nbytes)



def test_a_generated_part_is_scored_once_and_delivered_by_its_scoring():
    plan = plan_of(0)
    assert core.part_generated(plan, 1, report(), busy=2.0, now=11.0) is PartNext.SCORE
    assert core.part_generated(plan, 1, report(), busy=5.0, now=12.0) is PartNext.DUPLICATE
    assert plan.times.busy["rollout"] == 2.0 and plan.times.seconds("rollout") == 0.0
    assert core.part_generated(plan, 0, report(), busy=1.0, now=13.0) is PartNext.SCORE
    assert plan.times.seconds("rollout") == 3.0 and not plan.complete    # from 10.0
    plan.times.begin("teacher", 12.5)
    plan.times.begin("teacher", 13.5)                                # a re-issue: began before
    core.part_scored(plan, 0, report(), busy=0.5, now=14.0)
    core.part_scored(plan, 0, report(), busy=9.0, now=15.0)          # issued twice: first wins
    assert plan.times.busy["teacher"] == 0.5 and plan.times.seconds("teacher") == 0.0
    core.part_scored(plan, 1, report(), busy=0.25, now=16.0)
    assert plan.complete and plan.times.seconds("teacher") == 3.5
    assert plan.times.busy["teacher"] == 0.75


def test_an_unscored_part_is_delivered_when_generated():
    plan = plan_of(0, scored=False)
    assert core.part_generated(plan, 0, report(), 1.0, 11.0) is PartNext.DELIVERED
    assert core.part_generated(plan, 1, report(), 1.0, 12.0) is PartNext.DELIVERED
    assert plan.complete and plan.times.ended == {"rollout": 12.0}


def test_a_lost_input_regenerates_its_part():
    plan = plan_of(0, source="data")
    plan.generated[1] = report()
    task = core.regenerate(Task(TaskKind.SCORE, "teacher", step=0, part=1, version=0, gen=0), plan)
    assert (task.kind, task.step, task.part, task.gen) == (TaskKind.TEACHER_ROLLOUT, 0, 1, 0)
    assert plan.generated == {}
    student = plan_of(0)
    student.generated[0] = report()
    student.scoring.add(0)
    assert core.regenerate(Task(TaskKind.SCORE, step=0, part=0), student).kind is TaskKind.ROLLOUT
    assert student.scoring == set()
    # a sibling piece's scoring that lost the same input: the part is being made already
    assert core.regenerate(Task(TaskKind.SCORE, step=0, part=0), student) is None


def test_a_part_of_several_pieces_is_scored_and_delivered_piece_by_piece():
    plan = plan_of(0, parts=4)
    plan.jobs, plan.pieces_of = plan.jobs[:2], [[0, 1], [2, 3]]
    assert core.part_generated(plan, 1, report(nbytes=7), 0.5, 1.0) is PartNext.SCORE
    assert core.to_score(plan, 1) == [2, 3]
    plan.scoring.add(2)
    plan.delivered[3] = report()
    assert core.to_score(plan, 1) == []                 # 2 being scored, 3 delivered
    data = plan_of(0, parts=4, scored=False)
    data.jobs, data.pieces_of = data.jobs[:2], [[0, 1], [2, 3]]
    assert core.part_generated(data, 1, report(nbytes=7), 0.5, 1.0) is PartNext.DELIVERED
    assert {p: r.nbytes for p, r in data.delivered.items()} == {2: 7, 3: 0}   # bytes once


def test_steps_are_sealed_in_order_once_complete():
    plans = {s: plan_of(s, parts=1) for s in (2, 0, 1)}
    for s in (2, 0):
        plans[s].delivered[0] = report()
    plans[0].sealed = True
    assert [p.step for p in core.sealable(plans)] == [2]
    plans[1].delivered[0] = report()
    assert [p.step for p in core.sealable(plans)] == [1, 2]


def test_the_learner_starts_the_current_step_at_its_first_piece_once():
    state = DriverState(version=1, end=3)
    plans = {1: plan_of(1), 2: plan_of(2)}
    assert core.start_training(state, plans, published=1) is None   # no piece delivered
    plans[2].delivered[0] = report()
    assert core.start_training(state, plans, published=1) is None   # not the current step
    plans[1].delivered[1] = report()
    assert core.start_training(state, plans, published=1) is None   # piece 0 comes first
    plans[1].delivered[0] = report()
    t = core.start_training(state, plans, published=1)
    assert (t.step, t.prefetch, state.training is t) == (1, False, True)
    assert core.start_training(state, plans, published=1) is None   # one step in flight
    state.training = None
    state.consumed[plans[1].batch_id] = 1
    with pytest.raises(RuntimeError, match="batch 1 would be consumed twice"):
        core.start_training(state, plans, published=1)
    assert core.start_training(DriverState(version=3, end=3), plans, published=3) is None


def test_a_stale_plan_trains_only_once_sealed_and_prefetches():
    state = DriverState(version=2, end=4)
    plans = {2: plan_of(2, version=1)}                  # staleness 1: generated at version 1
    plans[2].delivered[0] = plans[2].delivered[1] = report()
    assert core.start_training(state, plans, published=2) is None   # a lost part could not be remade
    plans[2].sealed = True
    assert core.start_training(state, plans, published=2).prefetch
    data = {2: plan_of(2, version=1, source="data")}
    data[2].delivered[0] = report()
    assert not core.start_training(DriverState(version=2, end=4), data, published=2).prefetch


def test_pieces_are_handed_in_piece_order_and_the_last_once_sealed():
    plan = plan_of(0, parts=4)
    t = Training(0)
    plan.delivered[1] = report()
    assert core.pieces_to_train(t, plan) == []          # piece 0 first, whatever arrives first
    plan.delivered[0] = plan.delivered[3] = report()
    assert core.pieces_to_train(t, plan) == [0, 1]
    plan.delivered[2] = report()
    assert core.pieces_to_train(t, plan) == [2]         # 3 is delivered, the step is not sealed
    plan.sealed = True
    assert core.pieces_to_train(t, plan) == [3]
    assert (t.submitted, t.handed) == (4, {0: 1, 1: 1, 2: 1, 3: 1})


def test_a_lost_piece_is_made_again_and_handed_again_in_order():
    plan = plan_of(0, parts=3)
    for p in range(3):
        plan.generated[p] = plan.delivered[p] = report()
    plan.sealed = True
    t = Training(0)
    assert core.pieces_to_train(t, plan) == [0, 1, 2]
    ok = PieceAnswer(0, 0)
    assert core.piece_answered(t, plan, 0, 1, 0, ok, ranks=2) is core.PieceNext.WAIT
    assert core.piece_answered(t, plan, 0, 1, 1, ok, ranks=2) is core.PieceNext.WAIT
    lost = PieceAnswer(0, 1, lost=True)
    assert core.piece_answered(t, plan, 1, 1, 0, lost, ranks=2) is core.PieceNext.WAIT
    assert core.piece_answered(t, plan, 1, 1, 1, lost, ranks=2) is core.PieceNext.AGAIN
    assert (t.submitted, 1 in plan.delivered, 1 in plan.generated) == (1, False, False)
    skipped = PieceAnswer(0, 2, skipped=True)
    for r in range(2):
        assert core.piece_answered(t, plan, 2, 1, r, skipped, ranks=2) is core.PieceNext.WAIT
    plan.generated[1] = plan.delivered[1] = report()  # made again
    assert core.pieces_to_train(t, plan) == [1, 2]
    assert t.handed == {0: 1, 1: 2, 2: 2}
    late = PieceAnswer(0, 2, skipped=True)      # an answer to the first hand-out of 2
    assert core.piece_answered(t, plan, 2, 1, 0, late, ranks=2) is core.PieceNext.WAIT
    for r in range(2):
        core.piece_answered(t, plan, 1, 2, r, PieceAnswer(r, 1), ranks=2)
    last = [PieceAnswer(r, 2, result=rank(1.0 + r, 1.0 + 2 * r)) for r in range(2)]
    assert core.piece_answered(t, plan, 2, 2, 0, last[0], ranks=2) is core.PieceNext.WAIT
    assert core.piece_answered(t, plan, 2, 2, 1, last[1], ranks=2) is core.PieceNext.TRAINED
    assert t.results == {0: last[0].result, 1: last[1].result}


def test_a_prefetching_step_that_lost_a_piece_is_re_planned():
    plan = plan_of(0, parts=2, version=0)
    plan.delivered[0] = plan.delivered[1] = report()
    plan.sealed = True
    t = Training(0, prefetch=True)
    core.pieces_to_train(t, plan)
    lost = PieceAnswer(0, 0, lost=True)
    assert core.piece_answered(t, plan, 0, 1, 0, lost, ranks=1) is core.PieceNext.REPLAN


def rank(loss, tokens, busy=0.0):
    return LearnerResult(0, {"loss": loss, "tokens": tokens, "onpolicy_tokens": 0,
                             "onpolicy_logprob_delta_mean": 0.0,
                             "onpolicy_logprob_delta_max": 0.0},
                         grad_norm=1.5, seconds=1.0, busy_s=busy, rows=2, received_bytes=10,
                         queue_depth=1)


def test_a_trained_step_counts_its_batch_and_says_what_follows(tiny_overrides):
    cfg = load_config("tiny", [*tiny_overrides, "distill.steps=4", "run.checkpoint_every=2",
                               "distill.broadcast_every=2", "distill.staleness=1"])
    state = DriverState(version=1, end=4, last_step_end=100.0)
    plan = plan_of(1)
    state.training = Training(1, results={1: rank(2.0, 3.0), 0: rank(1.0, 1.0)}, start=101.0)
    done = core.step_trained(state, plan, 2, now=104.0, cfg=cfg)
    assert (state.version, state.training, state.consumed[plan.batch_id]) == (2, None, 1)
    assert (done.wall, done.learner_start, done.checkpoint, done.publish) == (4.0, 101.0, True, True)
    assert [r.metrics["loss"] for r in done.results] == [1.0, 2.0]   # rank order
    state.training = Training(2, results={0: rank(0, 0), 1: rank(0, 0)})
    done = core.step_trained(state, plan_of(2), 2, now=105.0, cfg=cfg)
    assert (done.checkpoint, done.publish) == (False, False)
    state.training = Training(3, results={0: rank(0, 0), 1: rank(0, 0)})
    done = core.step_trained(state, plan_of(3), 2, now=106.0, cfg=cfg)
    assert (done.checkpoint, done.publish) == (True, False)          # the last step: no publish


def test_rank_metrics_are_the_global_token_mean():
    out = LearnerResult.step_metrics([rank(1.0, 1.0, busy=2.0), rank(2.0, 3.0, busy=4.0)])
    assert out["loss"] == pytest.approx(1.75) and out["tokens"] == 4.0 and out["grad_norm"] == 1.5
    assert out["busy_s"] == pytest.approx(3.5)          # a metrics.parquet column, token-weighted
    assert set(out) == {"loss", "tokens", "grad_norm", "busy_s", "onpolicy_tokens",
                        "onpolicy_logprob_delta_mean", "onpolicy_logprob_delta_max", "onpolicy_s"}


def test_step_metrics_row():
    plan = plan_of(5, version=4)
    plan.times = StageTimer({"rollout": 10.0, "teacher": 11.0}, {"rollout": 12.0, "teacher": 13.0},
                            Counter(rollout=4.0, teacher=1.0))
    for p in range(2):
        plan.generated[p] = report()
        plan.delivered[p] = report(nbytes=100 + p)
    done = core.StepDone([rank(1.0, 6.0, busy=2.0)], learner_start=13.0, now=16.0, wall=8.0,
                         checkpoint=False, publish=False)
    row = core.step_metrics(plan, done, PoolCounts(2, 2, 1), sync_seconds=0.5, sync_bytes=64,
                            reissued=3)
    assert {k: row[k] for k in ("step", "policy_lag", "rollout_s", "teacher_s", "learner_s",
                                "step_s", "rollout_idle", "teacher_idle", "learner_idle",
                                "delivered_bytes", "samples_per_s", "reissued", "weight_bytes",
                                "generated_tokens", "rollout_wait")} == {
        "step": 5, "policy_lag": 1, "rollout_s": 2.0, "teacher_s": 2.0, "learner_s": 2.0,
        "step_s": 8.0, "rollout_idle": 0.75, "teacher_idle": 0.875, "learner_idle": 0.75,
        "delivered_bytes": 201, "samples_per_s": 0.5, "reissued": 3, "weight_bytes": 64,
        "generated_tokens": 12, "rollout_wait": 0.25}    # issued 10 .. last part 12, of 8 s
    assert {k: row[k] for k in ("rollout_busy_s", "teacher_busy_s", "learner_busy_s",
                                "learner_span_s", "pieces")} == {
        "rollout_busy_s": 4.0, "teacher_busy_s": 1.0, "learner_busy_s": 2.0,   # the learner's own
        "learner_span_s": 3.0, "pieces": 2}                                     # seconds, not its span
