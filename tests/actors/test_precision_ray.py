"""Invariant 5 in the precision the GPU presets use: with model.dtype=bfloat16 and
learner.precision=bf16 the Ray pipeline (bf16 rollout and teacher workers, a DeepSpeed learner
with float32 weights and a bf16-autocast forward, opd/models/precision.py) gives the reference loop's
losses within BF16_RAY_TOL, greedy and sampled, through two steps (rollout, teacher scoring, the
loss, the update and the broadcast of version 1).
"""
import pytest

from actors.driver.pipeline import run_distributed
from opd.config.schema import load_config
from opd.run.reference import run_reference

BF16 = ("model.dtype=bfloat16", "learner.precision=bf16")
BF16_RAY_TOL = 1e-5
"""Absolute, as float32's LOSS_TOL (tests/actors/test_pipeline.py): both modes do the same
bf16 arithmetic in the same order (measured: equal to the last bit on CPU)."""


def cfg_for(tiny_overrides, *extra):
    return load_config("tiny", [*tiny_overrides, "distill.steps=2", "rollout.gamma=2",
                                "run.checkpoint_every=0", "eval.track=false",
                                "rollout.num_cpus=0.25", "teacher.num_cpus=0.25",
                                "learner.num_cpus=0.5", *BF16, *extra])


@pytest.mark.parametrize("decoding", [
    pytest.param("greedy", marks=pytest.mark.slow),   # [sample]: the same bf16 pipeline
    "sample"])
def test_ray_equals_reference_in_bf16(ray_session, tiny_overrides, tmp_path, decoding):
    cfg = cfg_for(tiny_overrides, f"rollout.decoding={decoding}")
    ref = run_reference(cfg, tmp_path / "ref", progress=False)
    rows = run_distributed(cfg, tmp_path / "ray", progress=False)
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref], rel=0,
                                                     abs=BF16_RAY_TOL)
    assert [r["rounds"] for r in rows] == [r["rounds"] for r in ref]        # the same tokens
    assert [r["onpolicy_logprob_delta_max"] for r in rows] == pytest.approx(
        [r["onpolicy_logprob_delta_max"] for r in ref], abs=1e-6)         # the same bf16 copies
    assert all(r["onpolicy_logprob_delta_max"] > 1e-5 for r in rows)     # bf16's, not float32's ~2e-7
