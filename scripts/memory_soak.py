"""A long run whose memory must stay flat: one tiny ray-mode run of `--steps` (2,000) steps
with a KD warm-up phase and an on-policy GKD phase (sampled HB-SJD rollouts), evaluations
(`--eval-every`) and checkpoints (`--checkpoint-every`), on a local Ray this script starts.

At the sample steps (100, 1,000 and the last by default) it records the resident memory (RSS)
of every role's process (each rollout and teacher worker, learner rank, the queue, the
evaluation worker: Ray names their processes `ray::<Class>`), the driver's RSS (this
process) and the bytes of the objects some process still references (`object_store`; the
store's own bytes in use are reported as `store_in_use`, not judged: they also count released
objects Ray has yet to delete, actors/bench/memory.py).  Growth of any of them by more than
`--bound` (5 %) between the last two samples fails the run (exit 1), naming the role.

    scripts/soak.sh --memory                         # the 2,000-step row (tens of minutes)
    python scripts/memory_soak.py --steps 300 --samples 50,150,300   # tests/test_memory_soak.py
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROLE_OF = {"RolloutWorker": "rollout", "TeacherWorker": "teacher", "StudentLearner": "learner",
           "TrajectoryQueue": "queue", "EvaluationWorker": "eval"}
MB = 2 ** 20


def role_processes() -> dict[str, int]:
    """{"rollout/0": pid, ...}: the run's actor processes, by the class in their Ray title,
    numbered in pid order per role."""
    import psutil
    found: dict[str, list[int]] = {}
    for p in psutil.Process().children(recursive=True):   # this run's Ray only, no other one
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if not title.startswith("ray::"):
            continue
        cls = title[5:].split(".")[0].split()[0]
        if cls in ROLE_OF:
            found.setdefault(ROLE_OF[cls], []).append(p.pid)
    return {f"{role}/{i}": pid for role, pids in found.items() for i, pid in enumerate(sorted(pids))}


def rss_mb(pid: int) -> float | None:
    import psutil
    try:
        return psutil.Process(pid).memory_info().rss / MB
    except psutil.Error:
        return None


STORE_READS = 5
"""The referenced objects are read after each of the last 5 steps before a sample and judged
by the least of them: a step's pieces and weights in flight come and go between reads, while
a leak raises every read."""


def sample(pids: dict[str, int]) -> dict[str, float]:
    """RSS (MiB) of each role process and the driver."""
    out = {name: rss_mb(pid) for name, pid in pids.items()}
    out["driver"] = rss_mb(os.getpid())
    return {k: v for k, v in out.items() if v is not None}


def overrides(args, data_dir: str) -> list[str]:
    return [f"data.data_dir={data_dir}", f"distill.steps={args.steps}",
            "distill.phases=[{name: warm, steps: %d, objective: kd}, "
            "{name: onpolicy, objective: gkd, lam: 0.75}]" % args.warm_steps,
            "rollout.decoding=sample", "eval.track=true", f"eval.every={args.eval_every}",
            f"run.checkpoint_every={args.checkpoint_every}", "rollout.num_cpus=0.25",
            "teacher.num_cpus=0.25", "learner.num_cpus=0.25", "eval.num_cpus=0.25"]


def run(args) -> dict:
    """The soak in a temporary directory (data and run), removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="opd-memory-soak-") as work:
        return soak(args, Path(work))


def soak(args, work: Path) -> dict:
    import ray
    from actors.bench.memory import growth, referenced_bytes, store_usage
    from actors.driver.pipeline import run_distributed
    from opd.config.schema import load_config
    from opd.data import prepare_digits
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    prepare_digits(work / "digits")
    cfg = load_config("tiny", overrides(args, str(work / "digits")))
    at = sorted(int(s) for s in args.samples.split(","))
    samples: dict[int, dict] = {}

    store: dict[int, list[float]] = {}
    in_use: dict[int, float] = {}

    def after_step(pipeline, step, row):
        for s in at:              # the referenced floor over the last STORE_READS steps to s
            if s - STORE_READS < step + 1 <= s:
                store.setdefault(s, []).append(referenced_bytes() / MB)
        if step + 1 in at:
            samples[step + 1] = {**sample(role_processes()),
                                 "object_store": min(store[step + 1])}
            in_use[step + 1] = round(store_usage()["bytes"] / MB, 2)

    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)
    start = time.time()
    try:
        rows = run_distributed(cfg, work / "run", progress=False, hooks={"after_step": after_step})
    finally:
        ray.shutdown()
    prev, last = (int(x) for x in args.compare.split(",")) if args.compare else at[-2:]
    bad = growth(samples[prev], samples[last], args.bound)
    return {"steps": len(rows), "seconds": round(time.time() - start, 1), "samples": samples,
            "store_in_use": in_use, "bound": args.bound, "compared": [prev, last], "grew": bad,
            "ok": not bad,
            "checkpoints": len(list((work / "run" / "checkpoints").glob("step_*"))),
            "evaluations": sum(1 for _ in (work / "run" / "samples").glob("student_step_*.png"))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warm-steps", type=int, default=100)
    p.add_argument("--samples", default="100,1000,2000", help="steps after which to sample")
    p.add_argument("--compare", default="", help="the two sample steps judged (default: the last two)")
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--checkpoint-every", type=int, default=250)
    p.add_argument("--bound", type=float, default=0.05)
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    report = run(args)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    for line in report["grew"]:
        print(f"memory grew past {100 * args.bound:.0f} %: {line}", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
