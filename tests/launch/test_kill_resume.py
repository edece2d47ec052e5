"""SIGKILL of `opd train` at random points, also inside a checkpoint write, then `--resume`:
every step's metrics row exactly once, every batch id consumed exactly once, the losses of an
uninterrupted run (invariant 8), only complete checkpoints left, the stale lock taken over.

One subprocess (this file run as a script) imports opd once and forks each `opd train` attempt
(`launch.cli.main` in its own process group), so an attempt costs its run, not an interpreter
start.  The run is in run.mode=reference: its process group is the whole `opd train`.
Kill points, in order: (1) inside the write of step_000004.tmp/optimizer/optimizer.pt, half of
it written; (2) in step_000006.tmp after state.json, before the rename; (3) after the rename of
step_000008, before `latest` names it; (4-6) at a random point (seeded); then one attempt runs
to the end (also when a resume starts too near the end for a random kill).  A random kill waits
for a random step of its own attempt (metrics.parquet rewritten with that step), then a random
0-0.3 s more: inside a step, a metrics write or a checkpoint write.
"""
import json
import os
import random
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

STEPS = 16
HOOKS = [("write", 4), ("commit", 6), ("latest", 8)]
RANDOM_KILLS = 3
SEED = 14


def overrides(digits_dir, run_dir) -> list[str]:
    return ["--config", "tiny", f"data.data_dir={digits_dir}", f"distill.steps={STEPS}",
            "run.mode=reference", "eval.track=false", "run.checkpoint_every=2",
            "rollout.decoding=greedy", "rollout.gamma=2", f"run.dir={run_dir}"]


def test_sigkill_at_random_points_then_resume_loses_and_repeats_nothing(digits_dir, opd_cache,
                                                                        tmp_path):
    from opd.run import checkpoints as ckpt
    from opd.config.schema import load_config
    from opd.run.metrics_log import read_metrics
    from opd.run.reference import run_reference

    argv = overrides(digits_dir, tmp_path / "run")
    whole = run_reference(load_config("tiny", argv[2:-1]), tmp_path / "whole", progress=False)
    env = {**os.environ, "OPD_CACHE": str(opd_cache), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, __file__, str(digits_dir), str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    attempts = json.loads(proc.stdout.strip().splitlines()[-1])
    run = tmp_path / "run"

    # every attempt but the last was SIGKILLed; each resumed attempt took over the dead lock
    statuses = [a["status"] for a in attempts]
    assert statuses[-1] == 0, attempts[-1]["stderr"]
    # (a random kill that came after its attempt had finished ends the plan early)
    assert statuses[:-1] == [-signal.SIGKILL] * (len(attempts) - 1), attempts
    assert len(attempts) > len(HOOKS) + 1
    for before, after in zip(attempts, attempts[1:]):
        assert before["holder"] == before["pid"]        # the lock it left names it
        assert f"opd train: taking over {run}/lock from pid {before['pid']}, which is no " \
               f"longer running\n" in after["stderr"]
    # the hooks killed where they were meant to: the resumes started after steps 2, 4 and 8
    assert [a["start"] for a in attempts[1:len(HOOKS) + 1]] == [2, 4, 8]

    rows = read_metrics(run)
    assert [(r["step"], r["batch_id"]) for r in rows] == [(k, k) for k in range(STEPS)]
    assert [r["loss"] for r in rows] == [r["loss"] for r in whole]
    assert [p.name for p in ckpt.checkpoint_dirs(run)] == [f"step_{s:06d}" for s in range(2, STEPS + 1, 2)]
    assert all(ckpt.damage(p) is None for p in ckpt.checkpoint_dirs(run))
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.endswith(".tmp")) == []
    assert (run / "checkpoints" / "latest").read_text() == f"step_{STEPS:06d}\n"
    assert not (run / "lock").exists()


# -- the subprocess ------------------------------------------------------------------------------


def _attempt(argv: list[str], hook: tuple[str, int] | None, log: Path) -> int:
    """Fork one `opd train` in its own process group; its stderr goes to `log`.  With `hook`
    (kind, step) it SIGKILLs its own group at that point of the checkpoint write of `step`."""
    pid = os.fork()
    if pid:
        return pid
    os.setpgid(0, 0)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 1
    try:
        if hook is not None:
            _install(*hook)
        from launch.cli import main
        code = main(argv)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _install(kind: str, step: int) -> None:
    from opd.run import checkpoints as ckpt

    def die():
        os.killpg(0, signal.SIGKILL)

    name = ckpt.step_name(step)
    if kind == "write":
        save = ckpt.save_torch

        def save_torch(obj, path):
            if Path(path).name == ckpt.TORCH_OPTIMIZER_FILE and name + ckpt.TMP_SUFFIX in str(path):
                save(obj, path)
                data = Path(path).read_bytes()
                Path(path).write_bytes(data[:len(data) // 2])
                die()
            save(obj, path)
        ckpt.save_torch = save_torch
    else:
        write = ckpt._write_text

        def _write_text(path, text):
            if kind == "latest" and path.name == ckpt.LATEST_FILE and text.strip() == name:
                die()
            write(path, text)
            if kind == "commit" and path.name == ckpt.STATE_FILE and path.parent.name.startswith(name):
                die()
        ckpt._write_text = _write_text


def _resumed_from(run: Path) -> int:
    from opd.run import checkpoints as ckpt
    last = ckpt.latest_checkpoint(run, report=None)
    return 0 if last is None else ckpt.checkpoint_step(last)


def _steps_written_since(metrics: Path, mtime: int) -> int:
    """The highest step in metrics.parquet once it was rewritten after `mtime` (else -1)."""
    from opd.run.metrics_log import read_metrics
    try:
        if metrics.stat().st_mtime_ns == mtime:
            return -1
        return max(r["step"] for r in read_metrics(metrics))
    except (OSError, ValueError):
        return -1


def main(digits_dir: str, run_dir: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401  (imported once, before the forks: what each
    import launch.cli  # noqa: F401       attempt would import again)
    import launch.commands.train  # noqa: F401
    import opd.run.reference  # noqa: F401
    from opd.run.rundir import lock_holder

    run = Path(run_dir)
    rng = random.Random(SEED)
    plan = [("hook", h) for h in HOOKS] + [("random", None)] * RANDOM_KILLS + [("end", None)]
    attempts = []
    for i, (what, hook) in enumerate(plan):
        argv = ["train", *overrides(digits_dir, run)] if i == 0 else ["train", "--resume", str(run)]
        start = _resumed_from(run) if i else 0
        if what == "random" and start > STEPS - 4:
            what = "end"               # too close to the end for a kill that surely lands in it
        metrics = run / "metrics.parquet"
        mtime = metrics.stat().st_mtime_ns if metrics.is_file() else 0
        target, extra = rng.randint(start, max(start, STEPS - 4)), rng.uniform(0.0, 0.3)
        # (at least 3 steps and 2 checkpoints are left after the kill point: it lands in the run)
        log = run.parent / f"attempt{i}.err"
        pid = _attempt(argv, hook, log)
        status = None
        if what == "random":
            while status is None and _steps_written_since(metrics, mtime) < target:
                done, st = os.waitpid(pid, os.WNOHANG)
                status = st if done else None
                time.sleep(0.02)
            if status is None:
                time.sleep(extra)
                os.killpg(pid, signal.SIGKILL)
        if status is None:
            _, status = os.waitpid(pid, 0)
        attempts.append({"what": what, "hook": hook, "pid": pid, "start": start,
                         "target": target if what == "random" else None,
                         "status": os.waitstatus_to_exitcode(status),
                         "holder": (lock_holder(run) or (None,))[0], "stderr": log.read_text()})
        if what == "end" or attempts[-1]["status"] == 0:
            break
    print(json.dumps(attempts))


if __name__ == "__main__":
    main(*sys.argv[1:3])
