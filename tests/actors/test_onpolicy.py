"""On-policy, proven every step, in the Ray pipeline: the learner's gap between its own
log-probs and the rollout's reaches metrics.parquet (opd/distill/onpolicy.py).  Strict runs stay below
STRICT_BOUND; a rollout worker made to keep older weights while it claims the published
version (a broken weight sync that the version check cannot see) is caught by the metric."""
import re
import time

import pytest
import ray

from actors.driver.pipeline import run_distributed
from opd.config.schema import load_config
from opd.distill.onpolicy import STRICT_BOUND
from tests.actors.test_pipeline import scrape_metrics

STEPS, FROZEN_AFTER = 5, 1


@pytest.mark.slow   # the check catches stale weights: tests/opd/test_onpolicy.py
#                      (test_stale_weights_give_the_weights_own_logprob_change); Ray rows carry
#                      it: test_phases_ray, test_precision_ray
def test_a_worker_with_stale_weights_is_caught_by_the_metric(ray_session, tiny_overrides,
                                                            tmp_path):
    cfg = load_config("tiny", [*tiny_overrides, f"distill.steps={STEPS}", "rollout.gamma=2",
                               "rollout.decoding=sample", "run.checkpoint_every=0",
                               "learner.warmup_steps=0", "eval.track=false",
                               "rollout.num_cpus=0.25", "teacher.num_cpus=0.25",
                               "learner.num_cpus=0.5"])
    held = []

    def keep_old_weights(worker) -> int:
        """Runs inside a rollout worker (a closure: shipped by value): later weight loads copy
        into clones, so the student copy keeps the version it holds now, while `version` goes
        on naming each published one."""
        model = worker.model
        model.state_dict = lambda *a, **k: {name: t.clone() for name, t in
                                            type(model).state_dict(model, *a, **k).items()}
        return worker.version

    exported = []
    gauge = re.compile(r'^ray_opd_onpolicy_logprob_delta\{[^}]*role="learner"[^}]*\} (\S+)$', re.M)

    def freeze(pipeline, step, row):
        if step == FROZEN_AFTER:     # before version FROZEN_AFTER + 1 is published
            held.append(ray.get(pipeline.rollout[0].__ray_call__.remote(keep_old_weights)))
        if step == STEPS - 1:        # the learner's gauge, as Ray exports it (every ~1 s here)
            deadline = time.time() + 60
            while time.time() < deadline:
                values = [float(v) for v in gauge.findall(scrape_metrics())]
                if values and values[0] == row["onpolicy_logprob_delta_max"]:
                    exported.extend(values)
                    break
                time.sleep(1)

    rows = run_distributed(cfg, tmp_path, progress=False, hooks={"after_step": freeze})
    assert held == [FROZEN_AFTER]
    assert exported == [rows[-1]["onpolicy_logprob_delta_max"]]       # one learner rank
    assert [r["source"] for r in rows] == ["student"] * STEPS
    assert [r["policy_lag"] for r in rows] == [0] * STEPS     # the versions look strict
    for r in rows:
        assert r["onpolicy_tokens"] == r["generated_tokens"] == 4 * (64 - r["prefix_len"])
    gaps = [r["onpolicy_logprob_delta_mean"] for r in rows]
    print("onpolicy_logprob_delta_mean per step:", gaps,
          "max:", [r["onpolicy_logprob_delta_max"] for r in rows])
    for r in rows[:FROZEN_AFTER + 1]:
        assert r["onpolicy_logprob_delta_max"] < STRICT_BOUND
    for r in rows[FROZEN_AFTER + 1:]:
        assert r["onpolicy_logprob_delta_mean"] > 10 * STRICT_BOUND
        assert r["onpolicy_logprob_delta_max"] > 100 * STRICT_BOUND
