"""`export_student`: a checkpoint's student as a LlamaGen file, checked against the run's model."""
import pytest
import torch

from opd.run import checkpoints as ckpt
from opd.config.schema import load_config
from opd.config.files import save_config
from opd.run.export import export_student
from opd.models import CheckpointError, create_model, load_llamagen_checkpoint
from opd.models.factory import model_overrides


def make_run(run_dir, *overrides, steps=(2, 3)):
    """A run directory (config.yaml of tiny) with reference-layout checkpoints of its student;
    returns {step: the student's state dict}."""
    cfg = load_config("tiny", list(overrides))
    save_config(cfg, run_dir / "config.yaml")
    states = {}
    for step in steps:
        torch.manual_seed(step)
        model = create_model(cfg.model.student, **model_overrides(cfg))
        tmp = ckpt.begin(run_dir, step)
        ckpt.write_student(tmp, model.state_dict())
        ckpt.commit(tmp, ckpt.checkpoint_state(cfg, step, {}, "reference"))
        states[step] = model.state_dict()
    return states


def test_export_writes_the_newest_student(tmp_path):
    states = make_run(tmp_path / "run")
    out = tmp_path / "out" / "student.pt"
    info = export_student(tmp_path / "run", out)
    n = sum(v.numel() for v in states[3].values())
    assert info == {"path": str(out), "checkpoint": str(tmp_path / "run" / "checkpoints" / "step_000003"),
                    "step": 3, "params": n, "preset": "GPT-digits-S"}
    blob = torch.load(out, weights_only=True)
    assert list(blob) == ["model"] and blob["model"].keys() == states[3].keys()
    assert all(torch.equal(blob["model"][k], v) for k, v in states[3].items())
    model = load_llamagen_checkpoint(out, "GPT-digits-S", **model_overrides(load_config("tiny")))
    assert torch.equal(model.tok_embeddings.weight, states[3]["tok_embeddings.weight"])


def test_overwrite_needs_force_and_steps_can_be_chosen(tmp_path):
    states = make_run(tmp_path / "run")
    out = tmp_path / "student.pt"
    out.write_bytes(b"keep")
    with pytest.raises(FileExistsError, match="already exists; pass --force"):
        export_student(tmp_path / "run", out)
    assert out.read_bytes() == b"keep"
    info = export_student(tmp_path / "run" / "checkpoints" / "step_000002", out, force=True)
    assert info["step"] == 2
    exported = torch.load(out, weights_only=True)["model"]
    assert torch.equal(exported["tok_embeddings.weight"], states[2]["tok_embeddings.weight"])
    assert not torch.equal(exported["tok_embeddings.weight"], states[3]["tok_embeddings.weight"])
    with pytest.raises(IsADirectoryError, match="is a directory"):
        export_student(tmp_path / "run", tmp_path, force=True)


def test_a_student_that_does_not_fit_the_run_is_refused(tmp_path):
    make_run(tmp_path / "run")
    save_config(load_config("tiny", ["model.student=GPT-digits-T"]), tmp_path / "run" / "config.yaml")
    with pytest.raises(CheckpointError, match="student.pt does not fit the model"):
        export_student(tmp_path / "run", tmp_path / "s.pt")
    assert not (tmp_path / "s.pt").exists()


def test_safetensors_export_round_trips_bit_exactly(tmp_path, tiny_overrides, capsys, monkeypatch):
    """`opd export --format safetensors`: the state dict tensor for tensor, the model's shape in
    the JSON beside it, read without pickle by LlamaGen-shaped models, model.student_ckpt /
    model.teacher_ckpt and `opd eval --ckpt` (the same figures as the .pt export)."""
    import json
    import pickle

    from safetensors.torch import load_file

    from launch import cli
    from opd.models.factory import load_role_model
    states = make_run(tmp_path / "run")
    st, pt = tmp_path / "student.safetensors", tmp_path / "student.pt"
    assert cli.main(["export", "--ckpt", str(tmp_path / "run"), "--out", str(st),
                     "--format", "safetensors"]) == 0
    assert cli.main(["export", "--ckpt", str(tmp_path / "run"), "--out", str(pt)]) == 0
    assert f"model shape in {tmp_path / 'student.json'}" in capsys.readouterr().out
    n = sum(v.numel() for v in states[3].values())
    assert json.loads((tmp_path / "student.json").read_text()) == {
        "model": "GPT-digits-S", "vocab_size": 17, "num_classes": 10, "grid_size": 8, "step": 3,
        "params": n, "weights": "student.safetensors", "layout": "LlamaGen GPT state dict"}
    blob = load_file(st)
    assert blob.keys() == states[3].keys()
    assert all(torch.equal(blob[k], v) and blob[k].dtype == v.dtype for k, v in states[3].items())
    assert cli.main(["export", "--ckpt", str(tmp_path / "run"), "--out", str(st),
                     "--format", "safetensors"]) == 2                    # never overwritten

    def no_pickle(*a, **k):
        raise AssertionError("safetensors must load without pickle")
    monkeypatch.setattr(torch, "load", no_pickle)
    monkeypatch.setattr(pickle, "load", no_pickle)
    model = load_llamagen_checkpoint(st, "GPT-digits-S", **model_overrides(load_config("tiny")))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in states[3].items())
    for role in ("student", "teacher"):
        cfg = load_config("tiny", [*tiny_overrides, f"model.{role}_ckpt={st}",
                                   f"model.{role}=GPT-digits-S"])
        loaded = load_role_model(cfg, role, progress=False)
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in states[3].items())
    monkeypatch.undo()

    reports = []
    for path in (pt, st):
        out = tmp_path / f"eval-{path.suffix[1:]}"
        assert cli.main(["eval", "--ckpt", str(path), "--config", "tiny", *tiny_overrides,
                         "--num-samples", "8", "--engine", "cached_ar", "--out", str(out)]) == 0
        reports.append(json.loads((out / "eval.json").read_text()))
    assert reports[0]["metrics"] == reports[1]["metrics"]
    assert reports[1]["checkpoint"] == str(st)
