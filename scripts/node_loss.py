"""Whole Ray nodes lost mid-run, and a `ray job submit` driver killed and resubmitted: the faults
a cluster user meets, counted.

    python scripts/node_loss.py [--steps 12] [--json report.json]    # both scenarios, ~3 min
    scripts/soak.sh                                                  # the soak, then these rows

"nodes": a multi-node Ray of its own on 127.0.0.1 (`ray.cluster_utils.Cluster`, Ray's test
helper: every node its own raylet and object store; removing one kills its raylet, its object
store with every object it held, and every worker on it).  A head (driver, trajectory queue,
learner: `opd_learner`), two rollout nodes (`opd_rollout`) and two teacher nodes
(`opd_teacher`); the tiny config, strict on-policy, sampled HB-SJD, 2 rollout and 2 teacher
workers, cluster.role_resources=true, so each worker sits on its own node.  Mid-run:

- a rollout node is removed right after its worker handed out a piece of step --lose-rollout
  (the piece's payload in that node's store, not yet scored), and a fresh rollout node joins, as
  an autoscaler replaces a lost node: the rollout call is made again and Ray restarts the worker
  on the new node;
- a teacher node is removed right after its worker delivered a piece of step --lose-teacher (in
  that node's store, the learner not yet given it); nothing replaces it: the piece is scored
  again and the run goes on with one teacher worker.

"driver": a head started as docs/CLUSTER.md says (`ray start --head`, its own ports and temp
dir, with the dashboard's job server); `opd train` is submitted with `ray job submit`, its
driver process is killed (SIGKILL) after a checkpoint and a step past it, and `opd train
--resume RUN_DIR` is submitted as a new job.  The killed job's actors die with their owner;
the new job continues from the checkpoint.

Each scenario's losses are compared with the single-process reference loop (invariant 5: equal
in strict mode), its consumed.json with the batch ids expected (each exactly once), and its
object-store bytes at the end with those after the first step.  One row per fault: what was
lost, batches lost and duplicated, and the seconds to recover — for a node, until the next step
trained and until its workers answered from another node (`node_events` of consumed.json); for
the driver, from the kill until the new job had trained as many steps as the killed one.  Only
the Ray processes this script starts are stopped (never `ray stop`).  Exit code 0 when every
check holds.

Over 400 lines: one scenario end to end (the cluster it starts, the faults, the job that resumes,
the checks of what was lost or used twice) reads top to bottom in one script.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BIN = Path(sys.executable).parent

from launch.job_submit import ray_job_submit  # noqa: E402  (needs ROOT on the path)

LOSS_TOL = 1e-5
MEMORY_BOUND_MB = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_overrides(data_dir: str, steps: int, checkpoint_every: int = 0) -> list[str]:
    """The runs' overrides of configs/tiny.yaml (also the reference's)."""
    return [f"data.data_dir={data_dir}", f"distill.steps={steps}", "rollout.decoding=sample",
            "rollout.num_workers=2", "teacher.num_workers=2", "eval.track=false",
            f"run.checkpoint_every={checkpoint_every}", "rollout.num_cpus=0.5",
            "teacher.num_cpus=0.5", "learner.num_cpus=0.5", "run.log_every=1"]


def batches(run_dir: Path, steps: int) -> dict:
    """Batch ids lost and duplicated, from consumed.json and metrics.parquet."""
    from opd.run.metrics_log import read_metrics
    record = json.loads((run_dir / "consumed.json").read_text())
    counts = {int(b): n for b, n in record["consumed"].items()}
    ids = [r["batch_id"] for r in read_metrics(run_dir)]
    expected = set(range(steps))
    lost = (expected - set(counts)) | (expected - set(ids))
    dup = {b for b, n in counts.items() if n != 1} | {b for b in ids if ids.count(b) > 1}
    return {"batches_lost": len(lost), "batches_duplicated": len(dup), "record": record}


def loss_diff(rows: list[dict], reference: list[dict]) -> float | None:
    if len(rows) != len(reference):
        return None
    return max(abs(a["loss"] - b["loss"]) for a, b in zip(rows, reference))


# ---- nodes lost ----------------------------------------------------------------------------------

class NodeFaults:
    """The pipeline hooks that remove the rollout node, then the teacher node (module docstring)."""

    def __init__(self, cluster, rollout_nodes: list, teacher_nodes: list, lose_rollout: int,
                 lose_teacher: int, steps: int, log):
        self.cluster, self.log = cluster, log
        self.rollout_nodes, self.teacher_nodes = rollout_nodes, teacher_nodes
        self.lose_rollout, self.lose_teacher, self.steps = lose_rollout, lose_teacher, steps
        self.removed: dict[str, dict] = {}                # role -> {"node", "step", "t"}
        self.memory: dict[str, dict] = {}
        self.queue_node = None

    def hooks(self) -> dict:
        return {"after_piece": self.after_piece, "after_scored": self.after_scored,
                "after_step": self.after_step}

    def _on(self, pipeline, role: str, worker: int, node) -> bool:
        return pipeline.nodes.where.get((role, worker)) == node.node_id

    def after_piece(self, pipeline, step: int, piece: int, worker: int) -> None:
        node = self.rollout_nodes[0]
        if ("rollout" not in self.removed and step >= self.lose_rollout
                and self._on(pipeline, "rollout", worker, node)):
            self._remove("rollout", node, step)
            self.cluster.add_node(num_cpus=1, resources={"opd_rollout": 1})

    def after_scored(self, pipeline, step: int, piece: int, worker: int) -> None:
        node = self.teacher_nodes[0]
        if ("teacher" not in self.removed and step >= self.lose_teacher
                and self._on(pipeline, "teacher/default", worker, node)):   # its one pool
            self._remove("teacher", node, step)

    def after_step(self, pipeline, step: int, row: dict) -> None:
        from actors.bench.memory import store_usage
        if step == 0:                                     # where Ray placed the queue
            import ray._private.state as state
            self.queue_node = next(a["Address"]["NodeID"] for a in state.actors().values()
                                   if a.get("Name") == "opd/queue" and a["State"] == "ALIVE")
        for name, at in (("start", 0), ("middle", self.steps // 2), ("end", self.steps - 1)):
            if step == at:
                self.memory[name] = {"step": step, **store_usage()}

    def _remove(self, role: str, node, step: int) -> None:
        self.log(f"  removing the {role} node {node.node_id[:8]} at step {step}")
        self.removed[role] = {"node": node.node_id, "step": step, "t": time.monotonic()}
        self.cluster.remove_node(node, allow_graceful=False)


def nodes_scenario(args, data_dir: str, reference: list[dict], log) -> list[dict]:
    """The "nodes" run; returns its two rows (rollout node, teacher node)."""
    import ray
    from ray.cluster_utils import Cluster

    from actors.driver.pipeline import run_distributed
    from opd.config.schema import load_config

    run_dir = Path(args.work) / "nodes"
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "include_dashboard": False, "dashboard_agent_listen_port": free_port(),
        "resources": {"opd_learner": 1}})
    try:
        rollout_nodes = [cluster.add_node(num_cpus=1, resources={"opd_rollout": 1})
                         for _ in range(2)]
        teacher_nodes = [cluster.add_node(num_cpus=1, resources={"opd_teacher": 1})
                         for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        cfg = load_config("tiny", [*run_overrides(data_dir, args.steps),
                                   f"cluster.address={cluster.address}",
                                   "cluster.role_resources=true"])
        faults = NodeFaults(cluster, rollout_nodes, teacher_nodes, args.lose_rollout,
                            args.lose_teacher, args.steps, log)
        start = time.monotonic()
        rows = run_distributed(cfg, run_dir, progress=False, hooks=faults.hooks())
        seconds = time.monotonic() - start
        from actors.bench.memory import store_usage
        faults.memory["after"] = store_usage()
    finally:
        ray.shutdown()
        for n in list(cluster.worker_nodes):          # only this cluster's processes
            cluster.remove_node(n)
        if cluster.head_node is not None:
            cluster.remove_node(cluster.head_node)
    counts = batches(run_dir, args.steps)
    events = {e["node"]: e for e in counts["record"]["node_events"] if e["event"] == "lost"}
    diff = loss_diff(rows, reference)
    bound = faults.memory["start"]["bytes"] + MEMORY_BOUND_MB * 2**20
    out = []
    for role in ("rollout", "teacher"):
        removed = faults.removed.get(role)
        event = events.get(removed["node"]) if removed else None
        remade = (event or {}).get("remade", {})
        row = {"fault": f"{role} node lost", "step": removed and removed["step"],
               "seen": event is not None, "workers": (event or {}).get("workers"),
               "next_step_s": (event or {}).get("next_step_s"),
               "remade": remade, "remade_s": max((r["after_s"] for r in remade.values()),
                                                 default=None),
               "batches_lost": counts["batches_lost"],
               "batches_duplicated": counts["batches_duplicated"],
               "max_loss_diff": diff, "memory": faults.memory, "run_seconds": round(seconds, 1),
               "nodes": counts["record"]["nodes"]}
        row["checks"] = {
            "node removed mid-run": removed is not None and 0 < removed["step"] < args.steps - 1,
            "consumed.json records the loss": event is not None and bool(event["workers"]),
            "run finished": len(rows) == args.steps,
            "queue on the learner's node": faults.queue_node == counts["record"]["nodes"][
                "learner"][0]["node"],
            "no batch lost or duplicated": (counts["batches_lost"], counts["batches_duplicated"]) == (0, 0),
            "losses equal the reference": diff is not None and diff <= LOSS_TOL,
            "object store bounded": all(k in faults.memory and faults.memory[k]["bytes"] <= bound
                                        for k in ("middle", "end"))}
        if role == "rollout":                         # a new node replaced it
            row["checks"]["worker re-made on the new node"] = bool(remade) and all(
                r["node"] != removed["node"] for r in remade.values())
        out.append(row)
    return out


# ---- the driver killed ---------------------------------------------------------------------------

def start_head(temp: Path, env: dict) -> tuple[subprocess.Popen, str]:
    """`ray start --head --block` with the job server, its own ports and temp dir; returns the
    process (SIGTERM stops what it started) and the job server's address."""
    import urllib.request
    dashboard = free_port()
    log = open(temp / "head.log", "w")
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
         "--port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
         "--ray-client-server-port", str(free_port()), "--num-cpus", "3",
         "--temp-dir", str(temp), "--include-dashboard", "true", "--disable-usage-stats"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    deadline = time.time() + 180
    while True:
        try:
            if urllib.request.urlopen(f"{address}/api/jobs/", timeout=5).status == 200:
                return proc, address
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            stop_head(proc)
            raise RuntimeError("the Ray head did not start: "
                               + (temp / "head.log").read_text()[-2000:])
        time.sleep(1)


def stop_head(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def job(address: str, submission_id: str) -> dict:
    import urllib.request
    with urllib.request.urlopen(f"{address}/api/jobs/{submission_id}", timeout=10) as r:
        return json.loads(r.read())


def submit(address: str, env: dict, submission_id: str, *argv: str, cache: str) -> None:
    runtime_env = {"env_vars": {"OPD_CACHE": cache, "OMP_NUM_THREADS": "1"}}
    proc = ray_job_submit(["--address", address, "--no-wait", "--submission-id", submission_id,
                           "--working-dir", str(ROOT), "--runtime-env-json",
                           json.dumps(runtime_env), "--", *argv],
                          cwd=ROOT, env=env, timeout=300)
    if proc.returncode:
        raise RuntimeError(f"ray job submit failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")


def rows_done(run_dir: Path) -> int:
    from opd.run.metrics_log import read_metrics
    try:
        return len(read_metrics(run_dir))
    except Exception:  # noqa: BLE001 - not written yet, or being replaced
        return 0


def wait_job(address: str, submission_id: str, until: set[str], timeout: float,
             watch=None) -> str:
    deadline = time.time() + timeout
    while (status := job(address, submission_id)["status"]) not in until:
        if time.time() > deadline:
            raise RuntimeError(f"job {submission_id} still {status} after {timeout:g} s")
        if watch is not None:
            watch()
        time.sleep(0.5)
    return status


def is_descendant(pid: int, ancestor: int) -> bool:
    import psutil
    try:
        return any(p.pid == ancestor for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False


def driver_scenario(args, data_dir: str, reference: list[dict], log) -> dict:
    """The "driver" run; returns its row."""
    from rollout.calibrate import cache_root
    from opd.run.metrics_log import read_metrics
    temp = Path(tempfile.mkdtemp(prefix="opdn", dir="/tmp"))        # short: Ray's socket paths
    env = {**os.environ, "RAY_TMPDIR": str(temp), "RAY_AUTH_MODE": "disabled",
           "OMP_NUM_THREADS": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    for key in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        env.pop(key, None)
    run_dir = Path(args.work) / "driver"
    every = args.checkpoint_every
    head, address = start_head(temp, env)
    try:
        first, second = f"opd-a-{os.getpid()}", f"opd-b-{os.getpid()}"
        submit(address, env, first, "opd", "train", "--config", "tiny", f"run.dir={run_dir}",
               *run_overrides(data_dir, args.steps, every), cache=str(cache_root()))
        deadline = time.time() + 600
        while not ((n := rows_done(run_dir)) > every and n % every):   # past a checkpoint
            if job(address, first)["status"] in ("FAILED", "SUCCEEDED", "STOPPED"):
                raise RuntimeError(f"job {first} ended before it could be killed")
            if time.time() > deadline:
                raise RuntimeError("the first job trained no step past its checkpoint")
            time.sleep(0.2)
        pid = int(job(address, first)["driver_info"]["pid"])
        if not is_descendant(pid, head.pid):
            raise RuntimeError(f"driver pid {pid} is not a process of this script's Ray head")
        os.kill(pid, signal.SIGKILL)
        killed_at, killed_wall, done_at_kill = time.monotonic(), time.time(), rows_done(run_dir)
        log(f"  killed the driver of job {first} (pid {pid}) after {done_at_kill} steps")
        status_first = wait_job(address, first, {"FAILED", "STOPPED", "SUCCEEDED"}, 120)
        submit(address, env, second, "opd", "train", "--resume", str(run_dir),
               cache=str(cache_root()))
        recovered: dict = {}

        def watch() -> None:    # the new job's rows (written after the kill) are back where they were
            if ("s" not in recovered and rows_done(run_dir) >= done_at_kill
                    and (run_dir / "metrics.parquet").stat().st_mtime > killed_wall):
                recovered["s"] = time.monotonic() - killed_at
        status_second = wait_job(address, second, {"FAILED", "STOPPED", "SUCCEEDED"}, 900, watch)
        if "s" not in recovered and status_second == "SUCCEEDED":
            recovered["s"] = time.monotonic() - killed_at
    finally:
        stop_head(head)
        shutil.rmtree(temp, ignore_errors=True)
    rows = read_metrics(run_dir) if (run_dir / "metrics.parquet").is_file() else []
    counts = batches(run_dir, args.steps) if (run_dir / "consumed.json").is_file() else {
        "batches_lost": None, "batches_duplicated": None}
    diff = loss_diff(rows, reference)
    row = {"fault": "driver killed, resumed as a new job", "step": done_at_kill,
           "first_job": status_first, "second_job": status_second,
           "recover_s": round(recovered["s"], 1) if "s" in recovered else None,
           "steps_redone": done_at_kill - (done_at_kill // every) * every,
           "batches_lost": counts["batches_lost"],
           "batches_duplicated": counts["batches_duplicated"], "max_loss_diff": diff}
    row["checks"] = {
        "killed mid-run": status_first == "FAILED" and 0 < done_at_kill < args.steps,
        "resumed job finished": status_second == "SUCCEEDED" and len(rows) == args.steps,
        "no batch lost or duplicated": (row["batches_lost"], row["batches_duplicated"]) == (0, 0),
        "losses equal the reference": diff is not None and diff <= LOSS_TOL}
    return row


# ---- the report ----------------------------------------------------------------------------------

def run_scenarios(args, data_dir: str, log) -> list[dict]:
    """Both scenarios (args.scenarios); Ray must not be initialized in this process."""
    from opd.config.schema import load_config
    from opd.run.reference import run_reference
    rows = []
    if "nodes" in args.scenarios:
        log(f"nodes: reference loop, {args.steps} steps")
        reference = run_reference(load_config("tiny", run_overrides(data_dir, args.steps)),
                                  Path(args.work) / "reference", progress=False)
        log("nodes: a rollout node, then a teacher node lost")
        rows += nodes_scenario(args, data_dir, reference, log)
    if "driver" in args.scenarios:
        log(f"driver: reference loop, {args.steps} steps")
        reference = run_reference(
            load_config("tiny", run_overrides(data_dir, args.steps, args.checkpoint_every)),
            Path(args.work) / "reference-driver", progress=False)
        log("driver: opd train killed as a job, resumed as a new one")
        rows.append(driver_scenario(args, data_dir, reference, log))
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"{'fault':<38} {'step':>4} {'lost':>4} {'dup':>4} {'next step s':>11} "
          f"{'re-made s':>9} {'recover s':>9}  max |loss - ref|")
    for r in rows:
        fmt = lambda v: "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))  # noqa: E731
        print(f"{r['fault']:<38} {fmt(r['step']):>4} {fmt(r['batches_lost']):>4} "
              f"{fmt(r['batches_duplicated']):>4} {fmt(r.get('next_step_s')):>11} "
              f"{fmt(r.get('remade_s')):>9} {fmt(r.get('recover_s')):>9}  {r['max_loss_diff']}")
        for name, good in r["checks"].items():
            print(f"  [{'ok' if good else 'FAIL'}] {name}")


def add_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    p.add_argument(f"--{prefix}steps", type=int, default=12)
    p.add_argument(f"--{prefix}lose-rollout", type=int, default=3,
                   help="the rollout node goes at this step (once its worker made a part)")
    p.add_argument(f"--{prefix}lose-teacher", type=int, default=7,
                   help="the teacher node goes at this step (once it is sealed with its pieces)")
    p.add_argument(f"--{prefix}checkpoint-every", type=int, default=5,
                   help="the driver scenario's run.checkpoint_every")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    p.add_argument("--scenarios", default="nodes,driver")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    args.scenarios = args.scenarios.split(",")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.pop("RAY_ADDRESS", None)
    temp = tempfile.mkdtemp(prefix="opdn", dir="/tmp")
    os.environ["RAY_TMPDIR"] = temp

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    import torch
    torch.set_num_threads(1)
    from opd.data import prepare_digits
    args.work = tempfile.mkdtemp(prefix="opd-nodes-")
    data_dir = str(Path(args.work) / "digits")
    prepare_digits(data_dir)
    began = time.monotonic()
    try:
        rows = run_scenarios(args, data_dir, log)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    ok = all(all(r["checks"].values()) for r in rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "ok": ok, "work": args.work,
                                               "seconds": round(time.monotonic() - began, 1)},
                                              indent=1, default=str))
    print_rows(rows)
    print(f"node faults {'passed' if ok else 'FAILED'} in {time.monotonic() - began:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
