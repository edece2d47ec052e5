"""Evaluation of students: class-balanced deterministic sampling, `opd eval` end to end, compare."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from PIL import Image

from launch import cli
from opd.config.schema import load_config
from opd.eval.run import (evaluate_checkpoint, format_table, load_student, resolve_checkpoint,
                          save_heldout_reference)
from opd.eval.sample import balanced_labels, sample_images, sample_tokens, sampling_config
from opd.run.reference import run_reference
from opd.run.rundir import prepare_run_dir

N = 20   # samples per evaluation: 2 per digit class


def make_run(path, tiny_overrides, *extra):
    """A 3-step tiny reference run (checkpoints at steps 2 and 3) with config.yaml."""
    cfg = load_config("tiny", [*tiny_overrides, "rollout.gamma=2", "rollout.decoding=greedy",
                               "run.mode=reference", f"run.dir={path}", *extra])
    run_reference(cfg, prepare_run_dir(cfg), progress=False)
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_overrides):
    return make_run(tmp_path_factory.mktemp("runs") / "hb", tiny_overrides)


@pytest.fixture(scope="module")
def student(run_dir):
    ck = resolve_checkpoint(run_dir)
    return ck.cfg, load_student(ck)


@pytest.fixture(autouse=True)
def no_downloads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a download was attempted")
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", refuse)
    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)


def test_balanced_labels_cycle_classes_in_a_fixed_order():
    labels = balanced_labels(23, 10)
    assert labels.tolist() == [*range(10), *range(10), 0, 1, 2]
    assert torch.bincount(labels).tolist() == [3, 3, 3] + [2] * 7
    with pytest.raises(ValueError):
        balanced_labels(0, 10)


def test_sampling_is_balanced_seeded_and_batch_independent(student):
    cfg, model = student
    a = sample_tokens(model, cfg, N, engine="hbsjd", decoding="sample", seed=5)
    assert a.tokens.shape == (N, 64) and a.tokens.dtype == torch.int64
    assert torch.bincount(a.labels).tolist() == [2] * 10
    assert a.stats["engine"] == "hbsjd" and a.stats["decoding"] == "sample"
    assert a.stats["generated_tokens"] == N * 64 and a.stats["mean_committed"] >= 1.0
    assert a.stats["options"]["gamma"] == 2                   # the run's rollout.gamma
    again = sample_tokens(model, cfg, N, engine="hbsjd", decoding="sample", seed=5, batch_size=7)
    assert torch.equal(a.tokens, again.tokens)           # keyed by (seed, image), not by batch
    other = sample_tokens(model, cfg, N, engine="hbsjd", decoding="sample", seed=6)
    assert not torch.equal(a.tokens, other.tokens)
    assert len({tuple(t) for t in a.tokens.tolist()}) == N   # sampling: all images differ


def test_uncalibrated_auto_gamma_falls_back(student, tmp_path, monkeypatch):
    cfg, _ = student
    monkeypatch.setenv("OPD_CACHE", str(tmp_path))           # no $OPD_CACHE/calibration.json
    auto = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, gamma="auto"))
    assert sampling_config(auto).rollout.gamma is None        # execution never changes tokens
    assert sampling_config(cfg).rollout.gamma == 2


def test_greedy_hbsjd_equals_greedy_cached_ar_and_repeats_per_class(student):
    cfg, model = student
    ar = sample_tokens(model, cfg, N, engine="cached_ar", decoding="greedy")
    hb = sample_tokens(model, cfg, N, engine="hbsjd", decoding="greedy")
    assert torch.equal(ar.tokens, hb.tokens)
    assert ar.stats["rounds"] == 64 and hb.stats["rounds"] < 64
    # from scratch, greedy decoding gives one image per class: images i and i + 10 coincide
    assert torch.equal(ar.tokens[:10], ar.tokens[10:])


def test_decoded_images_are_the_digits_pixels(student):
    cfg, model = student
    s = sample_images(model, cfg, N)
    assert s.images.shape == (N, 3, 16, 16) and s.images.dtype == torch.uint8
    assert torch.equal(s.images[:, 0], s.images[:, 2])
    from opd.data import digits_images_to_tokens                # 8x8 tokens -> 16x16 levels
    levels = torch.from_numpy(digits_images_to_tokens(s.tokens.view(N, 8, 8).numpy(), 16))
    assert torch.equal(s.images[:, 0].long(), (levels.view(N, 16, 16) * 510 + 16) // 32)


def test_opd_eval_end_to_end(run_dir, capsys):
    assert cli.main(["eval", "--ckpt", str(run_dir), "--num-samples", str(N),
                     "--engine", "cached_ar"]) == 0
    out = run_dir / "eval-cached_ar"
    report = json.loads((out / "eval.json").read_text())
    assert report["step"] == 3 and report["checkpoint"] == str(run_dir / "checkpoints" / "step_000003" / "student.pt")
    assert report["engine"] == "cached_ar" and report["decoding"] == "sample"
    assert report["num_samples"] == N and report["class_counts"] == [2] * 10
    assert report["reference_images"] == 200                  # the digits held-out split
    m = report["metrics"]
    for key in ("fid", "isc", "precision", "recall"):
        assert math.isfinite(m[key]), key
    assert m["fid"] > 0 and 1.0 <= m["isc"] <= 10.0 and 0 <= m["precision"] <= 1 and 0 <= m["recall"] <= 1
    assert m["class_acc"] * N == pytest.approx(round(m["class_acc"] * N))  # a fraction of 20 images
    assert report["rollout"]["rounds"] == 64 and report["rollout"]["mean_committed"] == 1.0
    assert report["training"] == {"engine": "hbsjd", "decoding": "greedy", "objective": "gkd",
                                  "steps": 3, "mode": "reference"}
    with Image.open(out / "samples.png") as img:
        assert img.format == "PNG" and img.mode == "RGB"
        assert img.size == (10 * 66 + 2, 2 * 66 + 2)          # 10 classes × 2, 64 px + padding
    assert "FID" in capsys.readouterr().out


def test_checkpoint_dir_and_weights_file(run_dir, student, tmp_path, tiny_overrides):
    ck = resolve_checkpoint(run_dir / "checkpoints" / "step_000002")
    assert (ck.kind, ck.step, ck.run_dir) == ("checkpoint", 2, run_dir)
    assert ck.cfg.run.mode == "reference"                     # the run's config.yaml
    cfg, model = student
    blob = torch.load(ck.run_dir / "checkpoints" / "step_000003" / "student.pt", weights_only=True)
    c2i = tmp_path / "c2i_test.pt"
    torch.save({"model": blob["model"]}, c2i)
    fk = resolve_checkpoint(c2i, config="tiny", overrides=tiny_overrides)
    assert (fk.kind, fk.step, fk.run_dir) == ("file", None, None)
    a = sample_tokens(model, cfg, N, engine="cached_ar")
    b = sample_tokens(load_student(fk), fk.cfg, N, engine="cached_ar")
    assert torch.equal(a.tokens, b.tokens)


def test_saved_reference_gives_the_heldout_numbers(run_dir, tmp_path):
    ck = resolve_checkpoint(run_dir, overrides=["eval.engine=cached_ar"])
    held = evaluate_checkpoint(ck, out_dir=tmp_path / "held", num_samples=N)
    ref = save_heldout_reference(ck.cfg, tmp_path / "ref.pt")
    ck2 = resolve_checkpoint(run_dir, overrides=["eval.engine=cached_ar", f"eval.reference={ref}"])
    saved = evaluate_checkpoint(ck2, out_dir=tmp_path / "saved", num_samples=N)
    assert saved["reference_images"] is None
    for key in ("fid", "precision", "recall", "isc"):
        assert saved["metrics"][key] == pytest.approx(held["metrics"][key], rel=1e-4, abs=1e-6)


def test_class_accuracy_of_the_heldout_images_is_high(student):
    from opd.eval.run import class_accuracy, heldout_images
    from opd.eval.sample import ImageDecoder
    from opd.data.splits import open_dataset
    cfg, _ = student
    images = heldout_images(cfg, ImageDecoder(cfg))
    labels = torch.from_numpy(open_dataset(cfg, "heldout").labels).long()
    assert class_accuracy(images, labels) >= 0.95
    assert class_accuracy(images, (labels + 1) % 10) <= 0.05


def test_missing_inception_weights_is_a_clear_error(run_dir, capsys):
    missing = "/nonexistent/pt_inception.pth"
    code = cli.main(["eval", "--ckpt", str(run_dir), "eval.extractor=inception-v3-compat",
                     f"eval.inception_weights={missing}", "--out", str(run_dir / "never")])
    err = capsys.readouterr().err
    assert code == 2 and missing in err and "eval.inception_weights" in err
    assert not (run_dir / "never").exists()                   # raised before any sampling
    assert cli.main(["eval", "--ckpt", str(run_dir), "eval.extractor=inception-v3-compat"]) == 2
    assert "eval.inception_weights is not set" in capsys.readouterr().err


def test_missing_vq_checkpoint_is_a_clear_error(run_dir, tmp_path, capsys):
    weights = tmp_path / "inception.pth"
    weights.write_bytes(b"")
    code = cli.main(["eval", "--ckpt", str(run_dir), "eval.extractor=inception-v3-compat",
                     f"eval.inception_weights={weights}", "model.vq_ckpt=/nonexistent/vq.pt"])
    err = capsys.readouterr().err
    assert code == 2 and "/nonexistent/vq.pt" in err and "model.vq_ckpt" in err


def test_compare_table(run_dir, tmp_path_factory, tiny_overrides, capsys):
    ar_dir = make_run(tmp_path_factory.mktemp("runs") / "ar", tiny_overrides,
                      "rollout.engine=cached_ar")
    out = tmp_path_factory.mktemp("cmp") / "table"
    argv = ["eval", "--compare", str(run_dir), str(ar_dir), "--engine", "cached_ar",
            "--num-samples", str(N), "--kl-rows", "20", "--out", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [r["run"] for r in rows] == ["hb", "ar"]
    assert [r["train_rollout"] for r in rows] == ["hbsjd / greedy", "cached_ar / greedy"]
    assert all(r["steps"] == 3 and r["eval_engine"] == "cached_ar" for r in rows)
    for r in rows:
        assert all(math.isfinite(r[k]) for k in ("fid", "isc", "precision", "recall"))
        assert r["kl_teacher_student"] > 0 and r["train_rollout_s"] > 0
    table = out.with_suffix(".md").read_text()
    assert table == format_table(rows) and table in printed
    header = table.splitlines()[0]
    for col in ("run", "training rollout", "steps", "FID", "IS", "precision", "recall", "class acc",
                "KL(T‖S)"):
        assert col in header
    assert table.splitlines()[2].startswith("| hb | hbsjd / greedy | 3 | ")
    # a second compare reuses the eval.json files it wrote
    eval_json = run_dir / "eval-cached_ar" / "eval.json"
    before = eval_json.stat().st_mtime_ns
    assert cli.main(argv) == 0
    assert eval_json.stat().st_mtime_ns == before
    assert json.loads(out.with_suffix(".json").read_text()) == rows
