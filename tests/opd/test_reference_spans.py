"""The reference loop scoring on-policy steps by span (rollout.span, opd/distill/span_scoring.py):
the losses of the unspanned run up to float summation order (1e-5 in float32), bit-identical
run to run and across engines (the same spans of the same tokens), and the teacher seconds that
ran while a rollout call still decoded recorded per step."""
import math

import pytest

from opd.config.schema import load_config
from opd.run.reference import run_reference

KEYS = ("loss", "grad_norm", "teacher_kl/default")


def cfg_for(tiny_overrides, *extra):
    return load_config("tiny", [*tiny_overrides, "run.mode=reference", "distill.steps=3",
                                "rollout.decoding=sample", "rollout.cfg_scale=2.0",
                                "teacher.guided=true", "distill.pieces=2", "eval.track=false",
                                *extra])


@pytest.fixture(scope="module")
def unspanned(tiny_overrides, tmp_path_factory):
    return run_reference(cfg_for(tiny_overrides), tmp_path_factory.mktemp("plain"),
                         progress=False)


@pytest.mark.parametrize("span", [1, 5, 64])
def test_spanned_steps_train_as_the_unspanned_ones(unspanned, tiny_overrides, tmp_path, span):
    rows = run_reference(cfg_for(tiny_overrides, f"rollout.span={span}"), tmp_path,
                         progress=False)
    assert [r["source"] for r in rows] == ["student"] * 3
    assert [r["batch_id"] for r in rows] == [r["batch_id"] for r in unspanned]
    for key in KEYS:
        for a, b in zip(rows, unspanned):
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-5), (key, a[key], b[key])
    assert all(r["teacher_in_rollout_s"] == 0.0 for r in unspanned)
    if span < 8:                             # 8 suffix tokens or more: spans before the end
        assert all(r["teacher_in_rollout_s"] > 0.0 for r in rows)


def test_spanned_runs_are_bit_identical_run_to_run_and_across_engines(tiny_overrides, tmp_path):
    runs = [run_reference(cfg_for(tiny_overrides, "rollout.span=3", f"rollout.engine={e}"),
                          tmp_path / f"{e}{i}", progress=False)
            for i, e in enumerate(("hbsjd", "hbsjd", "cached_ar"))]
    for key in KEYS:
        assert [r[key] for r in runs[0]] == [r[key] for r in runs[1]], key
    for key in ("loss", "grad_norm"):        # the behaviour log-probs are other forwards'
        assert [r[key] for r in runs[0]] == [r[key] for r in runs[2]], key
    assert all(r["teacher_in_rollout_s"] == 0.0 for r in runs[2])   # Cached AR: spans at the end

