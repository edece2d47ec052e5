"""Quality against training time (launch/bench/schedules_curves.py) on synthetic curves with
exact expected numbers: the seed band on a common grid, the plateau's relative improvement over
the last quarter of the budget, and the crossing time of an arm below the reference."""
import numpy as np
import pytest

from launch.bench.schedules_curves import (band, common_grid, crossing, curve_figures,
                                           format_curves, relative_improvement)


def curve(x, y):
    return np.asarray(x, dtype=float), np.asarray(y, dtype=float)


def test_band_interpolates_seeds_on_their_common_grid():
    a, b = curve([0, 10, 20], [1.0, 0.5, 0.3]), curve([0, 12, 22], [1.0, 0.6, 0.2])
    grid = common_grid([a, b])
    assert grid.tolist() == [0, 10, 12, 20]                        # up to the shorter seed's end
    m, sd = band([a, b], grid)
    # seed a at 12: 0.5 - 0.2 * 2/10 = 0.46; seed b at 10: 1 - 0.4 * 10/12; at 20: 0.6 - 0.4 * 8/10
    want_b = np.array([1.0, 1 - 0.4 * 10 / 12, 0.6, 0.28])
    want_a = np.array([1.0, 0.5, 0.46, 0.3])
    np.testing.assert_allclose(m, (want_a + want_b) / 2, rtol=0, atol=1e-15)
    np.testing.assert_allclose(sd, np.abs(want_a - want_b) / np.sqrt(2), rtol=0, atol=1e-15)
    m1, sd1 = band([a], grid)
    assert sd1.tolist() == [0.0] * 4 and m1[2] == pytest.approx(0.46, abs=1e-15)


def test_plateau_is_the_improvement_over_the_last_quarter():
    # budget 400 steps: m(300) = 0.39 (between 200 and 400), m(400) = 0.38 -> 1/39
    p = relative_improvement([curve([0, 100, 200, 400], [1.0, 0.6, 0.4, 0.38])])
    assert (p["from"], p["to"]) == (300.0, 400.0)
    assert p["value_from"] == pytest.approx(0.39, abs=1e-15)
    assert p["relative"] == pytest.approx(1 / 39, abs=1e-15)
    two = relative_improvement([curve([0, 200, 400], [1.0, 0.4, 0.36]),
                                curve([0, 200, 400], [1.0, 0.6, 0.40])])
    # mean curve [1, 0.5, 0.38]: m(300) = 0.44 -> (0.44 - 0.38) / 0.44
    assert two["relative"] == pytest.approx(0.06 / 0.44, abs=1e-15)


def test_crossing_is_the_last_sign_change_interpolated():
    ref = [curve([0, 10, 20, 30, 40], [1.0, 0.6, 0.5, 0.45, 0.44])]
    arm = [curve([0, 15, 30, 45], [1.0, 0.8, 0.4, 0.3])]
    # common span 0..40; at 20 the arm is 1/6 above, at 30 0.05 below: 20 + 10 * (1/6)/(13/60)
    c = crossing(arm, ref)
    assert c["span"] == 40.0
    assert c["seconds"] == pytest.approx(20 + 100 / 13, abs=1e-12)
    # above at the end of the span: not within the budget
    assert crossing([curve([0, 15, 30, 45], [1.0, 0.8, 0.6, 0.5])], ref)["seconds"] is None
    # a dip below and back above does not count; only the last crossing does
    dip = [curve([0, 10, 20, 30, 40], [1.0, 0.5, 0.6, 0.5, 0.40])]
    assert crossing(dip, ref)["seconds"] == pytest.approx(30 + 10 * 0.05 / 0.09, abs=1e-12)
    # below from the start: crosses at the first point where it was not above (t = 0, equal)
    assert crossing([curve([0, 10, 40], [1.0, 0.5, 0.1])], ref)["seconds"] == 0.0


def test_two_seed_crossing_uses_the_mean_of_the_seeds():
    ref = [curve([0, 10], [1.0, 0.5]), curve([0, 10], [1.0, 0.7])]          # mean 1 -> 0.6
    arm = [curve([0, 5, 10], [1.0, 0.9, 0.4]), curve([0, 5, 10], [1.0, 0.9, 0.6])]  # 1, .9, .5
    # d: 0 at 0, 0.9 - 0.8 = 0.1 at 5, 0.5 - 0.6 = -0.1 at 10 -> 7.5
    assert crossing(arm, ref)["seconds"] == pytest.approx(7.5, abs=1e-12)


def test_figures_and_table_from_runs(tmp_path):
    """curve_figures reads quality.parquet and metrics.parquet: the clock is the summed
    step_cpu_s before each evaluation's step."""
    from opd.run.metrics_log import MetricsLog

    def write_run(name, cpu, kl):
        d = tmp_path / name
        d.mkdir()
        m, q = MetricsLog(d), MetricsLog(d, file="quality.parquet")
        for s, c in enumerate(cpu):
            m.append({"step": s, "step_cpu_s": c, "step_s": 2 * c})
        for s, v in zip((0, 2, 4), kl):
            q.append({"step": s, "role": "student", "kl_samples": v, "fid": 1.0,
                      "kl_data": None, "class_acc": None})
        return str(d)

    runs = [{"arm": "kd", "seed": 0, "run_dir": write_run("kd", [1.0] * 4, [1.0, 0.6, 0.5])},
            {"arm": "gkd", "seed": 0, "run_dir": write_run("gkd", [2.0] * 4, [1.0, 0.5, 0.2])}]
    report = {"bench": {"mode": "reference", "reference": "kd", "seeds": [0]}, "runs": runs,
              "summary": {"kd": {"student_share": {"mean": 0.0}},
                          "gkd": {"student_share": {"mean": 1.0}}}}
    f = curve_figures(report)
    # kd: step 2 at 2 s, step 4 at 4 s; m(3) = 0.55 -> (0.55 - 0.5) / 0.55
    assert f["plateau"]["relative"] == pytest.approx(0.05 / 0.55, abs=1e-15)
    assert not f["plateau"]["plateaued"]
    # gkd at 4 s (step 2) is 0.5, kd at 4 s 0.5: equal, then no later common time -> span 4 s,
    # the arm is not below at its end
    assert f["crossings"] == {"gkd": {"seconds": None, "span": 4.0}}
    report["curves"] = f
    text = "\n".join(format_curves(report))
    assert "9.1 % over the last quarter of its budget: still improving" in text
    assert "| gkd | not within the budget | 0–4.0 s |" in text
