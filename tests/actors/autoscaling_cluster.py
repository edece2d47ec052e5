"""A local cluster on Ray's fake multi-node autoscaler that stops only its own processes.

    cluster = FakeAutoscalingCluster(temp_dir, head={"CPU": 2, "opd_learner": 1},
                                     node_types={"rollout": {"CPU": 1, "opd_rollout": 1}},
                                     max_workers=2, idle_timeout_minutes=0.1)
    cluster.start()                  # the head, with the autoscaler's monitor
    ray.init(address=cluster.address)
    ...                              # the autoscaler starts `rollout` nodes on demand
    cluster.shutdown()               # every process of this cluster, and no other

What `ray.cluster_utils.AutoscalingCluster` does (a head whose monitor runs the
`fake_multinode` provider, RAY_FAKE_CLUSTER=1: a node the autoscaler launches is a raylet on
this machine with its node type's resources, one it terminates is that raylet stopped), without
its two problems here: it starts and stops with `ray stop --force`, which kills every Ray
process on the machine (other runs, other tests), and its config template
(`fake_multi_node/example.yaml`) is not in the installed wheel.  The head is a
`ray.cluster_utils.Cluster` head given the autoscaling config; the process's environment must
already hold RAY_FAKE_CLUSTER=1 and RAY_TMPDIR=temp_dir (the monitor and its nodes inherit
it, and so put their sessions there).

Stopping goes by process: every process whose command line names `temp_dir` (a directory of
this cluster's own), or whose environment has RAY_TMPDIR=temp_dir, belongs to it.  The nodes
the autoscaler started are stopped first, while the head's GCS still answers (a raylet whose
GCS is gone ignores SIGTERM for a long while), then the head, then anything left.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import psutil

WORKER_NODE_ID_PREFIX = "f" * 51
"""The fake provider's node ids: fff...f00001, fff...f00002, ... in launch order (its nodes'
raylets and agents carry theirs on their command lines)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_of(temp_dir: str | Path, *also: str) -> list[psutil.Process]:
    """The processes of the cluster in `temp_dir`, this one excluded: those whose command line
    names it, or whose environment has RAY_TMPDIR=temp_dir (Ray's workers retitle themselves
    `ray::...` but keep the environment they inherited); with `also`, only those whose command
    line has each of `also` too."""
    mark, me, found = str(temp_dir), os.getpid(), []
    for p in psutil.process_iter(["pid", "cmdline", "environ"]):
        line = " ".join(p.info["cmdline"] or ())
        ours = mark in line or (p.info["environ"] or {}).get("RAY_TMPDIR") == mark
        if p.info["pid"] != me and ours and all(a in line for a in also):
            found.append(p)
    return found


def stop(procs: list[psutil.Process], grace_s: float = 20.0) -> list[int]:
    """SIGTERM `procs`, SIGKILL those still alive after `grace_s`; the pids that needed it."""
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)
    return [p.pid for p in alive]


class FakeAutoscalingCluster:
    """A head with resources `head` (CPU among them) and the worker node types `node_types`
    (name -> resources), each 0..`max_workers` nodes, started and stopped by the autoscaler
    (`upscaling_speed` 1, idle nodes terminated after `idle_timeout_minutes`)."""

    def __init__(self, temp_dir: str | Path, head: dict, node_types: dict[str, dict], *,
                 max_workers: int, idle_timeout_minutes: float):
        self.temp_dir = Path(temp_dir)
        self.head_resources = dict(head)
        self.port = free_port()
        self.config = {
            "cluster_name": "opd-fake", "max_workers": max_workers,
            "provider": {"type": "fake_multinode", "use_node_id_as_ip": True,
                         "disable_node_updaters": True, "disable_launch_config_check": True,
                         "gcs_address": None},                 # set by start()
            "available_node_types": {
                "ray.head.default": {"resources": dict(head), "node_config": {}, "max_workers": 0},
                **{name: {"resources": {"object_store_memory": 150 * 2**20, **res},
                          "node_config": {}, "min_workers": 0, "max_workers": max_workers}
                   for name, res in node_types.items()}},
            "head_node_type": "ray.head.default", "upscaling_speed": 1.0,
            "idle_timeout_minutes": idle_timeout_minutes,
            "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
            "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
            "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
            "worker_setup_commands": [], "head_start_ray_commands": [],
            "worker_start_ray_commands": []}
        self.cluster = None

    @property
    def address(self) -> str:
        return self.cluster.address

    def start(self) -> None:
        import ray
        from ray.cluster_utils import Cluster
        assert os.environ.get("RAY_FAKE_CLUSTER") == "1", "the monitor needs RAY_FAKE_CLUSTER=1"
        assert os.environ.get("RAY_TMPDIR") == str(self.temp_dir), "RAY_TMPDIR must be temp_dir"
        ip = ray._private.services.get_node_ip_address()
        self.config["provider"]["gcs_address"] = f"{ip}:{self.port}"   # where its nodes join
        path = self.temp_dir / "autoscaling.json"
        path.write_text(json.dumps(self.config))
        res = dict(self.head_resources)
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": res.pop("CPU"), "resources": res, "gcs_server_port": self.port,
            "include_dashboard": False, "dashboard_agent_listen_port": free_port(),
            "autoscaling_config": str(path)})

    def monitor_log(self) -> str:
        """The autoscaler's log (launches, terminations and their reasons)."""
        logs = sorted(self.temp_dir.glob("ray/session_*/logs/monitor.log"))
        return logs[-1].read_text() if logs else ""

    def shutdown(self) -> list[int]:
        """Stop the autoscaler's nodes, then the head, then any process of the cluster left
        (`processes_of`); the pids that had to be killed (SIGKILL)."""
        killed = stop(processes_of(self.temp_dir, WORKER_NODE_ID_PREFIX))   # raylets, agents
        if self.cluster is not None and self.cluster.head_node is not None:
            self.cluster.remove_node(self.cluster.head_node)
        return killed + stop(processes_of(self.temp_dir), grace_s=10.0)


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.25):
    """Poll `predicate()` until it returns something true; TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(poll_s)
