"""Ray metrics of the pipeline (`ray.util.metrics`), tagged by role and worker.

Every process (driver, rollout / teacher workers, learner ranks) makes its own `RoleMetrics`;
Ray exports them on each node's metrics port with a `ray_` prefix (`ray_opd_rollout_tokens_per_s`
…), for the Ray dashboard, Prometheus and Grafana.  The same figures, per step, go to the run
directory's metrics.parquet through the driver (`opd.run.metrics_log.MetricsLog`).
"""
from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

TAG_KEYS = ("role", "worker")
SECONDS_BOUNDARIES = [0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0]

GAUGES = {
    "opd_rollout_tokens_per_s": "Generated tokens per second of the last rollout.",
    "opd_rollout_rounds": "Sequential verifier forwards of the last rollout (prefill included).",
    "opd_rollout_mean_committed": "Tokens committed per image per active round in the last rollout.",
    "opd_rollout_longest_single_run": "Longest run of one-token rounds of any image in the last rollout (a stalled image).",
    "opd_rollout_image_rounds_max": "Rounds of the slowest image of the last rollout.",
    "opd_teacher_tokens_per_s": "Scored tokens per second of the last teacher call.",
    "opd_teacher_onpolicy_kl": "Several teachers: the last step's on-policy KL(student || teacher) on the rows the teacher scored (worker: the teacher's name; opd/distill/teachers.py).",
    "opd_teacher_rows": "Several teachers: rows the teacher scored in the last step (worker: its name).",
    "opd_queue_depth": "Trajectory batches waiting for the learner.",
    "opd_policy_lag": "Policy-version lag of the last consumed batch (0 in strict on-policy mode).",
    "opd_learner_samples_per_s": "Sequences per second of the last learner step.",
    "opd_weight_sync_bytes": "Bytes of the last published student weights.",
    "opd_policy_version": "Current policy version (learner steps done).",
    "opd_idle_ratio": "Fraction of the last step the role's workers were idle.",
    "opd_onpolicy_logprob_delta": "Max |recomputed - recorded| behaviour log-prob of the student tokens of the learner rank's last shard (~0 strict on-policy; opd/distill/onpolicy.py).",
}
COMMIT_BOUNDARIES = [1.5, 2.5, 3.5, 4.5, 6.5, 8.5, 12.5, 16.5]
ROUNDS_BOUNDARIES = [4, 8, 16, 24, 32, 48, 64, 128, 256, 576]
HISTOGRAMS = {
    "opd_rollout_seconds": "Seconds per rollout call.",
    "opd_rollout_commit_length": "Tokens committed per image per round (acceptance length).",
    "opd_rollout_image_rounds": "Rounds each image of a rollout was active (per-image rounds).",
    "opd_rollout_window": "Window W of each verifier round (rollout.window; auto chooses it per round).",
    "opd_teacher_seconds": "Seconds per teacher scoring call.",
    "opd_learner_step_seconds": "Seconds per learner step.",
    "opd_weight_sync_seconds": "Seconds from a learner update to every rollout worker holding it.",
    "opd_step_seconds": "Wall seconds per pipeline step.",
}
COUNTERS = {
    "opd_rollout_tokens": "Generated tokens.",
    "opd_teacher_tokens": "Scored tokens.",
    "opd_learner_samples": "Sequences trained on.",
    "opd_reissued_calls": "Rollout calls issued again (a worker failed, a piece was lost, a step was re-planned).",
    "opd_rescored_pieces": "Piece scorings issued again (a worker failed, a piece was lost).",
}
ALL = {**GAUGES, **HISTOGRAMS, **COUNTERS}
BOUNDARIES = {"opd_rollout_commit_length": COMMIT_BOUNDARIES,
              "opd_rollout_window": COMMIT_BOUNDARIES,
              "opd_rollout_image_rounds": ROUNDS_BOUNDARIES}


class RoleMetrics:
    """The opd metrics of one process, with its (role, worker) tags preset."""

    def __init__(self, role: str, worker: int | str = 0):
        self.tags = {"role": role, "worker": str(worker)}
        self._m: dict[str, Gauge | Histogram | Counter] = {}

    def _get(self, name: str):
        if name not in self._m:
            if name in GAUGES:
                m = Gauge(name, description=GAUGES[name], tag_keys=TAG_KEYS)
            elif name in HISTOGRAMS:
                m = Histogram(name, description=HISTOGRAMS[name],
                              boundaries=BOUNDARIES.get(name, SECONDS_BOUNDARIES),
                              tag_keys=TAG_KEYS)
            elif name in COUNTERS:
                m = Counter(name, description=COUNTERS[name], tag_keys=TAG_KEYS)
            else:
                raise KeyError(f"unknown opd metric {name!r}; known: {sorted(ALL)}")
            m.set_default_tags(self.tags)
            self._m[name] = m
        return self._m[name]

    def set(self, name: str, value: float) -> None:
        self._get(name).set(float(value))

    def observe(self, name: str, value: float) -> None:
        self._get(name).observe(float(value))

    def inc(self, name: str, value: float = 1.0) -> None:
        if value > 0:
            self._get(name).inc(float(value))

    def report(self, **values: float) -> None:
        """Set gauges, observe histograms and increment counters by name (without `opd_`)."""
        for key, value in values.items():
            name = key if key.startswith("opd_") else f"opd_{key}"
            if name in GAUGES:
                self.set(name, value)
            elif name in HISTOGRAMS:
                self.observe(name, value)
            else:
                self.inc(name, value)
