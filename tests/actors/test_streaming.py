"""Streaming strict steps (docs/STREAMING.md): a step's pieces flow through rollout, teacher and
learner, the learner accumulates gradients over them in piece order and updates once.

Invariant 5 with streaming: the Ray run equals the reference loop, which accumulates the same
pieces in the same order; with 2 rollout and 2 teacher workers, 2 learner ranks (ZeRO 2, which
reduces gradients at every backward, so every rank must run one per piece) and across a phase
boundary (KD on data, then on-policy GKD on sampled student rollouts).  Every batch is consumed
once and every student step is on-policy (the learner's recomputed log-probs of the student's
tokens, with the weights of version k, match the rollout's within 1e-4).
"""
import json

import pytest

from actors.driver.pipeline import run_distributed
from actors.driver.records import CONSUMED_FILE
from opd.config.schema import load_config
from opd.distill.onpolicy import STRICT_BOUND
from opd.run.reference import run_reference

STEPS = 4
LOSS_TOL = 1e-5
"""As tests/actors/test_pipeline.py: the same loss code and the same pieces in both; DeepSpeed's
gradient all-reduce and clip round differently (float32, ~1e-7 here)."""

PHASES = ("distill.phases=[{name: warm, steps: 1, objective: kd}, "
          "{name: onpolicy, objective: gkd, lam: 1.0}]")


def cfg_for(tiny_overrides, *extra):
    return load_config("tiny", [*tiny_overrides, f"distill.steps={STEPS}", PHASES,
                                "data.batch_size=8", "rollout.gamma=2", "rollout.decoding=sample",
                                "run.checkpoint_every=0", "rollout.num_cpus=0.25",
                                "teacher.num_cpus=0.25", "learner.num_cpus=0.25",
                                "eval.track=false", *extra])


@pytest.fixture(scope="module")
def runs(ray_session, tiny_overrides, tmp_path_factory):
    """(ray rows, reference rows, ray run dir) per case, each run once."""
    cache = {}

    def run(*extra):
        if extra not in cache:
            cfg = cfg_for(tiny_overrides, *extra)
            d = tmp_path_factory.mktemp("stream")
            ref = run_reference(cfg, d / "ref", progress=False)
            rows = run_distributed(cfg, d / "ray", progress=False)
            cache[extra] = rows, ref, d / "ray"
        return cache[extra]
    return run


CASES = {
    "2x2 workers, 4 pieces": ("rollout.num_workers=2", "teacher.num_workers=2", "distill.pieces=4"),
    "2 ranks ZeRO 2, 4 pieces": ("learner.world_size=2", "learner.zero_stage=2",
                                 "distill.pieces=4"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_steps_equal_the_reference_loop(runs, case):
    rows, ref, run_dir = runs(*CASES[case])
    assert [r["phase"] for r in rows] == ["warm"] + ["onpolicy"] * (STEPS - 1)
    assert [r["source"] for r in rows] == ["data"] + ["student"] * (STEPS - 1)
    assert [r["pieces"] for r in rows] == [1] + [4] * (STEPS - 1) == [r["pieces"] for r in ref]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref], rel=0, abs=LOSS_TOL)
    assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in ref],
                                                           rel=1e-4)
    record = json.loads((run_dir / CONSUMED_FILE).read_text())
    assert record["consumed"] == {str(b): 1 for b in range(STEPS)}
    for r in rows[1:]:                                # the student steps: strict, version k
        assert r["policy_version"] == r["step"] and r["policy_lag"] == 0
        assert r["onpolicy_tokens"] == r["generated_tokens"] == 8 * (64 - r["prefix_len"])
        assert r["onpolicy_logprob_delta_max"] < STRICT_BOUND


def test_one_piece_is_the_whole_batch_and_streaming_only_reorders_the_sum(runs):
    """distill.pieces=1 is the unstreamed step: the same tokens (sampled, keyed by image), so
    the same losses up to float summation order."""
    streamed, _, _ = runs(*CASES["2x2 workers, 4 pieces"])
    whole, _, _ = runs("rollout.num_workers=2", "teacher.num_workers=2", "distill.pieces=1")
    assert [r["pieces"] for r in whole] == [1] * STEPS   # the data step is one piece anyway
    assert [r["generated_tokens"] for r in whole] == [r["generated_tokens"] for r in streamed]
    assert [r["loss"] for r in whole] == pytest.approx([r["loss"] for r in streamed], rel=0,
                                                       abs=LOSS_TOL)


def test_cached_ar_and_hbsjd_train_the_same_ray_run(runs):
    """The paper's comparison made exact on Ray (invariant 3 with the streamed step): sampled
    Cached AR and HB-SJD commit the same tokens into the same pieces, so the losses and
    gradient norms of every step are the same numbers; only the rounds differ."""
    hbsjd, _, _ = runs(*CASES["2x2 workers, 4 pieces"])
    cached, _, _ = runs(*CASES["2x2 workers, 4 pieces"], "rollout.engine=cached_ar")
    assert [r["loss"] for r in cached] == [r["loss"] for r in hbsjd]
    assert [r["grad_norm"] for r in cached] == [r["grad_norm"] for r in hbsjd]
    assert [r["generated_tokens"] for r in cached] == [r["generated_tokens"] for r in hbsjd]
    assert all(h["rounds"] < c["rounds"] for h, c in zip(hbsjd[1:], cached[1:]))
