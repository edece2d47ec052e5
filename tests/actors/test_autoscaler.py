"""Rollout nodes from Ray's own autoscaler: an elastic run on the fake multi-node provider.

    python -m pytest -m slow tests/actors/test_autoscaler.py -s      # minutes; prints the figures

The cluster (tests/actors/autoscaling_cluster.py, in a subprocess with its own driver and
temp dir): a head with the learner's and the teacher's resources (`opd_learner`,
`opd_teacher`) and no `opd_rollout`, and a `rollout` node type (`opd_rollout: 1`, at most 2
nodes) that exists only when the autoscaler starts it, and goes back after
IDLE_TIMEOUT_MIN idle.  The run: configs/tiny.yaml, `cluster.address=` the head,
`cluster.role_resources=true`, `rollout.num_workers=1..2`, strict on-policy and greedy, so
the losses equal the single-process reference (invariants 5 and 7).  In this order:

    a. the run's first rollout worker asks for `opd_rollout`: the autoscaler launches the
       first rollout node for it (none before the run), and the worker runs there;
    b. rollouts hold the run up (the row's `rollout_wait` says 1.0): the policy asks the
       autoscaler for a second worker's bundle (`request_resources`), the autoscaler
       launches a second node, the new worker runs there;
    c. then every step is idle (0.0): the policy retires the added worker and lowers its
       request, and the autoscaler terminates the idle node after the idle timeout, while
       the run goes on on the first node;
    d. every batch id is consumed once, and the losses are the reference's.

Nothing depends on how fast the machine is: the wait signal comes from the hook, and the
after_step hook holds the run while the autoscaler acts (a node to come up, a node to go
back) with generous timeouts, so each happens at a known step.  The times (seconds from the
run's start) are printed; node times come from polling the GCS every 0.2 s.

The file is also the subprocess's script: `python test_autoscaler.py ARGS_JSON`.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
IDLE_TIMEOUT_MIN = 0.1                  # the autoscaler's idle_timeout_minutes (6 s)
WAIT_S = 300.0                          # for a node to come up or go back (generous)
LOSS_TOL = 1e-5
QUIET_S = 5.0                           # before the run: five autoscaler updates, no node


def overrides(digits_dir, *extra) -> list[str]:
    # rollout.num_cpus=1 fills a rollout node (CPU 1): nothing else is placed there
    return [f"data.data_dir={digits_dir}", f"distill.steps={STEPS}", "rollout.gamma=2",
            "rollout.decoding=greedy", "run.checkpoint_every=0", "rollout.num_cpus=1",
            "teacher.num_cpus=0.5", "learner.num_cpus=0.5", *extra]


class NodeWatch(threading.Thread):
    """Polls the GCS: when each node with `opd_rollout` was first seen alive (`up`) and
    first seen dead or gone (`down`), time.monotonic() seconds."""

    def __init__(self):
        super().__init__(daemon=True)
        self.up: dict[str, float] = {}
        self.down: dict[str, float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        import ray
        while not self.done.is_set():
            now = time.monotonic()
            alive = set(rollout_nodes(ray))
            for n in alive - self.up.keys():
                self.up[n] = now
            for n in self.up.keys() - alive - self.down.keys():
                self.down[n] = now
            time.sleep(0.2)


def rollout_nodes(ray) -> list[str]:
    """The alive nodes that have an `opd_rollout` resource, by id."""
    return [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("opd_rollout")]


ACTION = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}).*?"
                    r"(Queue \d+ new nodes for launch|Launching \d+ nodes, type \S+|"
                    r"Terminating the node with id \w+).*?(\(\w+\))?$")


def autoscaler_actions(log: str, t0_wall: float) -> list[list]:
    """[seconds from the run's start, what] for each launch decision, launch and termination
    in the monitor's log ("Queue 1 new nodes for launch", then "Launching 1 nodes, type
    rollout." once the node is started; "Terminating the node with id ID (idle)")."""
    found = []
    for line in log.splitlines():
        if m := ACTION.match(line):
            when = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp() - t0_wall
            found.append([when, " ".join(x for x in m.groups()[1:] if x)])
    return found


def drive(args: dict) -> None:
    """The subprocess: start the cluster, wait QUIET_S, run, write what happened."""
    import ray

    from actors.driver.cluster import fits, role_bundle
    from actors.driver.pipeline import run_distributed
    from opd.config.schema import load_config

    from autoscaling_cluster import FakeAutoscalingCluster, wait_until   # beside this script
    from test_elastic import settle

    cluster = FakeAutoscalingCluster(
        os.environ["RAY_TMPDIR"], head={"CPU": 2, "opd_learner": 1, "opd_teacher": 1},
        node_types={"rollout": {"CPU": 1, "opd_rollout": 1}}, max_workers=2,
        idle_timeout_minutes=IDLE_TIMEOUT_MIN)
    watch, seen, out = NodeWatch(), {"steps": [], "worker_nodes": {}}, {}
    try:
        cluster.start()
        ray.init(address=cluster.address, log_to_driver=False)
        watch.start()
        time.sleep(QUIET_S)
        out["before_run"] = rollout_nodes(ray)
        cfg = load_config("tiny", overrides(args["digits"], f"cluster.address={cluster.address}",
                                            "cluster.role_resources=true",
                                            "rollout.num_workers=1..2",
                                            "rollout.elastic_patience=1",
                                            "rollout.elastic_idle_steps=2"))
        need = role_bundle(cfg, "rollout")

        def after_step(pipeline, step, row):
            seen["steps"].append({"step": step, "t": time.monotonic(),
                                  "workers": row["rollout_workers"]})
            e = pipeline.elastic
            if e.requested > e.workers() and not e.placing:      # (b) the node comes up
                wait_until(lambda: fits(need, ray.available_resources()), WAIT_S,
                           "the autoscaler's second rollout node")
            settle(pipeline)
            for i in pipeline.pools["rollout"].loadable():              # where each one runs
                if i not in seen["worker_nodes"]:
                    info = ray.get(pipeline.rollout[i].info.remote(), timeout=WAIT_S)
                    seen["worker_nodes"][i] = info["node_id"]
            if row["rollout_workers"] == 2 and "switched" not in seen:
                seen["switched"] = step
            if any(x["event"] == "retire" for x in e.events) and "node_back" not in seen:
                wait_until(lambda: len(rollout_nodes(ray)) == 1, WAIT_S,    # (c)
                           "the idle rollout node going back")
                seen["node_back"] = {"step": step, "t": time.monotonic()}
            row["rollout_wait"] = 0.0 if "switched" in seen else 1.0    # what the policy reads

        t0, out["t0_wall"] = time.monotonic(), time.time()
        rows = run_distributed(cfg, args["run_dir"], progress=False,
                               hooks={"after_step": after_step})
        out["run_end"] = time.monotonic() - t0
        out.update(rows=rows, t0=t0, seen=seen)
    finally:
        watch.done.set()
        ray.shutdown()
        log = cluster.monitor_log()
        Path(args["out"]).with_name("monitor.log").write_text(log)
        out["autoscaler"] = autoscaler_actions(log, out.get("t0_wall", 0.0))
        out["killed"] = cluster.shutdown()
        watch.join(timeout=5)
        t0 = out.get("t0", 0.0)
        out["nodes"] = [{"id": n, "up": watch.up[n] - t0,
                         "down": watch.down[n] - t0 if n in watch.down else None}
                        for n in sorted(watch.up, key=watch.up.get)]
        for s in seen["steps"] + [seen.get("node_back", {"t": t0})]:
            s["t"] -= t0
        Path(args["out"]).write_text(json.dumps(out))


@pytest.fixture(scope="module")
def autoscaled_run(digits_dir, opd_cache, tmp_path_factory):
    from tests.actors.autoscaling_cluster import processes_of, stop, wait_until
    out = tmp_path_factory.mktemp("autoscaler")
    temp = tempfile.mkdtemp(prefix="opda", dir="/tmp")       # short: Ray's socket paths
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": temp, "OMP_NUM_THREADS": "1",
           "OPD_CACHE": str(opd_cache), "RAY_FAKE_CLUSTER": "1",
           "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    env.pop("RAY_ADDRESS", None)
    args = {"digits": str(digits_dir), "run_dir": str(out / "run"), "out": str(out / "out.json")}
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, __file__, json.dumps(args)], env=env, timeout=1500,
                              capture_output=True, text=True)
        try:                                                        # none of its processes
            wait_until(lambda: not processes_of(temp), 60.0, "the cluster's processes ending")
        except TimeoutError:
            pass
        left = [(p.pid, " ".join(p.info["cmdline"] or ())[:100]) for p in processes_of(temp)]
    finally:
        stop(processes_of(temp))                                    # only this cluster's
        shutil.rmtree(temp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert left == [], left
    result = json.loads((out / "out.json").read_text())
    result["wall"] = time.monotonic() - started
    report(result)
    return result, out / "run"


def report(r: dict) -> None:
    """The figures, seconds from the run's start (pytest -s shows them)."""
    print(f"\nautoscaler run: {len(r['rows'])} steps, run {r['run_end']:.1f} s, "
          f"whole test {r['wall']:.1f} s (cluster start and stop included)")
    for i, n in enumerate(r["nodes"]):
        down = "still up at the run's end" if n["down"] is None else f"down {n['down']:.1f} s"
        print(f"  rollout node {i + 1} ({n['id'][-5:]}): up {n['up']:.1f} s, {down}")
    for s in r["seen"]["steps"]:
        print(f"  step {s['step']:2d} done {s['t']:6.1f} s, rollout workers {s['workers']}")
    print(f"  worker nodes: {({i: n[-5:] for i, n in r['seen']['worker_nodes'].items()})}; "
          f"the idle node was gone in the hook of step {r['seen']['node_back']['step']} at "
          f"{r['seen']['node_back']['t']:.1f} s")
    for when, what in r["autoscaler"]:
        print(f"  autoscaler at {when:6.1f} s: {what}")
    print(f"  processes that needed SIGKILL at the cluster's stop: {r['killed']}")


@pytest.fixture(scope="module")
def reference(digits_dir, tmp_path_factory):
    from opd.config.schema import load_config
    from opd.run.reference import run_reference
    return run_reference(load_config("tiny", overrides(digits_dir)), tmp_path_factory.mktemp("ref"),
                         progress=False)


@pytest.mark.slow
def test_autoscaler_launches_and_retires_rollout_nodes_for_the_elastic_pool(autoscaled_run,
                                                                            reference):
    r, run_dir = autoscaled_run
    seen, nodes, rows = r["seen"], r["nodes"], r["rows"]
    t = {s["step"]: s["t"] for s in seen["steps"]}
    record = json.loads((run_dir / "consumed.json").read_text())
    events = record["rollout_workers"]["events"]
    workers = [row["rollout_workers"] for row in rows]
    k = seen["switched"]
    # (a) no rollout node before the run; the first one is launched for its first worker,
    # before its first step ends, and that worker runs there
    assert r["before_run"] == [] and len(nodes) == 2, nodes
    assert 0 < nodes[0]["up"] < t[0]
    assert seen["worker_nodes"]["0"] == nodes[0]["id"]
    # (b) waited on after step 0: the policy asks the autoscaler for a second worker's room,
    # the second node comes up after that, the worker is placed on it the step after
    assert [(e["event"], e["workers"]) for e in events] == [
        ("request", 2), ("place", 2), ("add", 2), ("retire", 1), ("request", 1)], events
    assert events[0]["step"] == 0 and events[1]["step"] == 1 and events[2]["step"] in (1, 2)
    assert 0 < t[0] < nodes[1]["up"]
    assert seen["worker_nodes"]["1"] == nodes[1]["id"]
    assert 2 <= k <= 3, workers
    # (c) idle from step k: the added worker is retired after step k+1 (elastic_idle_steps=2)
    # and the request lowered to one worker; the autoscaler terminates its node once it was
    # idle for the idle timeout (the hook of step k+2 waits for that), and the run goes on
    # on the first node
    assert workers == [1] * k + [2, 2] + [1] * (STEPS - k - 2), workers
    assert events[3]["step"] == events[4]["step"] == k + 1, events
    assert seen["node_back"]["step"] == k + 2
    assert nodes[1]["down"] - t[k + 1] >= IDLE_TIMEOUT_MIN * 60 - 1.0
    assert nodes[1]["down"] < r["run_end"]
    assert nodes[0]["down"] is None or nodes[0]["down"] > r["run_end"]
    # the autoscaler's own account: two launches of the rollout type, the second decided
    # after the request; then the second node terminated as idle; nothing else during the run
    acts = [(when, what) for when, what in r["autoscaler"] if when < r["run_end"]]
    launch = ["Queue 1 new nodes for launch", "Launching 1 nodes, type rollout."]
    assert [what for _, what in acts] == [
        *launch, *launch, f"Terminating the node with id {nodes[1]['id']} (idle)"], acts
    assert 0 < acts[0][0] < nodes[0]["up"] < t[0] < acts[2][0] < nodes[1]["up"]
    assert nodes[1]["up"] < t[k + 1] < acts[4][0] < nodes[1]["down"]
    # (d) every batch once, the reference's losses and tokens
    assert record["consumed"] == {str(b): 1 for b in range(STEPS)}
    assert [row["loss"] for row in rows] == pytest.approx([x["loss"] for x in reference], rel=0,
                                                          abs=LOSS_TOL)
    assert [row["rounds"] for row in rows] == [x["rounds"] for x in reference]
    print(f"  max |loss - reference loss| = "
          f"{max(abs(a['loss'] - b['loss']) for a, b in zip(rows, reference)):.3g}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    drive(json.loads(sys.argv[1]))
