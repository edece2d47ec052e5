"""The chaos soak (scripts/soak.py), short: 8 steps at staleness 0 and 2, one rollout, one
teacher and one learner kill per run.  About a minute on a quiet 2-core machine (nearly five
while three other sessions ran), so it has its own marker and stays out of the default test
command:

    python -m pytest -m soak tests/test_soak.py

The real soak is `scripts/soak.sh` (300 steps, 8 kills per role and run)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def soak(opd_cache, tmp_path, *args) -> dict:
    """scripts/soak.py, 8 steps, in a process of its own; its JSON report."""
    out = tmp_path / "soak.json"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1",
           "OPD_CACHE": str(opd_cache), "TMPDIR": str(tmp_path)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--steps", "8",
                           "--checkpoint-every", "2", "--node-scenarios", "", *args,
                           "--json", str(out)],
                          env=env, timeout=1200, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.soak
def test_short_soak_loses_and_leaks_nothing(opd_cache, tmp_path):
    report = soak(opd_cache, tmp_path, "--kills", "1")
    assert report["ok"] is True and report["leaked_processes"] == []
    strict, stale = report["runs"]
    for run in (strict, stale):
        assert (run["batches_lost"], run["batches_duplicated"], run["rows"]) == (0, 0, 8)
        assert run["roles_killed"] == ["learner", "rollout", "teacher"]
        assert run["stalled"] is None
        assert len(run["learner_resumed_from"]) == 1 and run["leaked_actors"] == []
        assert run["memory"]["end"]["bytes"] <= run["memory"]["start"]["bytes"] + 32 * 2**20
    assert strict["staleness"] == 0 and strict["max_loss_diff"] <= 1e-5
    assert strict["max_policy_lag"] == 0
    assert stale["staleness"] == 2 and stale["max_policy_lag"] <= 2


@pytest.mark.slow
@pytest.mark.soak
def test_short_soak_with_two_teachers_loses_nothing(opd_cache, tmp_path):
    """The chaos soak with two teachers routing by class (opd/distill/teachers.py), a pool of 2
    workers each: a rollout and a teacher worker killed (`ray.kill` or SIGKILL), the learner
    killed and resumed; every batch once, the losses of the reference loop."""
    report = soak(opd_cache, tmp_path, "--kills", "2", "--staleness", "0", "--teachers", "routed")
    assert report["ok"] is True and report["leaked_processes"] == []
    (run,) = report["runs"]
    assert (run["batches_lost"], run["batches_duplicated"], run["rows"]) == (0, 0, 8)
    assert run["roles_killed"] == ["learner", "rollout", "teacher"]
    assert run["max_loss_diff"] <= 1e-5 and run["max_policy_lag"] == 0
