"""The data plane of `opd bench step` in ray mode: bytes per step by role, peak memory per
actor, object-store use and the step's time split (rows made by actors/bench/io.py).

    summary = io_summary(rows)        # None when no row carries "io" (reference mode)
    text = format_io_markdown(report) # one table per (mode, engine) that has a summary

A row's "io" maps a role (driver, rollout/<i>, teacher/<j>, learner/<r>) to the payload
bytes it received and sent during that step and its peak RSS so far; "object_store" holds the
plasma store's peak use in that step (see actors/bench/io.py for what is counted where).
"""
from __future__ import annotations

import numpy as np

from launch.bench import common

ROLE_ORDER = ("driver", "rollout", "teacher", "learner")
SPLIT = ("rollout_s", "teacher_s", "learner_s", "weight_sync_s", "step_s")
MIB = 2 ** 20


def _role_key(role: str) -> tuple[int, int]:
    kind, _, index = role.partition("/")
    return ROLE_ORDER.index(kind) if kind in ROLE_ORDER else len(ROLE_ORDER), int(index or 0)


def io_summary(rows: list[dict]) -> dict | None:
    """Per role the bytes received and sent in each measured step (lists, step order) and the
    peak RSS; the object store's peak use; the mean time split of a step (seconds)."""
    rows = [r for r in rows if r.get("io")]
    if not rows:
        return None
    roles = sorted({role for r in rows for role in r["io"]}, key=_role_key)
    out = {"steps": [int(r["step"]) for r in rows], "roles": {}}
    for role in roles:
        got = [r["io"].get(role, {}) for r in rows]
        out["roles"][role] = {
            "received_bytes": [int(g.get("received_bytes", 0)) for g in got],
            "sent_bytes": [int(g.get("sent_bytes", 0)) for g in got],
            "peak_rss_bytes": max(int(g.get("peak_rss_bytes", 0)) for g in got)}
    stores = [r.get("object_store") or {} for r in rows]
    peaks = [s["peak_used_bytes"] for s in stores if s.get("peak_used_bytes") is not None]
    objects = [s["peak_objects"] for s in stores if s.get("peak_objects") is not None]
    out["object_store"] = {"peak_used_bytes": [s.get("peak_used_bytes") for s in stores],
                           "max_used_bytes": max(peaks) if peaks else None,
                           "max_objects": max(objects) if objects else None,
                           "spilled_bytes": stores[-1].get("spilled_bytes"),
                           "error": next((s["error"] for s in stores if s.get("error")), None)}
    out["split"] = {k: float(np.mean([float(r.get(k, 0.0)) for r in rows])) for k in SPLIT}
    return out


def _mib(values: list[int] | int) -> str:
    """'1.234' MiB, or 'a / b / ...' when the steps differ."""
    vals = values if isinstance(values, list) else [values]
    text = [f"{v / MIB:.3f}" for v in vals]
    return text[0] if len(set(text)) == 1 else " / ".join(text)


def format_io_markdown(report: dict) -> str:
    """A bytes-and-memory table per (mode, engine) whose rows carry io, else ''."""
    out = []
    for r in report["results"]:
        s = r.get("io")
        if not s:
            continue
        body = [[role, _mib(v["received_bytes"]), _mib(v["sent_bytes"]),
                 f"{v['peak_rss_bytes'] / MIB:.0f}"] for role, v in s["roles"].items()]
        store = s["object_store"]
        if store["max_used_bytes"] is None:
            store_line = f"not sampled ({store['error'] or 'no samples'})"
        else:
            store_line = (f"peak {_mib(store['peak_used_bytes'])} MiB per step (max "
                          f"{store['max_used_bytes'] / MIB:.1f} MiB, {store['max_objects']} "
                          f"objects), spilled {(store['spilled_bytes'] or 0) / MIB:.1f} MiB")
        split = s["split"]
        out += [f"## Data plane: mode={r['mode']}, engine={r['engine']}", "",
                f"Steps {s['steps']} (one column value per step when they differ). Bytes are "
                f"payload array bytes (numpy nbytes / tensor numel x itemsize) counted where a "
                f"role receives or sends them; the driver's received bytes are what its ray.get "
                f"returned. Peak RSS is the process's ru_maxrss so far (it includes object-store "
                f"pages the process read).", "",
                common.markdown_table(["role", "received MiB/step", "sent MiB/step",
                                       "peak RSS MiB"], body), "",
                f"Object store (plasma, sampled): {store_line}.", "",
                "Step time split (mean s): " + ", ".join(
                    f"{k[:-2].replace('_', ' ')} {split[k]:.2f}" for k in SPLIT), ""]
    return "\n".join(out)
