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
                                 "query": "prometheus", "label": "Prometheus"}]},
        "panels": [_panel(i + 1, *p) for i, p in enumerate(panels)]
        + [_distribution(len(panels) + 1, "opd_rollout_commit_length")],
    }


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
