"""gamma='auto' on Ray: the calibration entries of every sub-batch size a run may split its steps
into are in $OPD_CACHE/calibration.json once its rollout workers have started (the first worker
measures them under the file's lock; the others, and the steps, read them)."""
from actors.driver.pipeline import run_distributed
from opd.config.schema import load_config
from rollout.calibrate import read_calibration


def test_piece_entries_exist_once_a_ray_run_has_started(ray_session, tiny_overrides,
                                                            fresh_calibration, tmp_path):
    cfg = load_config("tiny", [*tiny_overrides, "distill.steps=1", "eval.track=false",
                               "rollout.num_workers=3", "run.checkpoint_every=0",
                               "rollout.num_cpus=0.25", "teacher.num_cpus=0.25",
                               "learner.num_cpus=0.5"])
    assert cfg.rollout.gamma == "auto"
    rows = run_distributed(cfg, tmp_path / "run", progress=False)
    assert [r["source"] for r in rows] == ["student"]
    entries = read_calibration(fresh_calibration / "calibration.json")
    # 4 rows in 3 pieces (2, 1, 1), one per worker: the piece sizes are the config's, whatever
    # workers are up (opd/distill/pieces.py), so these two entries are all a run needs
    assert sorted((e["batch"], e["W"], e["cfg"], e["preset"]) for e in entries) == [
            (1, 4, False, "GPT-digits-S"), (2, 4, False, "GPT-digits-S")]
