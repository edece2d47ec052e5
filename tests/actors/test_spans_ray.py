"""Scoring by span on Ray (rollout.span: actors/driver/spans.py, TeacherWorker.score_span and
score_spanned): with 2 rollout workers, 2 teacher workers and 2 learner ranks the pipeline
trains every step with the reference loop's losses, buffered rollouts reused too; every span of
every call is scored once while no worker fails, and the teacher seconds that ran while a call
still decoded are in its rows; a teacher worker killed while it holds a call's spans, or a
rollout worker killed after handing some out, loses nothing and uses no batch twice."""
import math

import pytest

from actors.driver.pipeline import run_distributed
from actors.driver.tasks import PieceScoring, RolloutCall, SpanScoring
from opd.run.reference import run_reference
from tests.actors.test_pipeline import (LOSS_TOL, assert_each_batch_once, cfg_for, consumed,
                                        losses)

SPANS = ("rollout.span=5", "rollout.decoding=sample", "rollout.cfg_scale=2.0",
         "teacher.guided=true", "rollout.num_workers=2", "teacher.num_workers=2",
         "learner.world_size=2", "learner.zero_stage=2", "learner.num_cpus=0.25",
         "data.batch_size=8", "distill.pieces=4", "cluster.max_restarts=8")
REUSE = ("distill.reuse=3", "distill.reuse_buffer=2", "distill.reuse_fresh=0.3",
         "distill.steps=7")
"""7 steps, 4 of them on buffered rollouts (seed 0: steps 1, 2 on step 0's; 4, 5 on step 3's)."""


def spans_of(row, span=5, parts=2) -> int:
    """The spans a fresh step's calls hand out: ceil(N / span) per call."""
    return parts * math.ceil((64 - row["prefix_len"]) / span)


def submitted(kinds: list):
    def hook(pipeline, kind, step, worker, **_):
        kinds.append((kind, step))
    return hook


def assert_equal_to(rows, reference):
    assert losses(rows) == pytest.approx(losses(reference), rel=0, abs=LOSS_TOL)
    for key in ("teacher_kl/default", "batch_id", "prefix_len", "reused", "policy_lag"):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in reference], abs=LOSS_TOL)


def test_ray_scores_spans_and_reuses_as_the_reference_loop(ray_session, tiny_overrides,
                                                           tmp_path):
    cfg = cfg_for(tiny_overrides, *SPANS, *REUSE)
    reference = run_reference(cfg, tmp_path / "ref", progress=False)
    kinds = []
    rows = run_distributed(cfg, tmp_path / "ray", progress=False,
                           hooks={"after_submit": submitted(kinds)})
    assert_equal_to(rows, reference)
    assert sum(r["reused"] for r in rows) == 4
    fresh = [r for r in rows if not r["reused"]]
    assert all(r["source"] == "student" for r in rows)
    for r in fresh:                        # every span of both calls, once (no failures here)
        assert kinds.count((SpanScoring.kind, r["step"])) == spans_of(r)
        assert kinds.count((PieceScoring.kind, r["step"])) == 4
        assert 0 < r["teacher_in_rollout_s"] <= r["teacher_busy_s"]
    assert all(r["teacher_in_rollout_s"] == 0 for r in rows if r["reused"])
    assert consumed(tmp_path / "ray")["consumed"] == {"0": 1, "1": 1, "2": 1}


@pytest.fixture(scope="module")
def spanned(tiny_overrides, tmp_path_factory):
    cfg = cfg_for(tiny_overrides, *SPANS, "distill.steps=4")
    return cfg, run_reference(cfg, tmp_path_factory.mktemp("ref"), progress=False)


def kill_on_span(role: str, target: int, span: int = 2):
    """An after_submit hook that kills, once, the teacher worker just given span `span` of a
    call of step `target` to score (role "teacher"), or the rollout worker still making that
    call (role "rollout").  Returns (state, hook)."""
    import ray
    state = {}

    def hook(pipeline, kind, step, worker, part=None, **_):
        if state or kind != SpanScoring.kind or step != target:
            return
        tasks = pipeline.dispatch.tasks.values()
        if max(t.span for t in tasks if isinstance(t, SpanScoring) and t.step == step
               and t.part == part and t.worker == worker) != span:
            return
        if role == "rollout":
            calls = [t.worker for t in tasks
                     if isinstance(t, RolloutCall) and t.step == step and t.part == part]
            if not calls:                     # the call has ended already
                return
            worker = calls[0]
        state["worker"] = worker
        ray.kill((pipeline.rollout if role == "rollout" else pipeline.teacher)[worker],
                 no_restart=False)

    return state, hook


@pytest.mark.slow   # 2 Ray runs with a kill and a restart (~100 s); the equality test above is fast
@pytest.mark.parametrize("role", ["teacher", "rollout"])
def test_a_worker_killed_mid_call_loses_nothing(ray_session, spanned, tmp_path, role):
    """The teacher worker dies with a call's span in flight (the span's scoring fails: its
    pieces are scored from the spans' refs elsewhere); or the rollout worker dies once its
    call has handed out a span: the call fails, or (it had ended) its payloads are lost, or
    the restarted worker holds no weights; each makes the call again."""
    cfg, reference = spanned
    state, hook = kill_on_span(role, 1, span=2 if role == "teacher" else 0)
    rows = run_distributed(cfg, tmp_path, progress=False, hooks={"after_submit": hook})
    assert state, "the hook never fired"
    assert_equal_to(rows, reference)
    assert_each_batch_once(rows, tmp_path, steps=4)
    record = consumed(tmp_path)
    failures = record["worker_failures"]
    if role == "teacher":
        assert failures == {"rollout": 0, "teacher/default": 1}
    else:
        assert failures["teacher/default"] == 0 and failures["rollout"] <= 1
        assert record["reissued"] >= 1
