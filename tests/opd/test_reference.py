"""The single-process reference loop: deterministic, engine-independent, exactly resumable."""
import pytest
import torch

from opd.run import checkpoints as ckpt, reference
from opd.config.schema import load_config
from opd.run.metrics_log import read_metrics
from opd.distill.onpolicy import STRICT_BOUND
from opd.run.reference import run_reference
from opd.run.rundir import RunDirError, prepare_run_dir


def cfg_for(tiny_overrides, *extra):
    return load_config("tiny", [*tiny_overrides, "distill.steps=4", "rollout.gamma=2",
                                "rollout.decoding=greedy", *extra])


def losses(rows):
    return [r["loss"] for r in rows]


@pytest.fixture(scope="module")
def cached_ar_run(tiny_overrides, tmp_path_factory):
    cfg = cfg_for(tiny_overrides, "rollout.engine=cached_ar")
    return run_reference(cfg, tmp_path_factory.mktemp("ar"), progress=False)


def test_hbsjd_greedy_gives_the_cached_ar_loss_curve(cached_ar_run, tiny_overrides, tmp_path):
    rows = run_reference(cfg_for(tiny_overrides, "rollout.engine=hbsjd"), tmp_path,
                         progress=False)
    assert losses(rows) == losses(cached_ar_run)          # bit-identical: same tokens
    assert [r["batch_id"] for r in rows] == [0, 1, 2, 3]
    assert all(r["source"] == "student" for r in rows)
    # HB-SJD needed no more sequential forwards than Cached AR's one per token
    assert all(a["rounds"] >= b["rounds"] for a, b in zip(cached_ar_run, rows))
    assert read_metrics(tmp_path) == rows


def test_streamed_pieces_leave_hbsjd_bit_identical_to_cached_ar(tiny_overrides, tmp_path):
    """With a step cut into 4 pieces, HB-SJD hands them out as their rows complete, in another
    order than Cached AR (all at its last round); the pieces hold the same rows and are summed in
    piece order, so the losses and gradient norms are bit-identical (the behaviour log-probs,
    from other forwards, agree within the on-policy bound)."""
    runs = {e: run_reference(cfg_for(tiny_overrides, f"rollout.engine={e}", "distill.pieces=4",
                                     "distill.steps=2"), tmp_path / e, progress=False)
            for e in ("cached_ar", "hbsjd")}
    assert [r["pieces"] for r in runs["hbsjd"]] == [4, 4]
    for key in ("loss", "grad_norm", "tokens"):
        assert [r[key] for r in runs["hbsjd"]] == [r[key] for r in runs["cached_ar"]], key
    assert all(r["onpolicy_logprob_delta_max"] < STRICT_BOUND for r in runs["hbsjd"])


def test_slots_leave_the_losses_alone_and_rows_count_every_token(cached_ar_run, tiny_overrides,
                                                                  tmp_path):
    """Continuous batching (rollout.slots) changes which row an image runs in, never its
    tokens; metrics.parquet's commit histogram accounts for every generated token."""
    rows = run_reference(cfg_for(tiny_overrides, "rollout.engine=hbsjd", "rollout.slots=3"),
                         tmp_path, progress=False)
    assert losses(rows) == losses(cached_ar_run)
    for r in rows:
        hist = r["commit_hist"]
        assert sum((k + 1) * n for k, n in enumerate(hist)) == r["generated_tokens"]
        assert sum(r["window_hist"]) == r["rounds"] - 1     # a window per round but the prefill
        assert max(w for w, n in enumerate(r["window_hist"], 1) if n) == 4   # rollout.window
        assert r["image_rounds_max"] >= r["image_rounds_mean"] >= 1
        assert r["longest_single_run"] <= r["image_rounds_max"]


def test_loss_changes_the_student(cached_ar_run):
    assert len(set(losses(cached_ar_run))) == 4 and all(x > 0 for x in losses(cached_ar_run))


def test_resume_is_exact(cached_ar_run, tiny_overrides, tmp_path, monkeypatch):
    """Stopped after 3 steps (checkpoint at step 2; a step-3 checkpoint whose writing did not
    finish is left behind) and resumed: the losses of the uninterrupted run."""
    cfg = cfg_for(tiny_overrides, "rollout.engine=cached_ar", "run.checkpoint_every=2")
    first = run_reference(cfg, tmp_path, progress=False, stop_after=3)   # checkpoint at step 2
    assert losses(first) == losses(cached_ar_run)[:3]
    two = tmp_path / "checkpoints" / "step_000002"
    assert sorted(p.relative_to(two).as_posix() for p in two.rglob("*")) == [
        "optimizer", "optimizer/optimizer.pt", "state.json", "student.pt"]
    assert ckpt.read_state(two)["mode"] == "reference"
    broken = ckpt.begin(tmp_path, 3)                  # killed while writing step 3
    torch.save({"model": {}}, broken / ckpt.STUDENT_FILE)
    loaded = []
    load = reference.load_checkpoint
    monkeypatch.setattr(reference, "load_checkpoint", lambda path, *a: loaded.append(path) or load(path, *a))
    resumed = run_reference(cfg, tmp_path, progress=False, resume=True)
    assert loaded == [two]
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert losses(resumed) == pytest.approx(losses(cached_ar_run), rel=0, abs=1e-7)


@pytest.mark.parametrize("objective", ["kd", "varkd", "seqkd"])
def test_other_objectives_run(objective, tiny_overrides, tmp_path):
    rows = run_reference(cfg_for(tiny_overrides, f"distill.objective={objective}",
                                 "distill.steps=2", "rollout.engine=cached_ar"),
                         tmp_path, progress=False)
    source = {"kd": "data", "varkd": "student", "seqkd": "teacher"}[objective]
    assert [r["source"] for r in rows] == [source, source]
    assert all(r["loss"] > 0 for r in rows)


def test_gkd_mixes_sources_by_lambda(tiny_overrides, tmp_path):
    rows = run_reference(cfg_for(tiny_overrides, "distill.lam=0.5", "distill.steps=6",
                                 "rollout.engine=cached_ar"), tmp_path, progress=False)
    sources = [r["source"] for r in rows]
    assert set(sources) == {"student", "data"}
    assert all((r["rounds"] == 0) == (r["source"] == "data") for r in rows)
    for r in rows:     # the on-policy check covers student tokens only: empty, not 0, on data
        student = r["source"] == "student"
        assert r["onpolicy_tokens"] == (r["generated_tokens"] if student else 0)
        assert (r["onpolicy_logprob_delta_max"] is None) == (not student)
        assert not student or r["onpolicy_logprob_delta_max"] < STRICT_BOUND


def test_topk_transport(tiny_overrides, tmp_path):
    rows = run_reference(cfg_for(tiny_overrides, "teacher.transport=topk", "teacher.topk=4",
                                 "distill.steps=1", "rollout.engine=cached_ar"),
                         tmp_path, progress=False)
    assert rows[0]["loss"] > 0


def test_used_run_directory_is_refused(tiny_overrides, tmp_path):
    cfg = cfg_for(tiny_overrides, f"run.dir={tmp_path}")
    (tmp_path / "something").write_text("x")
    with pytest.raises(RunDirError, match="is not empty"):
        prepare_run_dir(cfg)
    with pytest.raises(RunDirError, match="holds no config.yaml"):
        prepare_run_dir(cfg, resume=True)


def test_quality_report_against_a_direct_computation(tiny_overrides):
    import torch
    import torch.nn.functional as F

    from opd.models.factory import load_role_model
    from opd.data.splits import open_dataset
    from opd.eval.quality import quality_report
    cfg = cfg_for(tiny_overrides, "rollout.engine=cached_ar")
    student, teacher = load_role_model(cfg, "student"), load_role_model(cfg, "teacher")
    heldout = open_dataset(cfg, "heldout")
    q = quality_report(student, teacher, heldout, cfg, num_rows=6, batch_size=4)
    labels = torch.from_numpy(heldout.labels[:6])
    tokens = torch.from_numpy(heldout.tokens[:6])
    with torch.no_grad():
        s = F.log_softmax(student(labels, tokens[:, :-1]).double(), -1)
        t = F.log_softmax(teacher(labels, tokens[:, :-1]).double(), -1)
    kl = torch.nn.functional.kl_div(s, t, log_target=True, reduction="sum") / tokens.numel()
    nll = F.nll_loss(s.flatten(0, 1), tokens.flatten())
    assert q["kl_data"] == pytest.approx(kl.item(), rel=1e-9)
    assert q["student_nll"] == pytest.approx(nll.item(), rel=1e-9)
    assert q["kl_samples"] > 0 and q["teacher_nll_samples"] > 0
    self_q = quality_report(student, student, heldout, cfg, num_rows=6, batch_size=4)
    assert self_q["kl_data"] == pytest.approx(0, abs=1e-12)


def test_prefix_ratio_spread_is_keyed_by_batch_id(tiny_overrides, tmp_path):
    from opd.distill.steps import batch_prefix_len
    cfg = cfg_for(tiny_overrides, "rollout.engine=cached_ar", "distill.steps=12",
                  "data.prefix_ratios=0,0.25,0.5")
    lens = [batch_prefix_len(cfg, b, 64) for b in range(200)]
    assert set(lens) == {0, 16, 32} and lens == [batch_prefix_len(cfg, b, 64) for b in range(200)]
    assert min(lens.count(p) for p in (0, 16, 32)) > 40           # each ratio ~1/3 of batches
    other_seed = load_config("tiny", [*tiny_overrides, "data.prefix_ratios=0,0.25,0.5", "run.seed=1"])
    assert lens != [batch_prefix_len(other_seed, b, 64) for b in range(200)]
    fixed = load_config("tiny", [*tiny_overrides, "data.prefix_ratio=0.25", "data.prefix_ratios=[]"])
    assert {batch_prefix_len(fixed, b, 64) for b in range(50)} == {16}
    rows = run_reference(cfg, tmp_path, progress=False)
    assert [r["prefix_len"] for r in rows] == [batch_prefix_len(cfg, r["batch_id"], 64) for r in rows]
    assert all(r["generated_tokens"] == 4 * (64 - r["prefix_len"]) for r in rows)
