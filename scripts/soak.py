"""Chaos soak of the Ray pipeline: kill workers at random, then count what was lost.

    scripts/soak.sh                                  # 300 steps at staleness 0 and 2 (minutes)
    scripts/soak.sh --steps 8 --kills 1 --checkpoint-every 2 --node-scenarios ""  # as tests/test_soak.py

For each staleness (`distill.staleness`, 0 = strict on-policy) one run of the tiny config
(2 rollout, 2 teacher workers, sampled HB-SJD, gamma=auto) on a local Ray that this script
starts, with faults injected through the pipeline's hooks (as tests/actors/test_pipeline.py):

- rollout and teacher workers, `--kills` times each, at random steps: half with `ray.kill`
  while the worker has a task in flight (the after_submit hook), half with SIGKILL of the
  actor's process after a random delay (a timer thread; the pid from Ray's actor table, and
  only a process descended from this script);
- the learner once (SIGKILL of its process), which stops the run with LearnerFailure; the run
  is then resumed from its last checkpoint (`run_distributed(resume=True)`).

Then the node faults of scripts/node_loss.py (`--node-scenarios`, both by default): a rollout
node and a teacher node lost mid-run on a multi-node Ray, and a `ray job submit` driver killed
and resubmitted with `--resume`; one row each: batches lost and duplicated, seconds to recover.

Reported per run (JSON with --json, a table on stdout): batches lost and duplicated (from the
run's consumed.json and metrics), the largest absolute and relative loss difference to the
single-process reference loop and how many losses are bit-identical (staleness 0; invariant 5;
the tiny run's loss falls from ~0.06 to ~1e-6, so the absolute figure alone says little),
or the largest policy lag
(staleness > 0), Ray object-store bytes in use after the first step, the middle step, the last
step and once the run's actors are gone, kills carried out, and actors still alive after the
run.  After both runs Ray is shut down and processes descended from this script are counted.
Exit code 0 when every check holds, 1 otherwise.

Over 400 lines: the chaos schedule, the two runs it drives and every check of what they left
are one scenario, kept in one script so its report reads in order.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from scripts import node_loss  # noqa: E402  (needs ROOT on the path)
from actors.bench.memory import store_usage  # noqa: E402

LOSS_TOL = 1e-5          # as tests/actors/test_pipeline.py
MEMORY_BOUND_MB = 32     # object-store growth allowed over the first step's use
TASK_OF = {"rollout": "rollout", "teacher": "score"}


def run_overrides(args, data_dir: str, staleness: int) -> list[str]:
    return [f"data.data_dir={data_dir}", f"distill.steps={args.steps}",
            f"distill.staleness={staleness}", "rollout.decoding=sample",
            f"rollout.num_workers={args.rollout_workers}",
            f"teacher.num_workers={args.teacher_workers}", "eval.track=false",
            f"run.checkpoint_every={args.checkpoint_every}",
            f"cluster.max_restarts={4 * args.kills + 4}", "rollout.num_cpus=0.25",
            "teacher.num_cpus=0.25", "learner.num_cpus=0.5", *TEACHERS[args.teachers](args)]


TEACHERS = {
    "one": lambda args: [],
    # two teachers routing by class, each its own pool of --teacher-workers workers
    "routed": lambda args: [
        f"teachers=[{{name: low, classes: [0,1,2,3,4], num_workers: {args.teacher_workers}, "
        f"num_cpus: 0.25}}, {{name: high, classes: [5,6,7,8,9], "
        f"num_workers: {args.teacher_workers}, num_cpus: 0.25}}]"],
}


def actor_pid(actor) -> int | None:
    """The live process of `actor` (Ray's actor table), None while it is dead or restarting."""
    import ray._private.state as state
    info = state.actors(actor._actor_id.hex())
    return int(info["Pid"]) if info and info.get("State") == "ALIVE" and info.get("Pid") else None


def is_ours(pid: int) -> bool:
    """True if `pid` is a process descended from this script (never kill anyone else's)."""
    import psutil
    try:
        return any(p.pid == os.getpid() for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False


def alive_actors() -> list[str]:
    import ray._private.state as state
    return sorted(a["ActorClassName"] for a in state.actors().values() if a["State"] == "ALIVE")


class Watchdog:
    """Interrupts the run (as Ctrl-C would: the pipeline checkpoints and writes consumed.json)
    when no step has finished for `stall_s` seconds, and records what the driver was waiting
    on: its plans' policy versions against the published one, and how fast it re-issues."""

    def __init__(self, stall_s: float):
        self.stall_s, self.last, self.pipeline = stall_s, time.monotonic(), None
        self.stalled: dict | None = None
        self.done = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def beat(self, pipeline) -> None:
        self.last, self.pipeline = time.monotonic(), pipeline

    def _watch(self) -> None:
        import _thread
        while not self.done.wait(1.0):
            if time.monotonic() - self.last > self.stall_s and self.pipeline is not None:
                pl = self.pipeline
                before = pl.reissued
                time.sleep(5.0)
                self.stalled = {
                    "after_step": pl.state.version - 1,
                    "published_version": pl.publisher.published.version,
                    "unfinished_plans": {s: {"version": p.version, "gen": p.gen,
                                             "phase": p.phase.name, "source": p.source,
                                             "parts_ended": len(p.ended), "parts": p.parts,
                                             "pieces_delivered": sum(
                                                 q.delivered is not None for q in p.pieces),
                                             "pieces": p.layout.pieces}
                                         for s, p in sorted(pl.planner.plans.items())},
                    "tasks_in_flight": sorted(f"{t.kind}:{getattr(t, 'step', '-')}:{t.worker}"
                                              for t in list(pl.dispatch.tasks.values())),
                    "reissues_per_s": (pl.reissued - before) / 5.0}
                _thread.interrupt_main()
                return

    def close(self) -> None:
        self.done.set()
        self.pipeline = None             # let the finished pipeline (and its refs) go


class Chaos:
    """The kill plan of one run and the pipeline hooks that carry it out."""

    def __init__(self, rng: random.Random, steps: int, kills: int, roles: list[str], log):
        self.steps, self.log = steps, log
        self.plan = [{"role": role, "step": rng.randrange(1, steps - 1),
                      "how": "ray.kill" if i % 2 == 0 else "sigkill",
                      "delay": round(rng.uniform(0.0, 0.5), 3), "fired": False}
                     for role in ("rollout", "teacher") for i in range(kills) if role in roles]
        self.plan.append({"role": "learner", "step": rng.randrange(steps // 4, steps // 2),
                          "how": "sigkill", "delay": 0.0, "fired": False})
        self.memory: dict[str, dict] = {}
        self.segments: dict[int, dict] = {}     # per pipeline (a resume starts a new one)
        self.pids: set[int] = set()
        self.timers: list[threading.Timer] = []
        self.started = time.perf_counter()

    def hooks(self) -> dict:
        return {"after_submit": self.after_submit, "after_step": self.after_step}

    def _actors(self, pipeline, role: str) -> list:
        return {"rollout": pipeline.rollout, "teacher": pipeline.teacher,
                "learner": pipeline.learners}[role]

    def after_submit(self, pipeline, kind: str, step: int, worker: int, pool: str, **_) -> None:
        import ray
        for ev in self.plan:
            if (not ev["fired"] and ev["how"] == "ray.kill" and ev["step"] == step
                    and TASK_OF.get(ev["role"]) == kind):
                ray.kill(pipeline.pools[pool].actors[worker], no_restart=False)
                ev.update(fired=True, worker=worker, pool=pool)
                return

    def after_step(self, pipeline, step: int, row: dict) -> None:
        self.segments[id(pipeline)] = {"reissued": pipeline.reissued, **{
            r: p.failures for r, p in pipeline.pools.items()}}
        for name, at in (("start", 0), ("middle", self.steps // 2), ("end", self.steps - 1)):
            if step == at:
                self.memory[name] = {"step": step, **store_usage()}
        for role in ("rollout", "teacher", "learner"):
            for a in self._actors(pipeline, role):
                pid = actor_pid(a)
                if pid:
                    self.pids.add(pid)
        for ev in self.plan:
            if not ev["fired"] and ev["how"] == "sigkill" and ev["step"] == step:
                actors = self._actors(pipeline, ev["role"])
                worker = random.Random(step).randrange(len(actors))
                pid = actor_pid(actors[worker])
                ev.update(fired=pid is not None, worker=worker, pid=pid)
                if pid is not None:
                    t = threading.Timer(ev["delay"], self._sigkill, (pid,))
                    t.start()
                    self.timers.append(t)
        if step % 25 == 0 or step == self.steps - 1:
            self.log(f"  step {step}: loss {row['loss']:.6f}, "
                     f"{time.perf_counter() - self.started:.0f} s")

    @staticmethod
    def _sigkill(pid: int) -> None:
        if is_ours(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def faults(self) -> dict:
        """Worker failures the driver saw and jobs it issued again, summed over the segments
        before and after the learner's resume (consumed.json has the last segment's only)."""
        out: dict[str, int] = {}
        for seg in self.segments.values():
            for k, v in seg.items():
                out[k] = out.get(k, 0) + v
        return out

    def fired(self) -> dict:
        out = {}
        for ev in self.plan:
            key = f"{ev['role']} {ev['how']}"
            done, planned = out.get(key, (0, 0))
            out[key] = (done + ev["fired"], planned + 1)
        return {k: f"{d}/{p}" for k, (d, p) in sorted(out.items())}


def soak_run(args, data_dir: str, staleness: int, reference: list[dict] | None, log) -> dict:
    """One chaos run; returns its report."""
    from actors.driver.pipeline import run_distributed
    from actors.driver.records import LearnerFailure
    from opd.config.schema import load_config
    from opd.run.metrics_log import read_metrics

    cfg = load_config("tiny", run_overrides(args, data_dir, staleness))
    run_dir = Path(tempfile.mkdtemp(prefix=f"soak-s{staleness}-", dir=args.work))
    roles = (args.stale_kill_roles or args.kill_roles) if staleness else args.kill_roles
    chaos = Chaos(random.Random(args.seed * 1000 + staleness), args.steps, args.kills,
                  roles.split(","), log)
    start = time.perf_counter()
    resumed_from, resume = [], False
    watchdog = Watchdog(args.stall_s)
    hooks = chaos.hooks()
    after_step = hooks["after_step"]
    hooks["after_step"] = lambda pipeline, **kw: (watchdog.beat(pipeline),
                                                  after_step(pipeline, **kw))
    while True:
        try:
            run_distributed(cfg, run_dir, progress=False, resume=resume, hooks=hooks)
            break
        except KeyboardInterrupt:
            if watchdog.stalled is None:                  # a real Ctrl-C
                raise
            log(f"  stalled: no step for {args.stall_s:g} s: {watchdog.stalled}")
            break
        except LearnerFailure as e:
            if resumed_from:                              # the learner is killed once
                raise
            log(f"  learner killed: {str(e).splitlines()[0]}; resuming")
            resumed_from.append(e.checkpoint)
            resume = True
    watchdog.close()
    seconds = time.perf_counter() - start
    for t in chaos.timers:
        t.join()
    deadline = time.time() + 30                           # ray.kill is asynchronous
    while alive_actors() and time.time() < deadline:
        time.sleep(0.5)
    gc.collect()                                          # the finished pipelines' refs
    chaos.memory["after"] = store_usage()
    rows = read_metrics(run_dir)
    record = json.loads((run_dir / "consumed.json").read_text())
    counts = {int(b): n for b, n in record["consumed"].items()}
    expected = set(range(args.steps))
    row_ids = [r["batch_id"] for r in rows]
    lost = sorted((expected - set(counts)) | (expected - set(row_ids)))
    duplicated = sorted({b for b, n in counts.items() if n > 1} |
                        {b for b in row_ids if row_ids.count(b) > 1})
    report = {"staleness": staleness, "steps": args.steps, "seconds": round(seconds, 1),
              "run_dir": str(run_dir), "rows": len(rows),
              "steps_in_metrics": [r["step"] for r in rows] == list(range(args.steps)),
              "batches_lost": len(lost), "lost_ids": lost[:20],
              "batches_duplicated": len(duplicated), "duplicated_ids": duplicated[:20],
              "faults_seen": chaos.faults(), "stalled": watchdog.stalled,
              "learner_resumed_from": resumed_from, "kills": chaos.fired(),
              "roles_killed": sorted({e["role"] for e in chaos.plan if e["fired"]}),
              "roles_planned": sorted({e["role"] for e in chaos.plan}),
              "memory": chaos.memory, "leaked_actors": alive_actors(),
              "max_policy_lag": max((r["policy_lag"] for r in rows), default=None),
              "pids": sorted(chaos.pids)}
    if reference is not None:
        pairs = list(zip([r["loss"] for r in rows], [r["loss"] for r in reference]))
        complete = len(pairs) == args.steps
        report["max_loss_diff"] = max(abs(a - b) for a, b in pairs) if complete else None
        report["max_rel_loss_diff"] = (max(abs(a - b) / abs(b) for a, b in pairs if b)
                                       if complete else None)
        report["losses_identical"] = sum(a == b for a, b in pairs)
        report["loss_range"] = [min(r["loss"] for r in reference),
                                max(r["loss"] for r in reference)]
    return report


def checks(report: dict) -> dict[str, bool]:
    mem = report["memory"]
    bound = mem["start"]["bytes"] + MEMORY_BOUND_MB * 2**20
    out = {"finished (no stall)": report["stalled"] is None,
           "no batch lost": report["batches_lost"] == 0,
           "no batch duplicated": report["batches_duplicated"] == 0,
           "metrics for every step": report["steps_in_metrics"],
           "every planned role killed": report["roles_killed"] == report["roles_planned"],
           "learner killed and resumed": len(report["learner_resumed_from"]) == 1,
           "object store bounded": all(k in mem and mem[k]["bytes"] <= bound
                                       for k in ("middle", "end")),
           "no leaked actors": not report["leaked_actors"],
           "lag within staleness": (report["max_policy_lag"] is not None
                                    and report["max_policy_lag"] <= report["staleness"])}
    if "max_loss_diff" in report:
        out["losses equal the reference"] = (report["max_loss_diff"] is not None
                                             and report["max_loss_diff"] <= LOSS_TOL)
    return out


def leftover_processes(pids: set[int], timeout: float = 30.0) -> list[str]:
    """Processes descended from this script, or recorded actor pids, still alive after Ray's
    shutdown (waits up to `timeout` for them to exit)."""
    import psutil
    deadline = time.time() + timeout
    while True:
        left = {p.pid: p for p in psutil.Process().children(recursive=True)}
        for pid in pids:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE and is_ours(pid):
                    left[pid] = p
            except psutil.Error:
                pass
        if not left or time.time() > deadline:
            break
        time.sleep(0.5)
    out = []
    for pid, p in left.items():
        try:
            out.append(f"{pid} {p.name()}")
        except psutil.Error:
            pass
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--staleness", default="0,2", help="comma-separated distill.staleness values")
    p.add_argument("--kills", type=int, default=8, help="kills per worker role per run")
    p.add_argument("--kill-roles", default="rollout,teacher",
                   help="worker roles killed at random (the learner is killed once anyway)")
    p.add_argument("--stale-kill-roles", help="the same for runs with staleness > 0 (default: "
                   "--kill-roles)")
    p.add_argument("--rollout-workers", type=int, default=2)
    p.add_argument("--teacher-workers", type=int, default=2, help="per teacher")
    p.add_argument("--teachers", default="one", choices=sorted(TEACHERS),
                   help="one teacher, or two routing by class (a pool each)")
    p.add_argument("--checkpoint-every", type=int, default=25)
    p.add_argument("--num-cpus", type=int, default=4, help="CPUs of the local Ray")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stall-s", type=float, default=180.0,
                   help="stop a run that finished no step for this long (reported as stalled)")
    p.add_argument("--node-scenarios", default="nodes,driver",
                   help="scripts/node_loss.py scenarios after the soak runs ('' for none)")
    node_loss.add_arguments(p, prefix="node-")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--keep", action="store_true", help="keep the run directories (else removed)")
    args = p.parse_args(argv)
    if args.steps < 8:
        p.error("--steps must be >= 8")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.pop("RAY_ADDRESS", None)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    import ray
    import torch
    torch.set_num_threads(1)
    from opd.config.schema import load_config
    from opd.data import prepare_digits
    from opd.run.reference import run_reference

    began = time.perf_counter()
    args.work = tempfile.mkdtemp(prefix="opd-soak-")
    data_dir = str(Path(args.work) / "digits")
    prepare_digits(data_dir)
    ray_tmp = tempfile.mkdtemp(prefix="opdsk", dir="/tmp")     # short: Ray's socket paths
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, _temp_dir=ray_tmp)
    reports, pids = [], set()
    try:
        for s in [int(x) for x in args.staleness.split(",")]:
            reference = None
            if s == 0:
                log(f"reference loop, {args.steps} steps")
                ref_cfg = load_config("tiny", run_overrides(args, data_dir, 0))
                reference = run_reference(ref_cfg, Path(args.work) / "reference", progress=False)
            log(f"ray run, staleness {s}, {args.steps} steps")
            report = soak_run(args, data_dir, s, reference, log)
            report["checks"] = checks(report)
            pids |= set(report.pop("pids"))
            reports.append(report)
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    node_rows = []
    if args.node_scenarios:
        node_tmp = tempfile.mkdtemp(prefix="opdn", dir="/tmp")
        os.environ["RAY_TMPDIR"] = node_tmp
        node_args = argparse.Namespace(
            scenarios=args.node_scenarios.split(","), work=args.work, steps=args.node_steps,
            lose_rollout=args.node_lose_rollout, lose_teacher=args.node_lose_teacher,
            checkpoint_every=args.node_checkpoint_every)
        try:
            node_rows = node_loss.run_scenarios(node_args, data_dir, log)
        finally:
            os.environ.pop("RAY_TMPDIR", None)
            shutil.rmtree(node_tmp, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)
    leftover = leftover_processes(pids)
    summary = {"runs": reports, "node_faults": node_rows, "leaked_processes": leftover,
               "seconds": round(time.perf_counter() - began, 1), "args": vars(args)}
    ok = not leftover and all(all(r["checks"].values()) for r in [*reports, *node_rows])
    summary["ok"] = ok
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    print_report(summary)
    return 0 if ok else 1


def print_report(summary: dict) -> None:
    mib = 2**20
    for r in summary["runs"]:
        m = r["memory"]
        print(f"staleness {r['staleness']}: {r['steps']} steps in {r['seconds']} s; "
              f"lost {r['batches_lost']}, duplicated {r['batches_duplicated']}, "
              f"driver saw {r['faults_seen']}, "
              f"learner resumed from {r['learner_resumed_from']}")
        if "max_loss_diff" in r:
            print(f"  max |loss - reference| = {r['max_loss_diff']} (relative "
                  f"{r['max_rel_loss_diff']}); bit-identical {r['losses_identical']}/{r['steps']}; "
                  f"reference losses in {r['loss_range']}")
        print(f"  max policy lag {r['max_policy_lag']}; kills {r['kills']}")
        print("  object store: " + ", ".join(
            f"{k} {m[k]['bytes'] / mib:.2f} MiB ({m[k]['objects']} objects)"
            for k in ("start", "middle", "end", "after") if k in m))
        print(f"  leaked actors: {r['leaked_actors'] or 0}")
        if r["stalled"]:
            print(f"  STALLED: {r['stalled']}")
        for name, good in r["checks"].items():
            print(f"  [{'ok' if good else 'FAIL'}] {name}")
    if summary["node_faults"]:
        print("node faults (scripts/node_loss.py):")
        node_loss.print_rows(summary["node_faults"])
    print(f"leaked processes after Ray's shutdown: {summary['leaked_processes'] or 0}")
    print(f"soak {'passed' if summary['ok'] else 'FAILED'} in {summary['seconds']} s")


if __name__ == "__main__":
    sys.exit(main())
