"""The driver's re-issue of a failed rollout part (no Ray: fake actors record what is submitted).

With distill.staleness k > 0 a step's plan may be generated at an older version than the one
published since.  Rollout workers hold only the published version, so a part that failed
(StaleWeightsError, or a worker that died and reloaded the published weights) cannot be
generated at the plan's old version again: the whole plan is re-planned at the published
version, and answers still in flight for the old plan are dropped.
"""
import torch

from actors.cluster import ActorGroups
from actors.pipeline import Pipeline, StepPlan, Task
from actors.pool import WorkerPool
from actors.shards import split_job
from actors.weights import PublishedWeights
from opd.steps import RolloutJob


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
    """A driver whose step 3 is planned at `plan_version` in two parts, with `published` the
    version the workers hold; part 0 has already been generated."""
    p = Pipeline.__new__(Pipeline)
    worker = FakeRolloutWorker()
    p.groups = ActorGroups(rollout=[worker])
    p.pools = {"rollout": WorkerPool("rollout", p.groups.rollout)}
    p.hooks, p.backlog, p.tasks, p.reissued, p.scores = {}, [], {}, 0, True
    p.published = PublishedWeights(published, None)
    job = RolloutJob(7, torch.arange(4), torch.zeros(4, 6, dtype=torch.int64), 3, "student", 0)
    plan = StepPlan(3, 7, "student", plan_version, split_job(job, 2))
    plan.trajs[0] = "part 0 at the old version"
    p.plans = {3: plan}
    return p, worker, plan


def test_failed_part_of_an_older_plan_is_replanned_at_the_published_version():
    p, worker, plan = pipeline_at(plan_version=2, published=3)
    p._again(Task("rollout", "rollout", step=3, part=1, worker=0, version=2))
    assert plan.version == 3
    assert plan.trajs == {}
    submitted = [(c[0], c[2].labels.tolist(), c[3]) for c in worker.calls]
    assert submitted == [("generate", [0, 1], 3), ("generate", [2, 3], 3)]
    assert p.reissued == 2
    assert sorted((t.part, t.version) for t in p.tasks.values()) == [(0, 3), (1, 3)]


def test_answers_for_the_old_plan_are_dropped():
    p, worker, plan = pipeline_at(plan_version=2, published=3)
    p._again(Task("rollout", "rollout", step=3, part=1, worker=0, version=2))
    p._on_done(Task("rollout", "rollout", step=3, part=1, worker=0, version=2), "old ref", None)
    assert plan.trajs == {}
    p._again(Task("rollout", "rollout", step=3, part=0, worker=0, version=2))   # re-planned already
    assert len(worker.calls) == 2


def test_failed_part_of_a_current_plan_goes_again_alone():
    p, worker, plan = pipeline_at(plan_version=3, published=3)
    p._again(Task("rollout", "rollout", step=3, part=1, worker=0, version=3))
    assert plan.version == 3 and plan.trajs == {0: "part 0 at the old version"}
    assert [(c[2].labels.tolist(), c[3]) for c in worker.calls] == [([2, 3], 3)]
    assert p.reissued == 1
