"""The Ray pipeline against the single-process reference loop.

Invariant 5: same per-step losses as `run_reference` (strict on-policy, greedy HB-SJD; also
sampled, whose random numbers are keyed by image) for any number of rollout and teacher
workers; DeepSpeed fp32 + torch AdamW agree to LOSS_TOL.
Invariant 7: killing a rollout or a teacher worker mid-run loses nothing and uses nothing twice.
Observability: the opd metrics on the node's Ray metrics port and in metrics.parquet.

Over 400 lines: its tests share one Ray session and the reference runs they compare against
(module fixtures); split, those references would run twice.
"""
import json
import os
import re
import shutil
import signal
import time
import urllib.request

import pytest

from actors.driver.pipeline import run_distributed
from actors.driver.records import CONSUMED_FILE, LearnerFailure, RunRecords
from opd.run import checkpoints as ckpt
from opd.config.schema import load_config
from opd.run.metrics_log import read_metrics
from opd.distill.onpolicy import STRICT_BOUND
from opd.run.interrupt import GracefulInterrupt
from opd.run.loop import RunInterrupted
from opd.run.reference import run_reference

STEPS = 5
LOSS_TOL = 1e-5
"""Absolute loss tolerance (losses are ~0.04–0.06).  The same loss code runs in both; what
differs is DeepSpeed's gradient all-reduce/clip and, with sub-batches, the batch size of the
teacher forward (float32 round-off, ~1e-7 here)."""


def cfg_for(tiny_overrides, *extra):
    return load_config("tiny", [*tiny_overrides, f"distill.steps={STEPS}", "rollout.gamma=2",
                                "rollout.decoding=greedy",
                                "run.checkpoint_every=0", "rollout.num_cpus=0.25",
                                "teacher.num_cpus=0.25", "learner.num_cpus=0.5", *extra])


def losses(rows):
    return [r["loss"] for r in rows]


def consumed(run_dir):
    return json.loads((run_dir / CONSUMED_FILE).read_text())


def stopped_after(cfg, run_dir, steps: int) -> list[dict]:
    """The rows of a run stopped by Ctrl-C (the path of `opd train`) once `steps` steps are
    trained; on its way out the run checkpoints step `steps`."""
    rows = []

    def ctrl_c(pipeline, step, row):
        rows.append(row)
        if step == steps - 1:
            os.kill(os.getpid(), signal.SIGINT)          # deferred to the end of the step

    with GracefulInterrupt(notice=False) as interrupt, pytest.raises(RunInterrupted):
        run_distributed(cfg, run_dir, progress=False, hooks={"after_step": ctrl_c},
                        interrupt=interrupt)
    return rows


def assert_on_policy(rows):
    """Every step's student tokens, recomputed by the learner(s), within STRICT_BOUND."""
    for r in rows:
        assert r["onpolicy_tokens"] == r["generated_tokens"] == 4 * (64 - r["prefix_len"])
        assert r["onpolicy_logprob_delta_max"] < STRICT_BOUND


def assert_each_batch_once(rows, run_dir, steps=STEPS):
    record = consumed(run_dir)
    assert record["consumed"] == {str(b): 1 for b in range(steps)}
    assert sorted(r["batch_id"] for r in rows) == list(range(steps))


@pytest.fixture(scope="module")
def references(tiny_overrides, tmp_path_factory):
    """references(*overrides) -> the reference rows of cfg_for(*overrides), run once each."""
    cache = {}

    def get(*extra):
        if extra not in cache:
            cache[extra] = run_reference(cfg_for(tiny_overrides, *extra),
                                         tmp_path_factory.mktemp("ref"), progress=False)
        return cache[extra]
    return get


@pytest.fixture(scope="module")
def reference(references):
    return references()


def scrape_metrics() -> str:
    import ray
    node = next(n for n in ray.nodes() if n["Alive"])
    for host in (node["NodeManagerAddress"], "127.0.0.1"):
        try:
            url = f"http://{host}:{node['MetricsExportPort']}/metrics"
            return urllib.request.urlopen(url, timeout=10).read().decode()
        except OSError:
            continue
    raise AssertionError("the node's metrics port did not answer")


EXPECTED = {  # metric -> a (role, worker) it must carry
    "ray_opd_rollout_tokens_per_s": ("rollout", "1"),
    "ray_opd_rollout_mean_committed": ("rollout", "0"),
    "ray_opd_rollout_commit_length_count": ("rollout", "0"),
    "ray_opd_rollout_image_rounds_count": ("rollout", "1"),
    "ray_opd_rollout_window_count": ("rollout", "0"),
    "ray_opd_rollout_longest_single_run": ("rollout", "0"),
    "ray_opd_teacher_tokens_per_s": ("teacher", "default/1"),
    "ray_opd_learner_step_seconds_count": ("learner", "0"),
    "ray_opd_queue_depth": ("driver", "0"),
    "ray_opd_weight_sync_seconds_count": ("driver", "0"),
    "ray_opd_idle_ratio": ("rollout", "all"),
}


def found_metrics(text: str) -> dict:
    out = {}
    for name, (role, worker) in EXPECTED.items():
        for line in text.splitlines():
            if line.startswith(name + "{") and f'role="{role}"' in line and f'worker="{worker}"' in line:
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def two_by_two(ray_session, tiny_overrides, tmp_path_factory):
    """2 rollout + 2 teacher workers; the Ray metrics endpoint is read during the last step."""
    run_dir = tmp_path_factory.mktemp("r2t2")
    seen = {}

    def scrape(pipeline, step, row):
        if step == STEPS - 1:
            deadline = time.time() + 60       # Ray exports metrics every ~10 s
            while time.time() < deadline:
                seen.update(found_metrics(scrape_metrics()))
                if len(seen) == len(EXPECTED):
                    break
                time.sleep(1)

    rows = run_distributed(cfg_for(tiny_overrides, "rollout.num_workers=2", "teacher.num_workers=2"),
                           run_dir, progress=False, hooks={"after_step": scrape})
    return rows, run_dir, seen


def test_two_rollout_two_teacher_workers_equal_the_reference(two_by_two, reference):
    rows, run_dir, _ = two_by_two
    assert losses(rows) == pytest.approx(losses(reference), rel=0, abs=LOSS_TOL)
    assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in reference],
                                                           rel=1e-4)
    assert [r["rounds"] for r in rows] == [r["rounds"] for r in reference]  # same tokens
    assert [(r["step"], r["batch_id"], r["policy_version"], r["policy_lag"]) for r in rows] == \
        [(k, k, k, 0) for k in range(STEPS)]
    assert_each_batch_once(rows, run_dir)
    assert consumed(run_dir)["lags"] == {"0": STEPS * 4}         # strict: every sample lag 0
    assert_on_policy(rows)


def test_metrics_reach_ray_and_the_run_directory(two_by_two):
    rows, run_dir, seen = two_by_two
    assert set(seen) == set(EXPECTED), f"missing on the metrics port: {set(EXPECTED) - set(seen)}"
    assert seen["ray_opd_rollout_tokens_per_s"] > 0 and seen["ray_opd_learner_step_seconds_count"] >= 1
    assert seen["ray_opd_queue_depth"] >= 0 and 0 <= seen["ray_opd_idle_ratio"] <= 1
    table = read_metrics(run_dir)
    assert table == rows
    for key in ("rollout_s", "teacher_s", "learner_s", "weight_sync_s", "weight_bytes",
                "rollout_tokens_per_s", "teacher_tokens_per_s", "samples_per_s", "queue_depth",
                "policy_lag", "rollout_idle", "teacher_idle", "learner_idle", "mean_committed"):
        assert all(r[key] is not None and r[key] >= 0 for r in table), key
    assert all(r["weight_bytes"] > 0 and r["rollout_tokens_per_s"] > 0 for r in table)
    for r in table:     # every generated token of a step sits in its commit histogram
        assert sum((k + 1) * n for k, n in enumerate(r["commit_hist"])) == r["generated_tokens"]


@pytest.mark.parametrize("workers,decoding", [
    pytest.param((1, 1), "greedy", marks=pytest.mark.slow),   # the kill tests run 1 x 1 too
    ((1, 2), "greedy"), ((2, 1), "sample")])
def test_other_worker_counts_equal_the_reference(workers, decoding, ray_session, tiny_overrides,
                                                 references, tmp_path):
    """Sampled: the Ray rollout workers also run their images through one slot each
    (continuous batching), the reference through none: the same tokens, the same losses."""
    r, t = workers
    extra = () if decoding == "greedy" else ("rollout.decoding=sample",)
    slots = () if decoding == "greedy" else ("rollout.slots=1",)
    rows = run_distributed(cfg_for(tiny_overrides, f"rollout.num_workers={r}",
                                   f"teacher.num_workers={t}", *extra, *slots), tmp_path,
                           progress=False)
    assert losses(rows) == pytest.approx(losses(references(*extra)), rel=0, abs=LOSS_TOL)
    assert_each_batch_once(rows, tmp_path)


@pytest.mark.slow   # 2 ranks, ZeRO 2, equal to the reference: tests/actors/test_streaming.py
#                    (test_streamed_steps_equal_the_reference_loop, "2 ranks ZeRO 2, 4 pieces")
def test_learner_world_size_2_zero2_matches_world_size_1(ray_session, tiny_overrides, reference,
                                                         tmp_path):
    cfg = cfg_for(tiny_overrides, "learner.world_size=2", "learner.zero_stage=2",
                  "learner.num_cpus=0.25")
    rows = run_distributed(cfg, tmp_path, progress=False)
    assert losses(rows) == pytest.approx(losses(reference), rel=0, abs=LOSS_TOL)
    assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in reference],
                                                           rel=1e-4)
    assert all(r["tokens"] == 4 * (64 - r["prefix_len"]) for r in rows)   # both shards counted
    assert_on_policy(rows)                                                 # both shards checked
    assert_each_batch_once(rows, tmp_path)


def kill_once(role: str, step: int, kind: str):
    """An after_submit hook that kills the worker just given a `kind` task of `step` while
    that task is in flight, once (Ray restarts it).  Returns (state, hook)."""
    state = {}

    def hook(pipeline, kind_: str, step_: int, worker: int):
        import ray
        if not state and kind_ == kind and step_ == step:
            state["worker"] = worker
            ray.kill((pipeline.rollout if role == "rollout" else pipeline.teacher)[worker],
                     no_restart=False)

    return state, lambda pipeline, kind, step, worker, **_: hook(pipeline, kind, step, worker)


def test_killed_rollout_worker_loses_nothing(ray_session, tiny_overrides, reference, tmp_path):
    """The only rollout worker dies with a job in flight: the driver waits for Ray to restart
    it, reloads the current weights into it and issues the job again."""
    state, hook = kill_once("rollout", 2, "rollout")
    pids = {}

    def record_pids(pipeline, step, row):
        import ray
        if step in (0, STEPS - 1):
            pids[step] = ray.get(pipeline.rollout[0].info.remote())

    rows = run_distributed(cfg_for(tiny_overrides), tmp_path, progress=False,
                           hooks={"after_submit": hook, "after_step": record_pids})
    assert state, "the hook never fired"
    assert_each_batch_once(rows, tmp_path)
    record = consumed(tmp_path)
    assert record["reissued"] >= 1 and record["worker_failures"] == {"rollout": 1,
                                                                  "teacher/default": 0}
    assert losses(rows) == pytest.approx(losses(reference), rel=0, abs=LOSS_TOL)
    # a new process that holds the current weights generated the rest
    before, after = pids[0], pids[STEPS - 1]
    assert after["pid"] != before["pid"] and after["version"] == STEPS - 1


def test_killed_teacher_worker_loses_nothing(ray_session, tiny_overrides, reference, tmp_path):
    state, hook = kill_once("teacher", 1, "score")
    rows = run_distributed(cfg_for(tiny_overrides, "teacher.num_workers=2"), tmp_path,
                           progress=False, hooks={"after_submit": hook})
    assert state, "the hook never fired"
    assert_each_batch_once(rows, tmp_path)
    record = consumed(tmp_path)
    assert record["reissued"] >= 1 and record["worker_failures"] == {"rollout": 0,
                                                                  "teacher/default": 1}
    assert losses(rows) == pytest.approx(losses(reference), rel=0, abs=LOSS_TOL)


def kill_and_wait(actor) -> None:
    """Kill `actor` (Ray restarts it) and return once its replacement answers: whatever the old
    process owned in the object store is gone."""
    import ray
    pid = ray.get(actor.info.remote())["pid"]
    ray.kill(actor, no_restart=False)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if ray.get(actor.info.remote(), timeout=10)["pid"] != pid:
                return
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            time.sleep(0.2)
    raise AssertionError("the killed worker did not come back")


LOSE = ("rollout.num_workers=2", "teacher.num_workers=2", "learner.world_size=2",
        "learner.zero_stage=2", "learner.num_cpus=0.25", "data.batch_size=8", "distill.pieces=4",
        "distill.steps=9", "cluster.max_restarts=8")
"""2 rollout workers (2 parts of 2 pieces each), 2 teacher workers, 2 learner ranks, 4 pieces;
up to 8 restarts a worker, so one that happens to own every lost piece comes back each time."""


@pytest.mark.slow   # 8 kills and restarts (~2 min): test_killed_{rollout,teacher}_worker_loses_nothing
def test_a_piece_lost_at_every_index_is_made_again(ray_session, tiny_overrides, references,
                                                   tmp_path):
    """Workers own what they put in the object store.  Steps 1-4 lose piece 0-3 with the rollout
    worker that handed it out, before a teacher fetched it (its scoring finds its input lost, the
    call itself dies: the call is made again, its pieces scored from the new call); steps 5-8
    lose piece 0-3 with the teacher worker that delivered it, before the learner ranks fetched it
    (they report it lost; it is scored again).  Nothing lost, nothing used twice, the reference
    loop's losses, and every step on-policy."""
    lose = {s: ("rollout", s - 1) for s in range(1, 5)} | {s: ("teacher", s - 5) for s in range(5, 9)}
    fired = []

    def after_piece(pipeline, step, piece, worker):
        if lose.get(step) == ("rollout", piece) and (step, piece) not in fired:
            fired.append((step, piece))
            kill_and_wait(pipeline.rollout[worker])

    def after_scored(pipeline, step, piece, worker):
        if lose.get(step) == ("teacher", piece) and (step, piece) not in fired:
            fired.append((step, piece))
            kill_and_wait(pipeline.teacher[worker])

    cfg = cfg_for(tiny_overrides, *LOSE)
    rows = run_distributed(cfg, tmp_path, progress=False,
                           hooks={"after_piece": after_piece, "after_scored": after_scored})
    assert fired == [(s, p) for s, (_, p) in sorted(lose.items())]
    assert_each_batch_once(rows, tmp_path, steps=9)
    reissued = [r["reissued"] for r in rows]
    assert reissued[0] == 0 and all(b > a for a, b in zip(reissued, reissued[1:]))
    assert [r["pieces"] for r in rows] == [4] * 9
    assert losses(rows) == pytest.approx(losses(references(*LOSE)), rel=0, abs=LOSS_TOL)
    for r in rows:
        assert r["onpolicy_tokens"] == r["generated_tokens"] == 8 * (64 - r["prefix_len"])
        assert r["onpolicy_logprob_delta_max"] < STRICT_BOUND


def test_learner_failure_stops_the_run_naming_the_checkpoint(ray_session, tiny_overrides, tmp_path):
    def kill_learner(pipeline, step, row):
        import ray
        if step == 2:
            ray.kill(pipeline.learners[0])

    cfg = cfg_for(tiny_overrides, "run.checkpoint_every=2")
    with pytest.raises(LearnerFailure, match=re.escape(str(tmp_path / "checkpoints" / "step_000002"))) as e:
        run_distributed(cfg, tmp_path, progress=False, hooks={"after_step": kill_learner})
    assert e.value.checkpoint.endswith("step_000002")
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]   # what it measured is kept


def test_collective_weight_broadcast_equals_the_reference(ray_session, tiny_overrides, reference,
                                                         tmp_path):
    cfg = cfg_for(tiny_overrides, "rollout.num_workers=2", "learner.weight_sync=collective",
                  "learner.weight_bucket_mb=0.1")                # several buckets
    rows = run_distributed(cfg, tmp_path, progress=False)
    assert losses(rows) == pytest.approx(losses(reference), rel=0, abs=LOSS_TOL)
    assert all(r["weight_bytes"] == rows[0]["weight_bytes"] > 0 for r in rows)
    assert consumed(tmp_path)["weight_sync"] == "collective"     # no fallback happened


def test_bounded_staleness_runs_ahead_and_records_lags(ray_session, tiny_overrides, tmp_path):
    cfg = cfg_for(tiny_overrides, "distill.staleness=1")
    rows = run_distributed(cfg, tmp_path, progress=False)
    assert_each_batch_once(rows, tmp_path)
    lags = {int(lag): n for lag, n in consumed(tmp_path)["lags"].items()}      # {lag: samples}
    assert sum(lags.values()) == STEPS * 4 and set(lags) == {0, 1}  # ran one version ahead
    assert [r["policy_lag"] for r in rows] == [r["step"] - r["policy_version"] for r in rows]
    for r in rows:      # the on-policy check measures the lag: float round-off only without one
        if r["policy_lag"] == 0:
            assert r["onpolicy_logprob_delta_max"] < STRICT_BOUND
        else:
            assert r["onpolicy_logprob_delta_max"] > 10 * STRICT_BOUND


@pytest.mark.slow
def test_worker_dead_at_a_broadcast_falls_back_to_the_object_store(
        ray_session, tiny_overrides, reference, tmp_path):
    """A rollout worker is dead when the next version is broadcast: the send fails, the group
    is given up, the worker restarts and every worker gets later versions from the object store."""
    def kill_before_publish(pipeline, step, row):
        import ray
        if step == 1:
            ray.kill(pipeline.rollout[1], no_restart=False)
            deadline = time.time() + 30
            while time.time() < deadline:          # wait until it is really gone
                try:
                    ray.get(pipeline.rollout[1].info.remote(), timeout=5)
                    time.sleep(0.2)
                except ray.exceptions.RayError:
                    return

    cfg = cfg_for(tiny_overrides, "rollout.num_workers=2", "learner.weight_sync=collective")
    rows = run_distributed(cfg, tmp_path, progress=False, hooks={"after_step": kill_before_publish})
    assert_each_batch_once(rows, tmp_path)
    record = consumed(tmp_path)
    assert record["worker_failures"]["rollout"] >= 1 and record["weight_sync"] == "object_store"
    assert losses(rows) == pytest.approx(losses(reference), rel=0, abs=LOSS_TOL)


@pytest.mark.parametrize("objective", [
    ["distill.lam=0.5", "teacher.num_workers=2"],                # data steps, prepared ahead
    pytest.param(["distill.objective=seqkd"], marks=pytest.mark.slow),  # teacher rollouts
], ids=["gkd-mixed", "seqkd"])
def test_other_sources_equal_the_reference(objective, ray_session, tiny_overrides, tmp_path):
    ref = run_reference(cfg_for(tiny_overrides, *objective), tmp_path / "ref", progress=False)
    rows = run_distributed(cfg_for(tiny_overrides, *objective), tmp_path / "ray", progress=False)
    assert [r["source"] for r in rows] == [r["source"] for r in ref]
    assert len({r["source"] for r in ref}) == (2 if "distill.lam=0.5" in objective else 1)
    assert losses(rows) == pytest.approx(losses(ref), rel=0, abs=LOSS_TOL)
    assert_each_batch_once(rows, tmp_path / "ray")


@pytest.mark.slow
def test_resume_is_exact(ray_session, tiny_overrides, reference, tmp_path, monkeypatch):
    """Stopped by Ctrl-C after 3 steps (checkpoint at 2 in the layout of opd/run/checkpoints.py; a step-3
    checkpoint whose writing did not finish is left behind) and resumed: DeepSpeed restores
    from step_000002/optimizer and the losses are the uninterrupted run's."""
    cfg = cfg_for(tiny_overrides, "run.checkpoint_every=2")
    first = stopped_after(cfg, tmp_path, 3)                   # checkpoints at 2 and 3
    assert losses(first) == pytest.approx(losses(reference)[:3], rel=0, abs=LOSS_TOL)
    shutil.rmtree(tmp_path / "checkpoints" / "step_000003")   # as if killed while writing it
    two = tmp_path / "checkpoints" / "step_000002"
    assert sorted(p.relative_to(two).as_posix() for p in two.rglob("*")) == [
        "optimizer", "optimizer/mp_rank_00_model_states.pt", "state.json", "student.pt"]
    state = ckpt.read_state(two)
    assert (state["mode"], state["step"], state["consumed"]) == ("ray", 2, [0, 1])
    broken = ckpt.begin(tmp_path, 3)                  # killed while writing step 3
    (broken / ckpt.STUDENT_FILE).write_bytes(b"")
    loaded = []
    load = RunRecords.load_checkpoint
    monkeypatch.setattr(RunRecords, "load_checkpoint",
                        lambda self, path: loaded.append(path) or load(self, path))
    resumed = run_distributed(cfg, tmp_path, progress=False, resume=True)
    assert loaded == [two]
    assert [r["step"] for r in resumed] == list(range(STEPS))
    assert losses(resumed) == pytest.approx(losses(reference), rel=0, abs=LOSS_TOL)
    assert consumed(tmp_path)["consumed"] == {str(b): 1 for b in range(STEPS)}


@pytest.mark.gpu
def test_nccl_weight_broadcast_on_gpus_equals_the_reference(ray_session, tiny_overrides, reference,
                                                            tmp_path):
    """The NCCL path: learner rank 0 and two rollout workers, each on its own GPU, fp32."""
    import torch
    if torch.cuda.device_count() < 3:
        pytest.skip("needs 3 GPUs (NCCL cannot put two ranks on one device)")
    cfg = cfg_for(tiny_overrides, "rollout.num_workers=2", "learner.weight_sync=collective",
                  "learner.num_gpus=1", "rollout.num_gpus=1", "learner.precision=fp32")
    rows = run_distributed(cfg, tmp_path, progress=False)
    assert losses(rows) == pytest.approx(losses(reference), rel=0, abs=1e-4)


@pytest.mark.gpu
def test_pipeline_on_one_gpu_equals_the_reference(ray_session, tiny_overrides, reference, tmp_path):
    """Every role on one GPU (fractions), learner in fp32: the CPU reference's losses."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    cfg = cfg_for(tiny_overrides, "rollout.num_workers=2", "teacher.num_workers=2",
                  "rollout.num_gpus=0.2", "teacher.num_gpus=0.2", "learner.num_gpus=0.2",
                  "learner.precision=fp32")
    rows = run_distributed(cfg, tmp_path, progress=False)
    assert losses(rows) == pytest.approx(losses(reference), rel=0, abs=1e-4)
    assert_each_batch_once(rows, tmp_path)
