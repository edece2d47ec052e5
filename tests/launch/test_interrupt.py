"""Ctrl-C: `opd train` finishes the current step, checkpoints it, exits 130 with one line naming
the checkpoint and the `--resume` command; the resumed run has the losses of an uninterrupted
run (invariant 8), in run.mode=reference (exactly) and run.mode=ray (to LOSS_TOL)."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from opd.config.schema import load_config
from opd.run.metrics_log import read_metrics
from opd.run.reference import run_reference

ROOT = Path(__file__).resolve().parents[2]
LOSS_TOL = 1e-5


def overrides(digits_dir, steps: int, *extra) -> list[str]:
    return [f"data.data_dir={digits_dir}", f"distill.steps={steps}", "rollout.gamma=2",
            "rollout.decoding=greedy", "run.checkpoint_every=0", "rollout.num_cpus=0.25",
            "teacher.num_cpus=0.25", "learner.num_cpus=0.5", *extra]


def env(opd_cache) -> dict:
    e = {**os.environ, "OPD_CACHE": str(opd_cache), "OMP_NUM_THREADS": "1",
         "RAY_AUTH_MODE": "disabled"}
    e.pop("RAY_ADDRESS", None)
    return e


def opd(*argv: str) -> list[str]:
    return [sys.executable, "-m", "launch.cli", *argv]


def interrupt_after(argv: list[str], run_dir: Path, rows: int, environ: dict):
    """Start `opd ...`, send SIGINT once metrics.parquet has `rows` rows; (returncode, stderr)."""
    proc = subprocess.Popen(argv, cwd=ROOT, env=environ, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    try:
        while time.time() < deadline and proc.poll() is None:
            metrics = run_dir / "metrics.parquet"
            if metrics.is_file() and len(read_metrics(metrics)) >= rows:
                proc.send_signal(signal.SIGINT)
                break
            time.sleep(0.1)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


def check_interrupted(code: int, err: str, run_dir: Path, steps: int) -> int:
    """The exit code, the one-line message and the checkpoint; returns the steps done."""
    assert code == 130, err[-3000:]
    last = err.strip().splitlines()[-1]
    m = re.fullmatch(r"opd train: interrupted with (\d+) steps done; checkpoint (\S+); "
                     r"continue with: opd train --resume (\S+)", last)
    assert m, last
    done = int(m.group(1))
    assert 1 <= done < steps
    assert m.group(2) == str(run_dir / "checkpoints" / f"step_{done:06d}") and m.group(3) == str(run_dir)
    assert json.loads((Path(m.group(2)) / "state.json").read_text())["step"] == done
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(done))
    return done


def ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)                     # the handler runs in the main thread meanwhile


def test_first_ctrl_c_is_deferred_inside_the_loop_the_second_aborts():
    from opd.run.interrupt import GracefulInterrupt
    before = signal.getsignal(signal.SIGINT)
    with GracefulInterrupt(notice=False) as stop:
        with pytest.raises(KeyboardInterrupt):          # not armed (start-up): at once
            ctrl_c()
        stop.count = 0
        with stop.armed():
            ctrl_c()                                    # deferred to the next safe point
            assert stop.pending()
            with pytest.raises(KeyboardInterrupt), stop.safe():
                pass
            with pytest.raises(KeyboardInterrupt):      # a second Ctrl-C: at once
                ctrl_c()
        stop.count = 0
        with stop.armed(), pytest.raises(KeyboardInterrupt), stop.safe():
            ctrl_c()                                    # while only waiting: at once
    assert signal.getsignal(signal.SIGINT) is before


def test_ctrl_c_in_reference_mode_checkpoints_and_resumes_exactly(digits_dir, opd_cache, tmp_path):
    steps = 16
    args = overrides(digits_dir, steps, "run.mode=reference")
    run_dir = tmp_path / "run"
    code, err = interrupt_after(opd("train", "--config", "tiny", *args, f"run.dir={run_dir}"),
                                run_dir, 1, env(opd_cache))
    check_interrupted(code, err, run_dir, steps)
    resumed = subprocess.run(opd("train", "--resume", str(run_dir)), cwd=ROOT, env=env(opd_cache),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(steps))
    whole = run_reference(load_config("tiny", args), tmp_path / "whole", progress=False)
    assert [r["loss"] for r in rows] == [r["loss"] for r in whole]


@pytest.mark.slow   # the default run covers Ray's SIGINT via `ray job stop` (test_job_submit)
def test_ctrl_c_in_ray_mode_checkpoints_and_resumes(digits_dir, opd_cache, tmp_path):
    steps = 25
    args = overrides(digits_dir, steps)
    run_dir = tmp_path / "run"
    code, err = interrupt_after(opd("train", "--config", "tiny", *args, f"run.dir={run_dir}"),
                                run_dir, 2, env(opd_cache))
    check_interrupted(code, err, run_dir, steps)
    resumed = subprocess.run(opd("train", "--resume", str(run_dir)), cwd=ROOT, env=env(opd_cache),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(steps))
    consumed = json.loads((run_dir / "consumed.json").read_text())["consumed"]
    assert consumed == {str(b): 1 for b in range(steps)}
    whole = run_reference(load_config("tiny", args), tmp_path / "whole", progress=False)
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in whole], rel=0, abs=LOSS_TOL)
