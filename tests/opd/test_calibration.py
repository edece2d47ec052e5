"""One calibration file: which entries a run needs (opd/run/calibration.py), and `opd calibrate`
writing exactly what training and evaluation then read without measuring again."""
import pytest

from opd.run.calibration import (eval_batch_sizes, prepare_calibration, rollout_batch_sizes,
                             run_batch_sizes, uses_calibration)
from opd.config.schema import load_config
from opd.eval.sample import sample_tokens
from opd.models.factory import load_role_model
from opd.run.reference import run_reference
from rollout.calibrate import read_calibration


@pytest.mark.parametrize("extra,sizes", [
    ([], [4]),                                               # one rollout, one teacher worker: 1 call
    (["run.mode=reference", "rollout.num_workers=3"], [1, 2]),  # both modes cut alike: 2, 1, 1
    (["rollout.num_workers=2"], [2]),                        # a rollout call per worker
    (["rollout.num_workers=1..3"], [1, 2]),                  # elastic: a piece per worker at most
    (["teacher.num_workers=2"], [2]),                        # at least one piece per teacher
    (["distill.pieces=3"], [4]),                             # 3 pieces, one rollout call
    (["data.batch_size=5", "rollout.num_workers=2"], [2, 3]),
    (["rollout.num_workers=2", "rollout.slots=3"], [2]),     # pieces of 2 images, under 3 slots
    (["data.batch_size=32"], [32]),                          # 4 pieces of 8, one call
    (["data.batch_size=32", "learner.world_size=2"], [32]),
    (["data.batch_size=32", "rollout.num_workers=2"], [16]),  # 2 calls of 2 pieces each
])
def test_rollout_batch_sizes_are_the_sizes_of_the_steps_rollout_calls(tiny_overrides, extra, sizes):
    assert rollout_batch_sizes(load_config("tiny", [*tiny_overrides, *extra])) == sizes


def test_eval_batch_sizes(tiny_overrides):
    cfg = load_config("tiny", tiny_overrides)
    assert eval_batch_sizes(cfg) == [8]                      # 8 samples, 8 KL rows
    assert run_batch_sizes(cfg) == [4, 8]
    big = load_config("tiny", [*tiny_overrides, "eval.num_samples=120", "eval.kl_rows=60"])
    assert eval_batch_sizes(big) == [10, 20, 50]             # 50+50+20 samples, 50+10 rows


def test_fixed_gamma_needs_no_calibration(tiny_overrides, fresh_calibration):
    cfg = load_config("tiny", [*tiny_overrides, "rollout.gamma=2"])
    assert uses_calibration(load_config("tiny", tiny_overrides))
    assert not uses_calibration(cfg)
    assert not uses_calibration(load_config("tiny", [*tiny_overrides, "rollout.engine=cached_ar"]))
    assert not uses_calibration(load_config("tiny", [*tiny_overrides, "rollout.window=auto"]))
    assert prepare_calibration(load_role_model(cfg, "student", progress=False), cfg, [4]) == {}
    assert not (fresh_calibration / "calibration.json").exists()


def test_opd_calibrate_writes_what_training_and_evaluation_read(
        tiny_overrides, fresh_calibration, tmp_path, monkeypatch, capsys):
    import rollout.calibrate as rc
    from launch.cli import main
    measured = []
    measure = rc.measure_verifier_latencies
    monkeypatch.setattr(rc, "measure_verifier_latencies",
                        lambda model, batch, windows, **kw: measured.append(batch) or
                        measure(model, batch, windows, **kw))
    assert main(["calibrate", "--config", "tiny", *tiny_overrides, "--repeats", "1",
                 "--threads", "1"]) == 0
    path = fresh_calibration / "calibration.json"
    assert f"-> {path}" in capsys.readouterr().out
    assert measured == [4, 8]                    # the run's rollout batch and evaluation batch
    written = read_calibration(path)
    assert [(e["batch"], e["W"], e["cfg"], e["preset"]) for e in written] == \
        [(4, 4, False, "GPT-digits-S"), (8, 4, False, "GPT-digits-S")]

    cfg = load_config("tiny", [*tiny_overrides, "run.mode=reference", "distill.steps=2",
                               "eval.track=false"])
    rows = run_reference(cfg, tmp_path / "run", progress=False)
    assert [r["source"] for r in rows] == ["student", "student"]      # HB-SJD rollouts ran
    student = load_role_model(cfg, "student", progress=False)
    samples = sample_tokens(student, cfg, cfg.eval.num_samples)      # what evaluation samples
    assert samples.stats["options"]["gamma"] == "auto"
    assert measured == [4, 8]                                        # nothing measured again
    assert read_calibration(path) == written                         # nor written


@pytest.mark.parametrize("mode, threads", [("ray", 1), ("reference", 2)])
def test_opd_calibrate_measures_at_the_threads_the_runs_rollouts_use(
        tiny_overrides, fresh_calibration, mode, threads):
    """A CPU table is kept per thread count: for a ray run, the rollout workers' (their CPU
    share, rollout.num_cpus 0.5: one thread), whatever this process runs; for the reference
    loop, this process's own (two here)."""
    import torch
    from launch.cli import main
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["calibrate", "--config", "tiny", *tiny_overrides, f"run.mode={mode}",
                     "rollout.num_cpus=0.5", "--repeats", "1", "--batch", "4",
                     "--window", "4"]) == 0
    finally:
        torch.set_num_threads(before)
    [entry] = read_calibration(fresh_calibration / "calibration.json")
    assert entry["model"].endswith(f"-cpu-th{threads}")
