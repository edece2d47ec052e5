"""Actors are named by role and index in a namespace of the run's own, and their repr says role
and policy version (what the Ray dashboard's Actors page shows in its Name and Repr columns)."""
import time

import ray

from actors.driver.cluster import ActorGroups, run_namespace
from actors.workers.base import actor_name
from opd.config.schema import load_config


def test_names_and_namespaces():
    assert [actor_name("rollout", 0), actor_name("teacher", 1), actor_name("learner", 1),
            actor_name("queue"), actor_name("evaluation")] == \
        ["opd/rollout/0", "opd/teacher/1", "opd/learner/1", "opd/queue", "opd/eval"]
    a, b = run_namespace("runs/tiny-1"), run_namespace("runs/tiny-1")
    assert a != b                                        # two starts of one run never collide
    assert a.startswith("opd-tiny-1-") and len(a) == len("opd-tiny-1-") + 8


def info(name: str, namespace: str) -> dict:
    return ray.get(ray.get_actor(name, namespace=namespace).info.remote())


def test_actors_carry_names_and_reprs_with_their_version(ray_session, tiny_overrides, tmp_path):
    cfg = load_config("tiny", [*tiny_overrides, "rollout.num_workers=2",
                               "eval.track=false", "rollout.num_cpus=0.25",
                               "teacher.num_cpus=0.25", "learner.num_cpus=0.25"])
    groups = ActorGroups.start(cfg, tmp_path / "run-a")
    other = None
    try:
        ns = groups.namespace
        assert ns.startswith("opd-run-a-")
        assert {n: info(n, ns)["repr"] for n in
                ["opd/rollout/0", "opd/rollout/1", "opd/teacher/default/0", "opd/learner/0",
                 "opd/queue"]} == {
            "opd/rollout/0": "RolloutWorker(opd/rollout/0, version=None)",
            "opd/rollout/1": "RolloutWorker(opd/rollout/1, version=None)",
            "opd/teacher/default/0": "TeacherWorker(opd/teacher/default/0, version=None)",
            "opd/learner/0": "StudentLearner(opd/learner/0, version=0)",
            "opd/queue": "TrajectoryQueue(opd/queue, version=None, depth=0)"}

        calls = [a.publish_weights.remote(0) for a in groups.learners]
        ray.get([a.load_weights.remote(0, calls[0][0]) for a in groups.rollout])
        assert info("opd/rollout/1", ns)["repr"] == "RolloutWorker(opd/rollout/1, version=0)"

        # a worker Ray restarts after a fault keeps its name (and holds no weights yet)
        first = ray.get_actor("opd/rollout/0", namespace=ns)._actor_id
        ray.kill(groups.rollout[0], no_restart=False)
        restarted = None
        for _ in range(600):    # ray.kill is asynchronous: the old process may answer first
            try:
                restarted = info("opd/rollout/0", ns)
                if restarted["repr"].endswith("version=None)"):
                    break
            except ray.exceptions.RayActorError:    # restarting: unavailable for a moment
                pass
            time.sleep(0.5)
        assert restarted["repr"] == "RolloutWorker(opd/rollout/0, version=None)"
        assert ray.get_actor("opd/rollout/0", namespace=ns)._actor_id == first

        # a second run in the same cluster starts beside this one without a name collision
        other = ActorGroups.start(load_config("tiny", [*tiny_overrides, "eval.track=false",
                                                       "rollout.num_cpus=0.25",
                                                       "teacher.num_cpus=0.25",
                                                       "learner.num_cpus=0.25"]),
                                  tmp_path / "run-a")
        assert other.namespace != ns
        assert info("opd/rollout/0", other.namespace)["repr"] == \
            "RolloutWorker(opd/rollout/0, version=None)"
    finally:
        groups.shutdown()
        if other is not None:
            other.shutdown()
