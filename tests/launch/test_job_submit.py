"""`ray job submit ... -- opd train` against a running cluster, with token authentication on.

The head node is started here the way docs/CLUSTER.md says (`ray start --head --node-ip-address
127.0.0.1 --dashboard-host 127.0.0.1`, RAY_AUTH_MODE=token), with free ports, its own temp dir
(RAY_TMPDIR, --temp-dir) and its own token file (RAY_AUTH_TOKEN_PATH), so nothing touches
~/.ray or any other Ray on this machine.  `--block` keeps that `ray start` in the foreground:
terminating it (SIGTERM, by pid) stops the processes it started.  `ray stop` is never used: it
stops every Ray process on the machine, the test session's included.
"""
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from opd.run.metrics_log import read_metrics
from launch.job_submit import ray_job_submit

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STEPS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, token: str | None) -> int:
    """HTTP status of GET url (with the bearer token, if given); 0 if nothing answers."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5).status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def jobs(head) -> list[dict]:
    req = urllib.request.Request(f"{head['address']}/api/jobs/",
                                 headers={"Authorization": f"Bearer {head['token']}"})
    return json.loads(urllib.request.urlopen(req, timeout=10).read())


@pytest.fixture(scope="module")
def head():
    temp = Path(tempfile.mkdtemp(prefix="opdj", dir="/tmp"))       # short: Ray's socket paths
    token = secrets.token_hex(32)
    token_file = temp / "auth_token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    env = {**os.environ, "RAY_TMPDIR": str(temp), "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN_PATH": str(token_file), "OMP_NUM_THREADS": "1",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    for key in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_API_SERVER_ADDRESS"):
        env.pop(key, None)
    dashboard = free_port()
    log = open(temp / "head.log", "w")
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
         "--port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
         "--ray-client-server-port", str(free_port()), "--num-cpus", "2",
         "--temp-dir", str(temp), "--include-dashboard", "true", "--disable-usage-stats"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.time() + 120
        while get(f"{address}/api/jobs/", token) != 200:
            assert proc.poll() is None and time.time() < deadline, (temp / "head.log").read_text()[-3000:]
            time.sleep(1)
        yield {"address": address, "env": env, "token": token, "temp": temp}
    finally:
        proc.terminate()                     # `ray start --block` stops what it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def submit(head, env: dict, *entrypoint: str, runtime_env: dict | None = None,
           options: tuple[str, ...] = ()):
    argv = ["--address", head["address"], "--working-dir", str(ROOT), *options]
    if runtime_env:
        argv += ["--runtime-env-json", json.dumps(runtime_env)]
    return ray_job_submit([*argv, "--", *entrypoint], cwd=ROOT, env=env, timeout=600)


@pytest.mark.slow   # a job that trains on the cluster: test_ray_job_stop_with_sigint_...; to the end on
#                      Ray: tests/launch/test_export_cmd.py
def test_opd_train_runs_as_a_job_on_the_cluster(head, digits_dir, opd_cache, tmp_path):
    run_dir = tmp_path / "run"
    proc = submit(head, head["env"], "opd", "train", "--config", "tiny",
                  f"data.data_dir={digits_dir}", f"run.dir={run_dir}", f"distill.steps={STEPS}",
                  "rollout.num_cpus=0.25", "teacher.num_cpus=0.25", "learner.num_cpus=0.5",
                  runtime_env={"env_vars": {"OPD_CACHE": str(opd_cache)}})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "succeeded" in out
    assert "Connecting to existing Ray cluster" in out        # joined the job's cluster
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(STEPS))
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "checkpoints" / f"step_{STEPS:06d}" / "state.json").is_file()
    record = json.loads((run_dir / "consumed.json").read_text())
    assert record["consumed"] == {str(b): 1 for b in range(STEPS)}
    assert "SUCCEEDED" in [j["status"] for j in jobs(head)]


def test_ray_job_stop_with_sigint_checkpoints_the_run(head, digits_dir, opd_cache, tmp_path):
    """RAY_JOB_STOP_SIGNAL=SIGINT in the job's env_vars: `ray job stop` is a Ctrl-C."""
    run_dir, job = tmp_path / "run", "opd-stop-" + secrets.token_hex(4)
    env_vars = {"OPD_CACHE": str(opd_cache), "RAY_JOB_STOP_SIGNAL": "SIGINT",
                "RAY_JOB_STOP_WAIT_TIME_S": "120"}
    proc = submit(head, head["env"], "opd", "train", "--config", "tiny",
                  f"data.data_dir={digits_dir}", f"run.dir={run_dir}", "distill.steps=500",
                  "rollout.num_cpus=0.25", "teacher.num_cpus=0.25", "learner.num_cpus=0.5",
                  runtime_env={"env_vars": env_vars}, options=("--no-wait", "--submission-id", job))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    deadline = time.time() + 300
    while not ((run_dir / "metrics.parquet").is_file() and len(read_metrics(run_dir)) >= 2):
        assert time.time() < deadline
        time.sleep(0.5)
    ray_job = [str(BIN / "ray"), "job"]
    stop = subprocess.run([*ray_job, "stop", "--address", head["address"], job], env=head["env"],
                          capture_output=True, text=True, timeout=300)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    while [j["status"] for j in jobs(head) if j["submission_id"] == job] != ["STOPPED"]:
        assert time.time() < deadline
        time.sleep(0.5)
    logs = subprocess.run([*ray_job, "logs", "--address", head["address"], job], env=head["env"],
                          capture_output=True, text=True, timeout=120).stdout
    assert "Connecting to existing Ray cluster" in logs          # joined the job's cluster
    done = len(read_metrics(run_dir))
    assert 2 <= done < 500
    assert (f"opd train: interrupted with {done} steps done; checkpoint "
            f"{run_dir / 'checkpoints' / f'step_{done:06d}'}; continue with: "
            f"opd train --resume {run_dir}") in logs
    state = json.loads((run_dir / "checkpoints" / f"step_{done:06d}" / "state.json").read_text())
    assert state["step"] == done


def test_without_the_token_nothing_is_submitted(head):
    assert get(f"{head['address']}/api/jobs/", None) == 401
    env = {k: v for k, v in head["env"].items() if k != "RAY_AUTH_TOKEN_PATH"}
    proc = submit(head, {**env, "RAY_AUTH_TOKEN": secrets.token_hex(32)}, "true")
    assert proc.returncode != 0
    assert "authentication token is invalid" in proc.stdout + proc.stderr
    assert all(j["entrypoint"] != "true" for j in jobs(head))           # refused, not failed
