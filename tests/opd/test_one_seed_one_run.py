"""The paper's comparison made exact (invariant 3 end to end): with the run's default decoding
("sample", the keyed Gumbel-max rule) `rollout.engine=cached_ar` and the default HB-SJD
(`window: auto`, `gamma: auto`) train the same run in reference mode -- equal losses at every
step -- also when HB-SJD's window policy reads two different machines' calibration files and
so runs other windows."""
import json

from opd.config.schema import load_config
from opd.run.reference import run_reference


def run(overrides, *extra, path):
    cfg = load_config("tiny", [*overrides, "distill.steps=3", "eval.track=false", *extra])
    assert cfg.rollout.decoding == "sample" and cfg.distill.lam == 1.0
    return run_reference(cfg, path, progress=False)


def test_cached_ar_and_hbsjd_on_two_calibrations_train_the_same_run(fresh_calibration,
                                                                     tiny_overrides, tmp_path):
    ar = run(tiny_overrides, "rollout.engine=cached_ar", path=tmp_path / "ar")
    auto = ("rollout.window=auto", "rollout.gamma=auto")
    here = run(tiny_overrides, *auto, path=tmp_path / "here")     # measures this machine
    path = fresh_calibration / "calibration.json"
    data = json.loads(path.read_text())
    for e in data["entries"]:                 # another machine: every window wider than 1 costs 50x
        if e["W"] > 1:
            e["full_s"] = [50 * s for s in e["full_s"]]
            e["compact_s"] = [50 * s for s in e["compact_s"]]
    path.write_text(json.dumps(data))
    there = run(tiny_overrides, *auto, path=tmp_path / "there")
    assert [r["source"] for r in ar] == ["student"] * 3
    for rows in (here, there):
        assert [r["loss"] for r in rows] == [r["loss"] for r in ar]
        assert [r["generated_tokens"] for r in rows] == [r["generated_tokens"] for r in ar]
    assert [r["window_hist"] for r in here] != [r["window_hist"] for r in there]
    assert sum(r["rounds"] for r in here) < sum(r["rounds"] for r in ar)
