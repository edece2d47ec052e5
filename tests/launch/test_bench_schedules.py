"""`opd bench schedules` (launch/bench/schedules.py): the preset's checks, the equal-time arm's
steps, the table's statistics against numpy, the curves figure, and reuse of finished runs."""
import json

import numpy as np
import pytest

from launch import cli
from launch.bench.schedules import (equal_time_steps, load_schedules_bench, mean_sd, run_figures,
                                 run_schedules)
from launch.bench.schedules_report import format_markdown
from opd.config.schema import load_config
from opd.config.loader import ConfigError
from opd.run.metrics_log import read_metrics

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def overrides(tiny_overrides):
    """The tiny preset's run overrides, on the session's digits data, gamma fixed (no
    calibration)."""
    return [*load_schedules_bench("schedules_tiny").overrides, *tiny_overrides, "rollout.gamma=2"]


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory, overrides):
    """`opd bench schedules --config schedules_tiny` with two seeds (a few seconds a run)."""
    out = tmp_path_factory.mktemp("schedules")
    code = cli.main(["bench", "schedules", "--config", "schedules_tiny", "--out", str(out),
                     f"overrides={json.dumps(overrides)}", "seeds=[0, 1]"])
    assert code == 0
    return out, json.loads((out / "schedules.json").read_text())


def test_runs_and_files(bench_out):
    out, report = bench_out
    assert [(r["arm"], r["seed"]) for r in report["runs"]] == [
        ("kd", 0), ("gkd", 0), ("kd", 1), ("gkd", 1), ("kd_equal_time", 0), ("kd_equal_time", 1)]
    assert (out / "schedules.png").read_bytes()[:8] == PNG
    for r in report["runs"]:
        rows = read_metrics(r["run_dir"])
        assert len(rows) == r["steps"]
        # every step of gkd (lam 1) is a student rollout, none of kd's
        assert r["student_share"] == (1.0 if r["arm"] == "gkd" else 0.0)
        assert r["student_share"] == np.mean([x["source"] == "student" for x in rows])
        assert r["wall_s"] == pytest.approx(sum(x["step_s"] for x in rows), rel=1e-12)
        assert r["cpu_s"] == pytest.approx(sum(x["step_cpu_s"] for x in rows), rel=1e-12)
        assert r["exposure_gap"] == pytest.approx(r["kl_samples"] - r["kl_data"], abs=1e-15)
        final = json.loads((out / r["arm"] / f"seed{r['seed']}" / "final" / "eval.json")
                           .read_text())
        assert final["num_samples"] == 8 and final["metrics"]["fid"] == r["fid"]
        assert final["quality"]["kl_samples"] == r["kl_samples"]
        assert [r[k] for k in ("precision", "recall", "class_acc", "kl_data")] == [
            final["metrics"]["precision"], final["metrics"]["recall"],
            final["metrics"]["class_acc"], final["quality"]["kl_data"]]
        assert r["class_acc"] * 8 == pytest.approx(round(r["class_acc"] * 8), abs=1e-6)  # of 8


def test_equal_time_steps_follow_the_matched_arm(bench_out):
    _, report = bench_out
    per_seed = []
    for seed in (0, 1):
        by = {r["arm"]: r for r in report["runs"] if r["seed"] == seed}
        gkd, kd = run_figures(by["gkd"]["run_dir"]), run_figures(by["kd"]["run_dir"])
        per_seed.append(max(1, round(gkd["cpu_s"] / (kd["cpu_s"] / kd["steps"]))))
    want = int(round(float(np.median(per_seed))))          # the median over seeds
    for seed in (0, 1):
        by = {r["arm"]: r for r in report["runs"] if r["seed"] == seed}
        gkd = run_figures(by["gkd"]["run_dir"])
        assert by["kd_equal_time"]["steps"] == want
        assert by["kd_equal_time"]["equal_time"]["per_seed_steps"] == per_seed
        assert by["kd_equal_time"]["equal_time"]["match_cpu_s"] == gkd["cpu_s"]
        cfg = load_config(f"{by['kd_equal_time']['run_dir']}/config.yaml")
        assert cfg.distill.steps == want and cfg.distill.objective == "kd"
        assert len(read_metrics(by["kd_equal_time"]["run_dir"])) == want
    assert equal_time_steps(10.0, 3.0) == 3 and equal_time_steps(0.1, 3.0) == 1


def test_table_is_numpy_mean_and_sd_over_seeds(bench_out):
    out, report = bench_out
    md = (out / "schedules.md").read_text()
    for arm, stats in report["summary"].items():
        for key in ("fid", "precision", "class_acc", "kl_data", "kl_samples", "exposure_gap",
                    "wall_s", "cpu_s", "steps"):
            v = np.array([r[key] for r in report["runs"] if r["arm"] == arm], dtype=float)
            assert stats[key]["n"] == 2
            assert stats[key]["mean"] == pytest.approx(v.mean(), rel=1e-12, abs=1e-15)
            assert stats[key]["sd"] == pytest.approx(v.std(ddof=1), rel=1e-12, abs=1e-15)
        fid = stats["fid"]
        cell = (f"{fid['mean']:.1f} ± {fid['sd']:.1f}" if round(fid["sd"], 1)
                else f"{fid['mean']:.1f}")
        row = next(line for line in md.splitlines() if line.startswith(f"| {arm}"))
        assert row.split(" | ")[1] == cell
    assert md == format_markdown(report)


def test_curves_figures_come_from_the_runs_files(bench_out):
    """schedules.json's curves: kd's plateau on its tracked on-policy KL (evaluations at steps
    0, 2, 4 of 4: m(3) halfway between steps 2 and 4), training time the summed step CPU
    seconds, gkd's crossing on those curves."""
    from launch.bench.schedules_curves import crossing, run_curves, seed_curves
    from opd.eval.tracking import read_quality

    out, report = bench_out
    c = report["curves"]
    assert (c["clock"], c["reference"], list(c["crossings"])) == ("step_cpu_s", "kd", ["gkd"])
    kd = [r for r in report["runs"] if r["arm"] == "kd"]
    kl = [{q["step"]: q["kl_samples"] for q in read_quality(r["run_dir"]) if q["role"] == "student"}
          for r in kd]
    m3, m4 = np.mean([(k[2] + k[4]) / 2 for k in kl]), np.mean([k[4] for k in kl])
    assert c["plateau"]["relative"] == pytest.approx((m3 - m4) / m3, rel=1e-12)
    curves = {arm: [run_curves(r["run_dir"], "step_cpu_s") for r in report["runs"]
                    if r["arm"] == arm] for arm in ("kd", "gkd")}
    for r, run in zip(curves["kd"], kd):
        assert r["seconds"][-1] == pytest.approx(run["cpu_s"], rel=1e-12)
    assert c["crossings"]["gkd"] == crossing(seed_curves(curves["gkd"], "seconds", "kl_samples"),
                                             seed_curves(curves["kd"], "seconds", "kl_samples"))
    assert "## Quality against training time" in (out / "schedules.md").read_text()


def test_mean_sd():
    assert mean_sd([1.0, 2.0, 4.0]) == {"mean": 7 / 3, "sd": float(np.std([1, 2, 4], ddof=1)),
                                        "n": 3}
    assert mean_sd([5.0]) == {"mean": 5.0, "sd": 0.0, "n": 1}
    assert mean_sd([None, float("nan")]) == {"mean": None, "sd": None, "n": 0}


def test_finished_runs_are_reused(bench_out, overrides):
    out, report = bench_out
    b = load_schedules_bench("schedules_tiny", {"overrides": overrides, "seeds": [0, 1]})
    lines = []
    again = run_schedules(b, out, log=lines.append)
    assert all("reusing" in line for line in lines if "steps in" in line or "reusing" in line)
    assert not any("steps in" in line for line in lines)
    assert again["runs"] == report["runs"]
    # only: the named arms; an equal-time arm brings its base and matched arms
    for only, arms in ((["gkd"], ["gkd"] * 2),
                       (["kd_equal_time"], ["kd", "gkd"] * 2 + ["kd_equal_time"] * 2)):
        b.only = only
        part = run_schedules(b, out, log=lambda *_: None)
        assert [r["arm"] for r in part["runs"]] == arms
        assert list(part["summary"]) == list(dict.fromkeys(arms))


@pytest.mark.parametrize("override,word", [
    (dict(arms={}), "arms"),
    (dict(seeds=[0, 0]), "seeds"),
    (dict(equal_time={"kd_t": {"base": "kd", "match": "gdk"}}), "equal_time.kd_t.match"),
    (dict(equal_time={"kd_t": {"base": "kd", "matsh": "gkd"}}), "did you mean 'match'"),
    (dict(arms={"kd": ["distill.objectiv=kd"], "gkd": []}), "arm kd: .*distill.objectiv"),
    (dict(stepz=3), "unknown bench preset key 'stepz'"),
    (dict(final_samples=2), "final_samples"),
    (dict(only=["kd", "gdk"]), "only: 'gdk'"),
])
def test_bad_presets_name_the_key(override, word):
    with pytest.raises(ConfigError, match=word):
        load_schedules_bench("schedules_tiny", override)


def test_shipped_presets_load():
    for name in ("schedules_digits8", "schedules_digits16"):
        b = load_schedules_bench(name)
        assert b.final_samples >= 1000 and len(b.seeds) >= 3
        assert all(et["base"] in b.arms for et in b.equal_time.values())

