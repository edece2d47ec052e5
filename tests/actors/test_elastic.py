"""Elastic rollout workers: rollout.num_workers="1..3" grows when a node brings resources.

A two-node Ray cluster on 127.0.0.1 (`ray.cluster_utils.Cluster`, Ray's own test helper) in a
subprocess with its own driver and temp dir (the session's Ray, and other Ray instances on
this machine, are untouched).  The head has one `opd_rollout` resource, so the run starts with
one worker and cannot grow; after step ADD_AT a second node joins with two more, and the
driver adds workers mid-run, without a restart.  Strict on-policy, greedy: the losses equal
the single-process reference and every batch id is consumed once (invariants 5 and 7).
Retiring (on the session's local Ray): an added worker left idle is killed, down to min.

The file is also the subprocess's script: `python test_elastic.py ARGS_JSON`.
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

STEPS = 40
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


def drive(args: dict) -> None:
    """The subprocess: start the cluster, run, add a node after step ADD_AT, write the rows."""
    import ray
    from ray.cluster_utils import Cluster

    from actors.pipeline import run_distributed
    from opd.config import load_config

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "include_dashboard": False, "dashboard_agent_listen_port": free_port(),
        "resources": {"opd_learner": 1, "opd_teacher": 1, "opd_rollout": 1}})
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cfg = load_config("tiny", overrides(args["digits"], f"cluster.address={cluster.address}",
                                            "cluster.role_resources=true", "rollout.num_workers=1..3",
                                            "rollout.elastic_patience=1", "rollout.elastic_grow_wait=0.2"))

        def add_node(pipeline, step, row):
            if step == ADD_AT:
                cluster.add_node(num_cpus=1, resources={"opd_rollout": 2})

        rows = run_distributed(cfg, args["run_dir"], progress=False, hooks={"after_step": add_node})
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


def test_rollout_workers_grow_mid_run_when_a_node_joins(elastic_run):
    rows, run_dir = elastic_run
    workers = [r["rollout_workers"] for r in rows]
    assert workers[:ADD_AT + 1] == [1] * (ADD_AT + 1)       # no room for a second one before
    assert max(workers) == 3, workers                        # the new node's two, mid-run
    assert workers == sorted(workers)                        # nothing retired: rollouts bound
    record = json.loads((run_dir / "consumed.json").read_text())
    assert record["consumed"] == {str(b): 1 for b in range(STEPS)}
    events = record["rollout_workers"]["events"]
    assert record["rollout_workers"]["added"] == 2
    assert [e["event"] for e in events if e["event"] != "request"] == ["place", "add"] * 2
    assert all(e["step"] >= ADD_AT for e in events if e["event"] == "place")


@pytest.fixture(scope="module")
def reference(digits_dir, tmp_path_factory):
    from opd.config import load_config
    from opd.reference import run_reference
    return run_reference(load_config("tiny", overrides(digits_dir)), tmp_path_factory.mktemp("ref"),
                         progress=False)


def test_elastic_run_equals_the_reference(elastic_run, reference):
    rows, _ = elastic_run
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in reference], rel=0,
                                                      abs=LOSS_TOL)
    assert [r["rounds"] for r in rows] == [r["rounds"] for r in reference]    # the same tokens
    assert [(r["step"], r["batch_id"], r["policy_lag"]) for r in rows] == \
        [(k, k, 0) for k in range(STEPS)]


def test_idle_added_worker_is_retired_down_to_min(ray_session, digits_dir, reference, tmp_path):
    """Grow to 2 on the session's local Ray, then every step counts as idle (thresholds raised
    from a hook): after elastic_idle_steps the added worker is retired and killed."""
    from actors.pipeline import run_distributed
    from opd.config import load_config
    seen = {}

    def idle_from_now(pipeline, step, row):
        if row["rollout_workers"] == 2 and "switched" not in seen:
            seen["switched"] = step
            pipeline.cfg.rollout.elastic_grow_wait = pipeline.cfg.rollout.elastic_shrink_wait = 1.0
        if step == STEPS - 1:
            seen["states"] = list(pipeline.pools["rollout"].state)
            with pytest.raises(ray_session.exceptions.RayActorError):
                ray_session.get(pipeline.rollout[1].info.remote(), timeout=30)

    cfg = load_config("tiny", overrides(digits_dir, "rollout.num_workers=1..2",
                                        "rollout.elastic_patience=1", "rollout.elastic_grow_wait=0.01",
                                        "rollout.elastic_shrink_wait=0.0",
                                        "rollout.elastic_idle_steps=2"))
    rows = run_distributed(cfg, tmp_path, progress=False, hooks={"after_step": idle_from_now})
    workers = [r["rollout_workers"] for r in rows]
    k = seen["switched"]
    assert workers[0] == 1 and workers[k] == 2 and workers[-1] == 1, workers
    assert workers[k + 3:] == [1] * (STEPS - k - 3)           # retired after 2 idle steps
    assert seen["states"] == ["up", "retired"]
    record = json.loads((tmp_path / "consumed.json").read_text())
    assert [e["event"] for e in record["rollout_workers"]["events"]] == ["place", "add", "retire"]
    assert record["consumed"] == {str(b): 1 for b in range(STEPS)}
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in reference], rel=0,
                                                      abs=LOSS_TOL)


def test_elastic_config_is_checked_before_anything_starts(tiny_overrides):
    from actors.cluster import check_distributed, pool_size
    from opd.config import ConfigError, load_config
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


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    drive(json.loads(sys.argv[1]))
