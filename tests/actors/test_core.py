"""The driver's run-wide decisions (actors/driver/core.py) on made-up steps: no Ray.  A step's
own life is tests/actors/test_step.py."""
from collections import Counter

import pytest
import torch

from actors.driver import core
from actors.driver.commands import Trainable
from actors.driver.core import DriverState, PoolCounts
from actors.driver.planner import StepPlanner
from actors.driver.step import Step
from actors.driver.tasks import StageTimer
from actors.transport.delivery import PartReport, PieceReport
from opd.config.schema import load_config
from opd.distill.pieces import Layout, split_job
from opd.distill.results import LearnerResult
from opd.distill.rollout_stats import RolloutStats
from opd.distill.steps import RolloutJob


def plan_of(step: int, pieces: int = 2, *, source: str = "student", version: int | None = None,
            batch_id: int | None = None) -> Step:
    """A step of 4 rows in `pieces` pieces, one rollout call each."""
    job = RolloutJob(step if batch_id is None else batch_id, torch.arange(4),
                     torch.zeros(4, 6, dtype=torch.int64), 3, source, 0)
    layout = Layout(tuple([4 // pieces] * pieces), tuple((p,) for p in range(pieces)), 1)
    s = Step(step, job.batch_id, source, step if version is None else version,
             split_job(job, layout.call_rows), layout, gen=0, scored=True, schedule="")
    s.times = StageTimer(began={"rollout": 10.0})
    return s


def report(piece=0, rows=2, tokens=6, nbytes=100) -> PieceReport:
    return PieceReport(piece, rows, tokens, nbytes, payload="ref")


def deliver(s: Step, piece: int, nbytes: int = 100) -> None:
    s.piece_made(piece, s.issues[piece], report(piece, nbytes=nbytes))
    s.piece_scored(piece, report(piece, nbytes=nbytes), busy=0.0)


def test_the_learner_starts_the_current_step_at_its_first_piece_once():
    state = DriverState(version=1, end=3)
    plans = {1: plan_of(1), 2: plan_of(2)}
    for p in plans.values():
        p.start()
    assert core.start_training(state, plans, published=1) is None   # no piece delivered
    deliver(plans[2], 0)
    assert core.start_training(state, plans, published=1) is None   # not the current step
    deliver(plans[1], 1)
    assert core.start_training(state, plans, published=1) is None   # piece 0 comes first
    deliver(plans[1], 0)
    t = core.start_training(state, plans, published=1)
    assert (core.in_training(plans), t.prefetch, plans[1].training is t) == (plans[1], False, True)
    assert core.start_training(state, plans, published=1) is None   # one step in flight
    plans[1] = plan_of(1)                               # the learner is free, and a plan's
    state.consumed[plans[1].batch_id] = 1               # batch was trained already
    with pytest.raises(RuntimeError, match="batch 1 would be consumed twice"):
        core.start_training(state, plans, published=1)
    assert core.start_training(DriverState(version=3, end=3), plans, published=3) is None


def test_a_stale_step_trains_only_once_sealed_and_prefetches():
    state = DriverState(version=2, end=4)
    plans = {2: plan_of(2, version=1)}                  # staleness 1: generated at version 1
    plans[2].start()
    deliver(plans[2], 0)
    deliver(plans[2], 1)
    assert core.start_training(state, plans, published=2) is None   # a lost piece could not be remade
    plans[2].seal()
    assert core.start_training(state, plans, published=2).prefetch
    data = {2: plan_of(2, version=1, source="data")}
    data[2].start()
    deliver(data[2], 0)
    assert not core.start_training(DriverState(version=2, end=4), data, published=2).prefetch


def test_a_replanned_step_keeps_its_source_s_version_and_old_answers_are_dropped():
    planner = StepPlanner.__new__(StepPlanner)          # no data: the step is made by hand
    planner._gens = iter(range(1, 100))
    s = plan_of(3, version=2)
    planner.plans = {3: s}
    assert s.version_at(published=3) == 3
    s.replanned(3, planner.new_generation())
    assert planner.current(3, 0) is None and planner.current(3, 1) is s
    assert plan_of(3, version=2, source="data").version_at(published=3) == 2


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

    def trained(step, now, start=0.0, rollouts=True, batch_id=None):
        plan = plan_of(step, batch_id=batch_id)
        plan.start()
        for p in range(2):
            deliver(plan, p)
        plan.seal()
        core.start_training(state, {step: plan}, published=step)
        plan.training.start = start
        return plan, core.step_trained(state, plan, [rank(1.0, 1.0), rank(2.0, 3.0)], now=now,
                                       cfg=cfg, rollouts_at=lambda v: rollouts)

    plan, done = trained(1, now=104.0, start=101.0)
    assert (state.version, state.consumed[plan.batch_id]) == (2, 1)
    assert (done.wall, done.learner_start, done.checkpoint, done.publish) == (4.0, 101.0, True, True)
    assert [r.metrics["loss"] for r in done.results] == [1.0, 2.0]   # rank order
    _, done = trained(2, now=105.0)
    assert (done.checkpoint, done.publish) == (False, False)
    _, done = trained(3, now=106.0)
    assert (done.checkpoint, done.publish) == (True, False)          # the last step: no publish
    state.version = 1
    _, done = trained(1, now=107.0, rollouts=False, batch_id=9)   # version 2: no fresh rollout will use it
    assert (done.checkpoint, done.publish) == (True, False)


def test_rank_metrics_are_the_global_token_mean():
    out = LearnerResult.step_metrics([rank(1.0, 1.0, busy=2.0), rank(2.0, 3.0, busy=4.0)])
    assert out["loss"] == pytest.approx(1.75) and out["tokens"] == 4.0 and out["grad_norm"] == 1.5
    assert out["busy_s"] == pytest.approx(3.5)          # a metrics.parquet column, token-weighted
    assert set(out) == {"loss", "tokens", "grad_norm", "busy_s", "onpolicy_tokens",
                        "onpolicy_logprob_delta_mean", "onpolicy_logprob_delta_max", "onpolicy_s"}


def test_step_metrics_row():
    plan = plan_of(5, version=4)
    plan.start()
    for p in range(2):
        deliver(plan, p, nbytes=100 + p)
        plan.part_made(p, 1, PartReport(2, 6, RolloutStats(rounds=3, generated_tokens=6)), 0.0)
    plan.times = StageTimer({"rollout": 10.0, "teacher": 11.0}, {"rollout": 12.0, "teacher": 13.0},
                            Counter(rollout=4.0, teacher=1.0))
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


def test_a_step_on_a_reused_rollout_only_trains_and_consumes_no_batch(tiny_overrides):
    """`Step.reusing` (opd/distill/reuse.py): born sealed from its trained origin's plan, it makes
    nothing, trains once prefetched (its rollout is older than the published weights), counts a
    reuse of the origin instead of a batch, and its row says so: lag, no rollout, no bytes."""
    cfg = load_config("tiny", [*tiny_overrides, "distill.steps=4"])
    state = DriverState(version=0, end=4, last_step_end=100.0)
    origin = plan_of(0)
    origin.start()
    for p in range(2):
        deliver(origin, p)
        origin.part_made(p, 1, PartReport(2, 6, RolloutStats(rounds=3, generated_tokens=6)), 0.0)
    origin.seal()
    core.start_training(state, {0: origin}, published=0)
    core.step_trained(state, origin, [rank(1.0, 1.0)], now=101.0, cfg=cfg,
                      rollouts_at=lambda v: False)
    s = Step.reusing(origin, 2, gen=5, schedule="p")
    assert (s.step, s.origin, s.batch_id, s.version, s.gen, s.sealed) == (2, 0, 0, 0, 5, True)
    assert s.start() == [Trainable()] and not s.sealable      # nothing to make: it may train
    state.version = 2
    t = core.start_training(state, {2: s}, published=2)       # batch 0 trained: no error
    assert t is not None and t.prefetch and [c.piece for c in s.hand_out()] == [0, 1]
    done = core.step_trained(state, s, [rank(1.0, 1.0)], now=104.0, cfg=cfg,
                             rollouts_at=lambda v: False)
    assert (state.consumed, state.reused, state.version) == (Counter({0: 1}), Counter({0: 1}), 3)
    row = core.step_metrics(s, done, PoolCounts(1, 1, 1), sync_seconds=0.0, sync_bytes=0,
                            reissued=0)
    assert {k: row[k] for k in ("step", "batch_id", "policy_version", "policy_lag", "reused",
                                "delivered_bytes", "rounds", "rollout_s", "generated_tokens",
                                "rollout_wait", "published")} == {
        "step": 2, "batch_id": 0, "policy_version": 0, "policy_lag": 2, "reused": True,
        "delivered_bytes": 0, "rounds": 0, "rollout_s": 0.0, "generated_tokens": 12,
        "rollout_wait": 0.0, "published": False}


def test_the_planner_plans_a_reused_step_from_its_trained_origin_without_a_batch(tiny_overrides):
    """Seed 0 (opd/distill/reuse.py): steps 1 and 2 train on step 0's rollout.  Step 1 waits for
    step 0 to train, then is planned from its plan with no prefix batch drawn (the data cursor
    stays); step 0's plan leaves the buffer once step 2 used the rollout up."""
    from opd.data import PrefixBatcher
    from opd.data.splits import open_dataset
    cfg = load_config("tiny", [*tiny_overrides, "distill.steps=7", "distill.reuse=3",
                               "distill.reuse_buffer=2", "distill.reuse_fresh=0.3"])
    train = open_dataset(cfg, "train")
    planner = StepPlanner(cfg, PrefixBatcher(train, cfg.data.batch_size, cfg.run.seed),
                          train.seq_len, 0)
    first = planner.plan(0, 0, 7)
    assert (first.step, first.batch_id, first.origin) == (0, 0, None)
    assert planner.plan(0, 0, 7) is None                   # step 0 is not trained yet
    planner.finish(0, 1)
    assert planner.buffer == {0: first}
    one, two = planner.plan(1, 1, 7), planner.plan(1, 1, 7)
    assert [(s.step, s.origin, s.batch_id, s.version) for s in (one, two)] == [(1, 0, 0, 0),
                                                                               (2, 0, 0, 0)]
    assert planner.cursor[1] == planner.cursor[2] == planner.cursor[3]   # no batch drawn
    assert planner.plan(1, 1, 7) is None                   # step 3 is fresh: weights 3 first
    planner.finish(1, 2)
    planner.finish(2, 3)
    assert planner.buffer == {}
    three = planner.plan(3, 3, 7)
    assert (three.step, three.batch_id, three.origin) == (3, 1, None)


def test_the_planner_holds_the_queue_bound(tiny_overrides):
    """KD on data (no staleness bound): `distill.queue_capacity` steps are planned ahead of the
    learner, the next one once the learner's version moves up; the queue refuses nothing, so
    this is the only bound."""
    from opd.data import PrefixBatcher
    from opd.data.splits import open_dataset
    cfg = load_config("tiny", [*tiny_overrides, "distill.objective=kd", "distill.steps=7",
                               "distill.queue_capacity=3"])
    train = open_dataset(cfg, "train")
    planner = StepPlanner(cfg, PrefixBatcher(train, cfg.data.batch_size, cfg.run.seed),
                          train.seq_len, 0)
    assert [planner.plan(0, 0, 7).step for _ in range(3)] == [0, 1, 2]
    assert planner.plan(0, 0, 7) is None                   # 3 steps ahead of version 0
    assert planner.plan(1, 0, 7).step == 3 and planner.plan(1, 0, 7) is None


def test_only_the_versions_a_fresh_rollout_may_use_are_published(tiny_overrides):
    """`StepPlanner.rollouts_at`: a KD warm-up's versions and those that only reused steps follow
    are not published (no rollout loads them); a fresh student step's version is, and with
    staleness 1 the version before it too (the step may be made with either)."""
    from opd.data import PrefixBatcher
    from opd.data.splits import open_dataset

    def planner(*overrides):
        cfg = load_config("tiny", [*tiny_overrides, "distill.steps=7", *overrides])
        train = open_dataset(cfg, "train")
        return StepPlanner(cfg, PrefixBatcher(train, cfg.data.batch_size, cfg.run.seed),
                           train.seq_len, 0)

    warm = ("distill.phases=[{name: warm, steps: 3, objective: kd}, "
            "{name: student, objective: gkd, lam: 1.0}]")
    assert [planner(warm).rollouts_at(v) for v in range(7)] == [False] * 3 + [True] * 4
    assert ([planner(warm, "distill.staleness=1").rollouts_at(v) for v in range(7)]
            == [False] * 2 + [True] * 5)
    reused = planner("distill.objective=gkd", "distill.lam=1.0", "distill.reuse=3",
                     "distill.reuse_buffer=2", "distill.reuse_fresh=0.3")
    assert [reused.reuse.origin(s) for s in range(4)] == [0, 0, 0, 3]   # seed 0: as above
    assert [reused.rollouts_at(v) for v in range(4)] == [True, False, False, True]
