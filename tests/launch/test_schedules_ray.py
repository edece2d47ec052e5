"""`opd bench schedules` in ray mode (configs/bench/schedules_digits8_ray.yaml's harness, on the
tiny preset): the arms run on the Ray pipeline, equal time is matched on wall seconds."""
import json

import pytest

from launch import cli
from launch.bench.schedules import load_schedules_bench
from opd.config.schema import load_config
from opd.run.metrics_log import read_metrics


@pytest.fixture
def overrides(tiny_overrides):
    return [*load_schedules_bench("schedules_tiny").overrides, *tiny_overrides, "rollout.gamma=2",
            "rollout.num_cpus=0.25", "teacher.num_cpus=0.25", "learner.num_cpus=0.25"]


@pytest.mark.slow   # the matching: test_bench_schedules (reference mode); Ray runs: tests/actors
def test_ray_mode_matches_equal_time_on_wall_seconds(ray_session, tmp_path, overrides):
    """mode: ray runs every arm on the Ray pipeline (`opd bench schedules` passes it) and gives
    the equal-time arm the base arm's steps that fit in the matched arm's summed step wall time."""
    out = tmp_path / "ray"
    code = cli.main(["bench", "schedules", "--config", "schedules_tiny", "--out", str(out),
                     f"overrides={json.dumps([*overrides, 'eval.track=false'])}", "seeds=[0]",
                     "mode=ray", "only=[kd_equal_time]"])
    assert code == 0
    report = json.loads((out / "schedules.json").read_text())
    by = {r["arm"]: r for r in report["runs"]}
    for r in report["runs"]:
        assert load_config(f"{r['run_dir']}/config.yaml").run.mode == "ray"
        rows = read_metrics(r["run_dir"])
        assert r["wall_s"] == pytest.approx(sum(x["step_s"] for x in rows), rel=1e-12)
        assert r["rollout_busy_s"] == pytest.approx(sum(x["rollout_busy_s"] for x in rows))
    kd, gkd = by["kd"], by["gkd"]
    want = max(1, round(gkd["wall_s"] / (kd["wall_s"] / kd["steps"])))
    assert by["kd_equal_time"]["steps"] == want
    assert by["kd_equal_time"]["equal_time"]["match_wall_s"] == gkd["wall_s"]
    assert "| wall s |" in (out / "schedules.md").read_text()
