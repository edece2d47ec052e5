"""Independent Batched SJD: HB-SJD's round (rollout/hbsjd.py), every image with its own cursor
and window, with Full execution always (gamma 0: no switch to Compact) and a fixed window."""
from __future__ import annotations

from rollout.engine import register
from rollout.hbsjd import JacobiEngine


@register("sjd_independent")
class IndependentSJD(JacobiEngine):
    """Independent Batched SJD: per-image cursors, Full execution, no switching."""
