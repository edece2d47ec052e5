"""The driver's re-issue of a failed rollout part (no Ray: fake actors record what is submitted).

With distill.staleness k > 0 a step's plan may be generated at an older version than the one
published since.  Rollout workers hold only the published version, so a part that failed
(StaleWeightsError, or a worker that died and reloaded the published weights) cannot be
generated at the plan's old version again: the whole plan is re-planned at the published
version as a new generation, and answers still in flight for the old generation are dropped.
"""
import torch

from actors.cluster import ActorGroups
from actors.dispatch import Dispatcher
from actors.pipeline import Pipeline
from actors.planner import StepPlanner
from actors.publisher import WeightPublisher
from actors.shards import split_job
from actors.tasks import PartReport, StepPlan, Task, TaskKind
from actors.weights import PublishedWeights
from opd.steps import RolloutJob

ROLLOUT = TaskKind.ROLLOUT


class FakeMethod:
    def __init__(self, calls: list, name: str):
        self.calls, self.name = calls, name

    def remote(self, *args):
        ref = object()                       # stands in for an ObjectRef
        self.calls.append((self.name, ref, *args))
        return ref


class FakeRolloutWorker:
    def __init__(self):
        self.calls: list = []
        self.generate = FakeMethod(self.calls, "generate")


def pipeline_at(plan_version: int, published: int) -> tuple[Pipeline, FakeRolloutWorker, StepPlan]:
    """A driver whose step 3 is planned at `plan_version` (generation 0) in two parts, with
    `published` the version the workers hold; part 0 has already been generated."""
    p = Pipeline.__new__(Pipeline)
    worker = FakeRolloutWorker()
    p.groups = ActorGroups(rollout=[worker])
    p.hooks, p.reissued, p.scores = {}, 0, True
    p.dispatch = Dispatcher(None, p.groups, p._hook)
    p.publisher = WeightPublisher.__new__(WeightPublisher)
    p.publisher.published = PublishedWeights(published, None)
    p.planner = StepPlanner.__new__(StepPlanner)
    p.planner._gens = iter(range(1, 100))
    job = RolloutJob(7, torch.arange(4), torch.zeros(4, 6, dtype=torch.int64), 3, "student", 0)
    plan = StepPlan(3, 7, "student", plan_version, split_job(job, 2), gen=0)
    plan.generated[0] = PartReport(2, 6, {}, 0)
    p.planner.plans = {3: plan}
    return p, worker, plan


def generated(worker) -> list:
    """(labels, version) of each generate call (args: job, version, tag, queue)."""
    return [(c[2].labels.tolist(), c[3]) for c in worker.calls]


def test_failed_part_of_an_older_plan_is_replanned_at_the_published_version():
    p, worker, plan = pipeline_at(plan_version=2, published=3)
    p._again(Task(ROLLOUT, "rollout", step=3, part=1, worker=0, version=2, gen=0))
    assert (plan.version, plan.gen) == (3, 1)
    assert plan.generated == {}
    assert generated(worker) == [([0, 1], 3), ([2, 3], 3)]
    assert p.reissued == 2
    assert sorted((t.part, t.version, t.gen) for t in p.dispatch.tasks.values()) == [(0, 3, 1), (1, 3, 1)]


def test_answers_for_the_old_plan_are_dropped():
    p, worker, plan = pipeline_at(plan_version=2, published=3)
    p._again(Task(ROLLOUT, "rollout", step=3, part=1, worker=0, version=2, gen=0))
    p._on_done(Task(ROLLOUT, "rollout", step=3, part=1, worker=0, version=2, gen=0), "old ref",
               PartReport(2, 6, {}, 0))
    assert plan.generated == {}
    p._again(Task(ROLLOUT, "rollout", step=3, part=0, worker=0, version=2, gen=0))  # re-planned
    assert len(worker.calls) == 2


def test_failed_part_of_a_current_plan_goes_again_alone():
    p, worker, plan = pipeline_at(plan_version=3, published=3)
    p._again(Task(ROLLOUT, "rollout", step=3, part=1, worker=0, version=3, gen=0))
    assert (plan.version, plan.gen) == (3, 0) and list(plan.generated) == [0]
    assert generated(worker) == [([2, 3], 3)]
    assert p.reissued == 1
