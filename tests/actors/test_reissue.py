"""The driver's re-issue of a failed rollout part, as the pure decisions of actors/driver/core.py (no
Ray, no pipeline).

With distill.staleness k > 0 a step's plan may be generated at an older version than the one
published since.  Rollout workers hold only the published version, so a part that failed
(StaleWeightsError, or a worker that died and reloaded the published weights) cannot be
generated at the plan's old version again: the whole plan is re-planned at the published
version as a new generation, and answers still in flight for the old generation are dropped.
"""
import torch

from actors.driver import core
from actors.driver.core import Retry
from actors.driver.planner import StepPlanner
from actors.driver.tasks import StepPlan, Task, TaskKind
from actors.transport.delivery import PartReport
from opd.distill.rollout_stats import RolloutStats
from opd.distill.pieces import piece_rows, split_job
from opd.distill.steps import RolloutJob

ROLLOUT = TaskKind.ROLLOUT


def planned(plan_version: int) -> tuple[StepPlanner, StepPlan]:
    """A planner whose step 3 is planned at `plan_version` (generation 0) in two parts; part 0
    has already been generated."""
    planner = StepPlanner.__new__(StepPlanner)       # no data: the plan is made by hand
    planner._gens = iter(range(1, 100))
    job = RolloutJob(7, torch.arange(4), torch.zeros(4, 6, dtype=torch.int64), 3, "student", 0)
    plan = StepPlan(3, 7, "student", plan_version, split_job(job, piece_rows(int(job.labels.shape[0]), 1, 2)), gen=0)
    plan.generated[0] = PartReport(2, 6, RolloutStats(), 0)
    planner.plans = {3: plan}
    return planner, plan


def failed(part: int, version: int, gen: int = 0) -> Task:
    return Task(ROLLOUT, "rollout", step=3, part=part, worker=0, version=version, gen=gen)


def test_failed_part_of_an_older_plan_is_replanned_at_the_published_version():
    planner, plan = planned(plan_version=2)
    task = failed(1, version=2)
    assert core.retry(task, planner.current(3, 0), published=3) is Retry.REPLAN
    planner.replan(plan, core.replan_version(plan, published=3))
    assert (plan.version, plan.gen) == (3, 1)
    assert plan.generated == {} and plan.delivered == {} and not plan.sealed


def test_answers_for_the_old_plan_are_dropped():
    planner, plan = planned(plan_version=2)
    planner.replan(plan, core.replan_version(plan, published=3))
    assert planner.current(3, 0) is None             # an answer of generation 0: dropped
    assert core.retry(failed(0, version=2), planner.current(3, 0), published=3) is Retry.DROP
    assert planner.current(3, 1) is plan


def test_failed_part_of_a_current_plan_goes_again_alone():
    planner, plan = planned(plan_version=3)
    assert core.retry(failed(1, version=3), planner.current(3, 0), published=3) is Retry.AGAIN
    assert (plan.version, plan.gen) == (3, 0) and list(plan.generated) == [0]


def test_other_sources_go_again_at_their_own_version():
    planner, plan = planned(plan_version=2)
    plan.source = "data"
    assert core.retry(failed(1, version=2), plan, published=3) is Retry.AGAIN
    assert core.replan_version(plan, published=3) == 2
    score = Task(TaskKind.SCORE, "teacher", step=3, part=1, version=2, gen=0)
    plan.source = "student"
    assert core.retry(score, plan, published=3) is Retry.AGAIN   # the part exists: score again
