"""The Grafana dashboard of the opd metrics, built from the metric registry in actors/ray_metrics.py.

    python -m launch.dashboard > launch/grafana/opd_dashboard.json

Ray exports every metric with a `ray_` prefix on each node's metrics port; counters get a
`_total` suffix and histograms `_bucket` / `_sum` / `_count`.  Point Grafana at the Prometheus
that scrapes Ray (Ray writes its own scrape config under /tmp/ray/session_latest/metrics) and
import the JSON; Ray's dashboard embeds Grafana panels when RAY_GRAFANA_HOST is set.
"""
from __future__ import annotations

import json
import sys

from actors.ray_metrics import BOUNDARIES, COUNTERS, GAUGES, HISTOGRAMS

PATH = "launch/grafana/opd_dashboard.json"


def _panel(pid: int, title: str, description: str, expr: str, legend: str, unit: str) -> dict:
    return {
        "id": pid, "type": "timeseries", "title": title, "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 8, "x": 8 * ((pid - 1) % 3), "y": 8 * ((pid - 1) // 3)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [{"expr": expr, "legendFormat": legend, "refId": "A"}],
    }


def build_dashboard() -> dict:
    panels, legend = [], "{{role}} {{worker}}"
    for name, desc in GAUGES.items():
        unit = "bytes" if name.endswith("bytes") else "percentunit" if "ratio" in name else "short"
        panels.append((name, desc, f"ray_{name}", legend, unit))
    for name, desc in HISTOGRAMS.items():
        if name in BOUNDARIES:        # counts (tokens, rounds): the median, not a latency p95
            expr = (f"histogram_quantile(0.5, sum by (le, role) "
                    f"(rate(ray_{name}_bucket[1m])))")
            panels.append((name + " (median)", desc, expr, "{{role}} median", "short"))
            continue
        expr = (f"histogram_quantile(0.95, sum by (le, role) "
                f"(rate(ray_{name}_bucket[1m])))")
        panels.append((name + " (p95)", desc, expr, "{{role}} p95", "s"))
    for name, desc in COUNTERS.items():
        panels.append((name + " (rate)", desc, f"sum by (role) (rate(ray_{name}_total[1m]))",
                       "{{role}}", "short"))
    return {
        "title": "opd: on-policy distillation", "uid": "opd-main", "schemaVersion": 39,
        "tags": ["opd", "ray"], "time": {"from": "now-30m", "to": "now"}, "refresh": "10s",
        "templating": {"list": [{"name": "datasource", "type": "datasource",
                                 "query": "prometheus", "label": "Prometheus"},
                                _teacher_variable()]},
        "panels": [_panel(i + 1, *p) for i, p in enumerate(panels)]
        + [_distribution(len(panels) + 1, "opd_rollout_commit_length"),
           _per_teacher(len(panels) + 2)],
    }


def _teacher_variable() -> dict:
    """The run's teachers (opd/distill/teachers.py; one: "default"), by the names the driver
    reports their on-policy KL under."""
    return {"name": "teacher", "type": "query", "label": "Teacher", "multi": True,
            "includeAll": True, "current": {"text": "All", "value": "$__all"},
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": "label_values(ray_opd_teacher_onpolicy_kl, worker)", "refresh": 2}


def _per_teacher(pid: int) -> dict:
    """A panel per teacher (Grafana repeats it over $teacher): its on-policy KL and rows per
    step (the driver's gauges, worker = its name) and its workers' scored tokens per second
    (worker = <name>/<index>)."""
    panel = _panel(pid, "teacher $teacher", "One of the run's teachers: "
                   + GAUGES["opd_teacher_onpolicy_kl"],
                   'ray_opd_teacher_onpolicy_kl{worker="$teacher"}', "on-policy KL", "short")
    panel["targets"] += [
        {"expr": 'ray_opd_teacher_rows{worker="$teacher"}', "legendFormat": "rows per step",
         "refId": "B"},
        {"expr": 'sum(rate(ray_opd_teacher_tokens_total{worker=~"$teacher/.*"}[1m]))',
         "legendFormat": "scored tokens/s", "refId": "C"}]
    panel.update(repeat="teacher", repeatDirection="h", maxPerRow=3)
    panel["gridPos"] = {"h": 8, "w": 8, "x": 0, "y": 8 * -(-(pid - 1) // 3) + 8}
    return panel


def _distribution(pid: int, name: str) -> dict:
    """A bar gauge of a count histogram's buckets over the last 5 minutes: how many
    image-rounds committed up to 1, 2, 3, ... tokens (stalled images show as a tall first bar)."""
    return {
        "id": pid, "type": "bargauge", "title": name + " (distribution, last 5 min)",
        "description": HISTOGRAMS[name],
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 24, "x": 0, "y": 8 * -(-(pid - 1) // 3)},   # below the grid
        "fieldConfig": {"defaults": {"unit": "short"}, "overrides": []},
        "options": {"displayMode": "gradient", "orientation": "vertical"},
        "targets": [{"expr": f"sum by (le) (increase(ray_{name}_bucket[5m]))",
                     "legendFormat": "<= {{le}}", "format": "heatmap", "refId": "A"}],
    }


def main() -> None:
    json.dump(build_dashboard(), sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
