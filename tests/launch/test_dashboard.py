"""The committed Grafana dashboard shows every opd metric and matches its generator."""
import json
from pathlib import Path

from actors.ray_metrics import ALL, COUNTERS, HISTOGRAMS
from launch.dashboard import PATH, build_dashboard

ROOT = Path(__file__).resolve().parents[2]


def test_committed_dashboard_is_current():
    assert json.loads((ROOT / PATH).read_text()) == build_dashboard(), (
        "regenerate with: python -m launch.dashboard > " + PATH)


def test_every_metric_has_a_panel_with_rays_exported_name():
    exprs = " ".join(t["expr"] for p in build_dashboard()["panels"] for t in p["targets"])
    for name in ALL:
        exported = (f"ray_{name}_total" if name in COUNTERS else
                    f"ray_{name}_bucket" if name in HISTOGRAMS else f"ray_{name}")
        assert exported in exprs, name


def test_each_teacher_gets_its_own_panel():
    """Grafana repeats the per-teacher panel over the $teacher variable, whose values are the
    names the driver reports each teacher's on-policy KL under."""
    from launch.dashboard import build_dashboard
    d = build_dashboard()
    var = next(v for v in d["templating"]["list"] if v["name"] == "teacher")
    assert var["query"] == "label_values(ray_opd_teacher_onpolicy_kl, worker)"
    panel = next(p for p in d["panels"] if p.get("repeat") == "teacher")
    exprs = [t["expr"] for t in panel["targets"]]
    assert 'ray_opd_teacher_onpolicy_kl{worker="$teacher"}' in exprs
    assert any('worker=~"$teacher/.*"' in e for e in exprs)
