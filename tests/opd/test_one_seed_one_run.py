"""The paper's comparison made exact (invariant 3 end to end): with the run's default decoding
("sample", the keyed Gumbel-max rule) `rollout.engine=cached_ar` and the default HB-SJD
(`window: auto`) train the same run in reference mode -- equal losses at every step -- also
when HB-SJD's windows are another machine's: the measured policy's own choices, and a schedule
that switches W and Full / Compact between rounds (tests/rollout/schedules.py)."""
from opd.config.schema import load_config
from opd.run.reference import run_reference
from tests.rollout.schedules import graded, steer


def run(overrides, *extra, path):
    cfg = load_config("tiny", [*overrides, "distill.steps=3", "eval.track=false", *extra])
    assert cfg.rollout.decoding == "sample" and cfg.distill.lam == 1.0
    return run_reference(cfg, path, progress=False)


def test_cached_ar_and_hbsjd_under_two_window_choices_train_the_same_run(tiny_overrides,
                                                                          tmp_path):
    ar = run(tiny_overrides, "rollout.engine=cached_ar", path=tmp_path / "ar")
    here = run(tiny_overrides, "rollout.window=auto", path=tmp_path / "here")   # measured
    with steer(graded):
        there = run(tiny_overrides, "rollout.window=auto", path=tmp_path / "there")
    assert [r["source"] for r in ar] == ["student"] * 3
    for rows in (here, there):
        assert [r["loss"] for r in rows] == [r["loss"] for r in ar]
        assert [r["generated_tokens"] for r in rows] == [r["generated_tokens"] for r in ar]
    assert [r["window_hist"] for r in here] != [r["window_hist"] for r in there]
    assert sum(r["rounds"] for r in there) < sum(r["rounds"] for r in ar)
