"""Whole nodes lost mid-run, and a `ray job submit` driver killed then resumed as a new job
(scripts/node_loss.py, in a subprocess with Ray clusters of its own; nothing else on this
machine is touched).  Minutes on a 2-core machine (five raylets, then a head with its job
server), so marked slow:

    python -m pytest -m slow tests/actors/test_node_loss.py -s

What the script's checks say is asserted here row by row: the fault happened mid-run and was
seen (consumed.json's node_events name the node and the workers it held), the run finished,
every batch id was consumed exactly once, the losses equal the single-process reference's
(strict on-policy: invariant 5), the object store did not grow, a rollout worker was re-made on
the node that replaced its own.  How NodeWatch decides what it prints: tests/actors/test_nodes.py.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report(opd_cache, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("node_loss")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1",
           "OPD_CACHE": str(opd_cache), "TMPDIR": str(tmp)}
    env.pop("RAY_ADDRESS", None)
    out = tmp / "report.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "node_loss.py"), "--json",
                           str(out)], env=env, timeout=1800, capture_output=True, text=True)
    print(proc.stdout)
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text()), proc


@pytest.mark.slow
def test_rollout_node_then_teacher_node_lost(report):
    rep, proc = report
    rollout, teacher = rep["rows"][:2]
    for row in (rollout, teacher):
        assert all(row["checks"].values()), row["checks"]
        assert (row["batches_lost"], row["batches_duplicated"]) == (0, 0)
        assert row["max_loss_diff"] <= 1e-5 and row["seen"]
        mem = row["memory"]
        assert mem["end"]["bytes"] <= mem["start"]["bytes"] + 32 * 2**20
    assert rollout["step"] == 3 and rollout["workers"] == ["rollout/0"] or \
        rollout["workers"] == ["rollout/1"]
    assert len(teacher["workers"]) == 1 and teacher["workers"][0].startswith("teacher/")
    # the replaced rollout node: its worker answered from the new node, the third rollout node
    (worker, remade), = rollout["remade"].items()
    assert worker == rollout["workers"][0]
    assert remade["node"] == rollout["nodes"]["rollout"][2]["node"]
    assert len(rollout["nodes"]["rollout"]) == 3 and len(rollout["nodes"]["teacher/default"]) == 2
    assert teacher["remade"] == {}                      # nothing replaced the teacher node
    assert "lost at step" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_killed_driver_resumes_as_a_new_job(report):
    rep, _ = report
    driver = rep["rows"][2]
    assert all(driver["checks"].values()), driver
    assert (driver["first_job"], driver["second_job"]) == ("FAILED", "SUCCEEDED")
    assert (driver["batches_lost"], driver["batches_duplicated"]) == (0, 0)
    assert driver["max_loss_diff"] <= 1e-5
    assert driver["steps_redone"] >= 1 and driver["recover_s"] is not None
