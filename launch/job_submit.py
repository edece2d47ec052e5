"""`ray job submit` as docs/CLUSTER.md runs it, from Python (scripts/node_loss.py, the job tests).

    proc = ray_job_submit(["--address", head, "--working-dir", ".", "--", "opd", "train"],
                          cwd=root, env=env, timeout=600)

The job server answers 500 "No available agent to submit job, please try again later" while
the head node's dashboard agent has not registered (it waits 10 s for it; a loaded machine takes
longer): that answer is retried, as it asks, for 3 min.  Other answers are returned as they are.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

RAY = Path(sys.executable).parent / "ray"
"""The `ray` command of this Python environment."""
RETRY_S = 180


def ray_job_submit(argv: list[str], **run) -> subprocess.CompletedProcess:
    """`ray job submit ARGV` (subprocess.run(..., **run), text output captured), retried while
    the job server has no agent yet."""
    deadline = time.time() + RETRY_S
    while True:
        proc = subprocess.run([str(RAY), "job", "submit", *argv], capture_output=True, text=True,
                              **run)
        if (not proc.returncode or "No available agent" not in proc.stdout + proc.stderr
                or time.time() > deadline):
            return proc
        time.sleep(2)
