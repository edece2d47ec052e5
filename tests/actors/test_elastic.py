"""Elastic rollout workers: rollout.num_workers="1..3" grows when a node brings resources.

A two-node Ray cluster on 127.0.0.1 (`ray.cluster_utils.Cluster`, Ray's own test helper) in a
subprocess with its own driver and temp dir (the session's Ray, and other Ray instances on
this machine, are untouched).  The head has one `opd_rollout` resource, so the run starts with
one worker and cannot grow; after step ADD_AT a second node joins with two more, and the
driver adds workers mid-run, without a restart.  Strict on-policy, greedy: the losses equal
the single-process reference and every batch id is consumed once (invariants 5 and 7).
Retiring (on the session's local Ray): an added worker left idle is killed, down to min.
The two-node run is marked slow; the retire run, which grows first, is in the default run.

The runs do not depend on how fast the machine is: the policy's wait is the `rollout_wait` that
their after_step hook writes into the step's row (1.0 = the learner waited all step, 0.0 = not
at all) over the measured one (the pipeline calls the hook before the policy reads the row), and `settle` holds a step until a worker being
added has its bundle and its weights, so the pool grows within a bounded number of steps however slowly workers
start.  The measurement (`actors.driver.core.rollout_wait_fraction`) and the decisions (`after_step`
on fake groups, dispatcher and publisher) are tested on their own below, with made-up numbers.

The file is also the subprocess's script: `python test_elastic.py ARGS_JSON`.

Over 400 lines: the two-node subprocess script and the tests of the decisions it exercises
share their fakes and constants; split, each half would have to import the other.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

STEPS = 40             # the grow run (a node joins)
RETIRE_STEPS = 10      # the retire run: grown by step 3, retired 2 idle steps later
ADD_AT = 2
LOSS_TOL = 1e-5


def overrides(digits_dir, *extra) -> list[str]:
    return [f"data.data_dir={digits_dir}", f"distill.steps={STEPS}", "rollout.gamma=2",
            "rollout.decoding=greedy", "run.checkpoint_every=0", "rollout.num_cpus=0.5",
            "teacher.num_cpus=0.5", "learner.num_cpus=0.5", *extra]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settle(pipeline) -> None:
    """Called from an after_step hook: wait until a placement group the policy asked for is
    ready and a worker it started has answered its weights load (actor calls run in order, so
    `info` answers after `load_weights`).  The event loop then sees both at once, so the pool
    grows within a few steps however slowly a worker starts."""
    import ray
    elastic = pipeline.elastic
    if elastic.placing:
        ray.get(list(elastic.placing), timeout=300)
    for i in pipeline.pools["rollout"].starting():
        ray.get(pipeline.rollout[i].info.remote(), timeout=300)


def drive(args: dict) -> None:
    """The subprocess: start the cluster, run, add a node after step ADD_AT, write the rows."""
    import ray
    from ray.cluster_utils import Cluster

    from actors.driver.pipeline import run_distributed
    from opd.config.schema import load_config

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "include_dashboard": False, "dashboard_agent_listen_port": free_port(),
        "resources": {"opd_learner": 1, "opd_teacher": 1, "opd_rollout": 1}})
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cfg = load_config("tiny", overrides(args["digits"], f"cluster.address={cluster.address}",
                                            "cluster.role_resources=true", "rollout.num_workers=1..3",
                                            "rollout.elastic_patience=1"))

        def add_node(pipeline, step, row):
            if step == ADD_AT:
                cluster.add_node(num_cpus=1, resources={"opd_rollout": 2})
            settle(pipeline)
            row["rollout_wait"] = 1.0          # the pool reads: the learner waited all along

        rows = run_distributed(cfg, args["run_dir"], progress=False,
                               hooks={"after_step": add_node})
        Path(args["out"]).write_text(json.dumps(rows))
    finally:
        ray.shutdown()
        for n in list(cluster.worker_nodes):        # only this cluster's processes
            cluster.remove_node(n)
        if cluster.head_node is not None:
            cluster.remove_node(cluster.head_node)


@pytest.fixture(scope="module")
def elastic_run(tiny_overrides, digits_dir, opd_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("elastic")
    temp = tempfile.mkdtemp(prefix="opde", dir="/tmp")       # short: Ray's socket paths
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": temp, "OMP_NUM_THREADS": "1",
           "OPD_CACHE": str(opd_cache)}
    env.pop("RAY_ADDRESS", None)
    args = {"digits": str(digits_dir), "run_dir": str(out / "run"), "out": str(out / "rows.json")}
    try:
        proc = subprocess.run([sys.executable, __file__, json.dumps(args)], env=env, timeout=600,
                              capture_output=True, text=True)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "rows.json").read_text()), out / "run"


@pytest.mark.slow   # grows mid-run (on the session's Ray): test_idle_added_worker_is_retired_down_to_min
def test_rollout_workers_grow_mid_run_when_a_node_joins(elastic_run):
    rows, run_dir = elastic_run
    workers = [r["rollout_workers"] for r in rows]
    assert workers[:ADD_AT + 1] == [1] * (ADD_AT + 1)       # no room for a second one before
    assert max(workers) == 3, workers                        # the new node's two, mid-run
    assert workers == sorted(workers)                        # nothing retired: never idle
    record = json.loads((run_dir / "consumed.json").read_text())
    assert record["consumed"] == {str(b): 1 for b in range(STEPS)}
    events = record["rollout_workers"]["events"]
    assert record["rollout_workers"]["added"] == 2
    assert [e["event"] for e in events if e["event"] != "request"] == ["place", "add"] * 2
    assert all(e["step"] >= ADD_AT for e in events if e["event"] == "place")


def reference(digits_dir, tmp_path, steps: int) -> list[dict]:
    from opd.config.schema import load_config
    from opd.run.reference import run_reference
    return run_reference(load_config("tiny", overrides(digits_dir, f"distill.steps={steps}")),
                         tmp_path / "ref", progress=False)


@pytest.mark.slow   # an elastic run equal to the reference: test_idle_added_worker_is_retired_down_to_min
def test_elastic_run_equals_the_reference(elastic_run, digits_dir, tmp_path):
    rows, _ = elastic_run
    ref = reference(digits_dir, tmp_path, STEPS)
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref], rel=0,
                                                      abs=LOSS_TOL)
    assert [r["rounds"] for r in rows] == [r["rounds"] for r in ref]          # the same tokens
    assert [(r["step"], r["batch_id"], r["policy_lag"]) for r in rows] == \
        [(k, k, 0) for k in range(STEPS)]


def test_idle_added_worker_is_retired_down_to_min(ray_session, digits_dir, tmp_path):
    """Grow to 2 on the session's local Ray (the wait says 1.0), then every step is idle
    (0.0 from the step whose row first shows 2 workers up): after elastic_idle_steps=2 idle
    steps the added worker is retired and killed."""
    from actors.driver.pipeline import run_distributed
    from opd.config.schema import load_config
    seen = {}

    def idle_from_now(pipeline, step, row):
        settle(pipeline)
        if row["rollout_workers"] == 2 and "switched" not in seen:
            seen["switched"] = step
        if step == RETIRE_STEPS - 1:
            seen["states"] = list(pipeline.pools["rollout"].state)
            with pytest.raises(ray_session.exceptions.RayActorError):
                ray_session.get(pipeline.rollout[1].info.remote(), timeout=30)
        row["rollout_wait"] = 0.0 if "switched" in seen else 1.0      # what the pool reads

    cfg = load_config("tiny", overrides(digits_dir, f"distill.steps={RETIRE_STEPS}",
                                        "rollout.num_workers=1..2", "rollout.elastic_patience=1",
                                        "rollout.elastic_idle_steps=2"))
    rows = run_distributed(cfg, tmp_path / "run", progress=False,
                           hooks={"after_step": idle_from_now})
    workers = [r["rollout_workers"] for r in rows]
    k = seen["switched"]
    # placed after step 0 (wait 1.0, patience 1); settle: its bundle by step 1's hook and its
    # weights by step 2's, so it is up in row 3 at the latest
    assert 1 <= k <= 3, workers
    # idle after k and k+1: retired after step k+1 (strict on-policy: it has nothing in flight
    # between its rollout of a step and the next step's weights)
    assert workers == [1] * k + [2, 2] + [1] * (RETIRE_STEPS - k - 2), workers
    assert seen["states"] == ["up", "retired"]
    record = json.loads((tmp_path / "run" / "consumed.json").read_text())
    events = record["rollout_workers"]["events"]
    assert [(e["event"], e["workers"]) for e in events] == [("place", 2), ("add", 2), ("retire", 1)]
    assert events[0]["step"] == 0 and events[2]["step"] == k + 1, events
    assert record["consumed"] == {str(b): 1 for b in range(RETIRE_STEPS)}
    ref = reference(digits_dir, tmp_path, RETIRE_STEPS)
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref], rel=0,
                                                      abs=LOSS_TOL)


def test_elastic_config_is_checked_before_anything_starts(tiny_overrides):
    from actors.driver.cluster import check_distributed, pool_size
    from opd.config.schema import load_config
    from opd.config.loader import ConfigError
    cfg = load_config("tiny", [*tiny_overrides, "rollout.num_workers=2..5"])
    assert pool_size(cfg.rollout.num_workers) == 2
    with pytest.raises(ConfigError, match="learner.weight_sync='collective'"):
        check_distributed(load_config("tiny", [*tiny_overrides, "rollout.num_workers=1..2",
                                               "learner.weight_sync=collective"]))
    with pytest.raises(ConfigError, match="elastic_shrink_wait=0.6 must be below"):
        check_distributed(load_config("tiny", [*tiny_overrides, "rollout.num_workers=1..2",
                                               "rollout.elastic_shrink_wait=0.6"]))
    check_distributed(load_config("tiny", [*tiny_overrides, "rollout.num_workers=2",
                                           "rollout.elastic_shrink_wait=0.6"]))  # fixed: unused


# -- the measurement and the decisions, without Ray or timing ---------------------------------


def test_rollout_wait_fraction_from_made_up_timestamps():
    from actors.driver.core import rollout_wait_fraction as f
    # learner free at 11, rollouts issued at 10 and done at 13, training from 14, step wall 4
    assert f("student", issued=10.0, rollout_done=13.0, learner_free=11.0, train_start=14.0,
             wall=4.0) == 0.5
    # issued after the learner was free: the wait starts at the issue
    assert f("student", issued=12.0, rollout_done=13.0, learner_free=11.0, train_start=14.0,
             wall=4.0) == 0.25
    # the wait ends when the rollouts are done (scoring after them is not rollout wait) ...
    assert f("student", issued=10.0, rollout_done=14.0, learner_free=11.0, train_start=15.0,
             wall=4.0) == 0.75
    # ... and at the latest when training starts
    assert f("student", issued=10.0, rollout_done=15.0, learner_free=11.0, train_start=14.0,
             wall=4.0) == 0.75
    # rollouts done before the learner was free (issued ahead): no wait
    assert f("student", issued=10.0, rollout_done=10.5, learner_free=11.0, train_start=14.0,
             wall=4.0) == 0.0
    # the whole step waiting on rollouts
    assert f("student", issued=11.0, rollout_done=15.0, learner_free=11.0, train_start=15.0,
             wall=4.0) == 1.0
    # teacher or data batches are not student rollouts; an empty step waits on nothing
    for source in ("teacher", "data"):
        assert f(source, issued=10.0, rollout_done=13.0, learner_free=11.0, train_start=14.0,
                 wall=4.0) == 0.0
    assert f("student", issued=10.0, rollout_done=13.0, learner_free=11.0, train_start=14.0,
             wall=0.0) == 0.0


class FakeGroup:
    def ready(self):
        return object()                          # stands for the placement group's ready ref


class FakeGroups:
    def __init__(self):
        self.removed = []

    def new_group(self, need):
        return FakeGroup()

    def new_rollout_worker(self, cfg, pg, index):
        return f"rollout-{index}"

    def remove_group(self, pg):
        self.removed.append(pg)


class FakeDispatch:
    """What ElasticRollout uses of actors.driver.dispatch.Dispatcher: the rollout pool, `track`."""

    def __init__(self, workers: int):
        from actors.driver.pool import WorkerPool
        self.pools = {"rollout": WorkerPool("rollout", [f"rollout-{i}" for i in range(workers)])}
        self.tracked: dict = {}

    def track(self, ref, task):
        self.tracked[ref] = task.kind


class FakePublisher:
    """What ElasticRollout uses of actors.driver.publisher.WeightPublisher: `load` (a new worker's
    weights)."""

    def __init__(self):
        self.loads: list[int] = []

    def load(self, i):
        self.loads.append(i)


@pytest.fixture
def policy(tiny_overrides, monkeypatch):
    """`policy(lo, hi, *overrides)`: an ElasticRollout on fake groups, dispatcher and publisher
    with `lo` workers up;
    the cluster has room (`room["free"]`) and `ray.kill` only records."""
    import actors.driver.elastic as elastic
    from opd.config.schema import load_config
    room, killed = {"free": True}, []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)          # not joining a cluster
    monkeypatch.setattr(elastic.ray, "available_resources",
                        lambda: {"CPU": 100.0} if room["free"] else {})
    monkeypatch.setattr(elastic.ray, "kill", lambda actor, no_restart: killed.append(actor))

    def make(lo, hi, *extra):
        cfg = load_config("tiny", [*tiny_overrides, f"rollout.num_workers={lo}..{hi}",
                                   "rollout.elastic_grow_wait=0.5",
                                   "rollout.elastic_shrink_wait=0.1", *extra])
        e = elastic.ElasticRollout.for_run(cfg, FakeGroups(), FakeDispatch(lo), FakePublisher())
        e.room, e.killed = room, killed
        return e
    return make


def steps(e, waits):
    """Run after_step for the next steps, one per wait (rows that measured those waits)."""
    for s, w in enumerate(waits, e.step + 1):
        e.after_step(s, {"rollout_wait": w})


def events(e):
    return [(x["step"], x["event"], x["workers"]) for x in e.events]


def placed(e):
    """The placement group the policy asked for is ready: its worker starts, weights first."""
    (ref,) = e.placing
    e.placed(ref)
    i = len(e.pool) - 1
    assert e.pool.state[i] == "starting" and e.publisher.loads[-1] == i


def bring_up(e):
    """Placed, and the new worker answered its weights load."""
    placed(e)
    e.pool.started(len(e.pool) - 1)


def test_grows_after_patience_steps_at_or_over_the_grow_wait(policy):
    e = policy(1, 3, "rollout.elastic_patience=3")
    steps(e, [0.9, 0.5, 0.49, 0.5, 1.0])         # 0.49 breaks the streak: 2 in a row at most
    assert events(e) == [] and not e.placing
    steps(e, [0.5])                               # the third in a row (0.5 counts: >=)
    assert events(e) == [(5, "place", 2)]
    assert list(e.dispatch.tracked.values()) == ["place"]
    steps(e, [1.0] * 3)                          # placing: one worker at a time
    placed(e)
    steps(e, [1.0] * 3)                          # starting: still one at a time
    assert events(e) == [(5, "place", 2), (8, "add", 2)] and e.workers() == 2
    e.pool.started(1)
    steps(e, [1.0])                               # the streak went on: the next one at once
    assert events(e)[-1] == (12, "place", 3)
    bring_up(e)
    steps(e, [1.0] * 10)                          # at max: never above
    assert e.workers() == 3 and [x[1] for x in events(e)] == ["place", "add"] * 2
    assert not e.placing


def test_no_room_no_worker_and_no_autoscaler_off_cluster(policy):
    e = policy(1, 2, "rollout.elastic_patience=1")
    e.room["free"] = False
    steps(e, [1.0] * 3)
    assert events(e) == [] and not e.placing and e.requested == 0
    e.room["free"] = True
    steps(e, [1.0])
    assert events(e) == [(3, "place", 2)]


def test_retires_an_idle_added_worker_after_idle_steps_never_below_min(policy):
    e = policy(1, 2, "rollout.elastic_patience=1", "rollout.elastic_idle_steps=3")
    steps(e, [1.0])
    bring_up(e)
    steps(e, [0.0, 0.0, 0.1, 0.05, 0.0])         # 0.1 is not below shrink_wait: streak broken
    assert [x[1] for x in events(e)] == ["place", "add"] and e.workers() == 2
    e.pool.busy[1] += 1                           # a job in flight: wanted, not yet retired
    steps(e, [0.0])
    assert e.retire_wanted == 1 and e.workers() == 2 and e.killed == []
    e.pool.busy[1] -= 1
    e.tick()                                      # the driver's next dispatch
    assert events(e)[-1] == (6, "retire", 1)
    assert e.pool.state == ["up", "retired"] and e.killed == ["rollout-1"]
    assert len(e.groups.removed) == 1 and e.added == {}
    steps(e, [0.0] * 10)                          # at min: the first worker is never retired
    assert e.pool.state == ["up", "retired"] and e.retire_wanted == 0
    assert [x[1] for x in events(e)] == ["place", "add", "retire"]


def test_autoscaler_request_follows_the_pool_and_is_withdrawn_when_idle(policy, monkeypatch):
    """On a cluster it joined, the policy asks the autoscaler for room it lacks, lowers the
    request when it retires a worker, and withdraws room it asked for and no longer wants
    (idle before the node came): else the autoscaler would keep that node for the whole run."""
    import ray.autoscaler.sdk as sdk

    import actors.driver.elastic as elastic
    asked = []                                    # rollout bundles of each request
    monkeypatch.setattr(sdk, "request_resources", lambda bundles: asked.append(
        sum("opd_rollout" in b for b in bundles)))
    e = policy(1, 3, "rollout.elastic_patience=1", "rollout.elastic_idle_steps=2",
               "cluster.role_resources=true")
    e.autoscale = True                            # as for cluster.address / RAY_ADDRESS
    monkeypatch.setattr(elastic.ray, "available_resources",      # room for an opd_rollout
                        lambda: {"CPU": 100.0, "opd_rollout": 1.0} if e.room["free"] else {})
    e.room["free"] = False
    steps(e, [1.0, 1.0])                          # no room: asked for, once
    assert asked == [2] and events(e) == [(0, "request", 2)]
    e.room["free"] = True                         # the node came: placed, no new request
    steps(e, [1.0])
    bring_up(e)
    e.room["free"] = False
    steps(e, [1.0])                               # a third worker: asked for
    assert asked == [2, 3] and events(e)[-1] == (3, "request", 3)
    steps(e, [0.0, 0.0])                          # idle before its node came: the added
    assert e.pool.state == ["up", "retired"]      # worker retired, the request lowered to 1
    assert asked == [2, 3, 1] and e.requested == 1
    assert events(e)[-2:] == [(5, "retire", 1), (5, "request", 1)]
    e.room["free"] = False
    steps(e, [1.0])                               # waiting again: asked for again
    assert asked == [2, 3, 1, 2]
    steps(e, [0.0, 0.0])                          # idle at min before the node came: the
    assert asked == [2, 3, 1, 2, 1]               # room asked for is withdrawn
    assert events(e)[-1] == (8, "request", 1) and e.requested == 1
    steps(e, [0.0] * 5)                           # nothing more to withdraw
    assert asked == [2, 3, 1, 2, 1] and e.pool.state == ["up", "retired"]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    drive(json.loads(sys.argv[1]))
