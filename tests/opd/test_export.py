"""`export_student`: a checkpoint's student as a LlamaGen file, checked against the run's model."""
import pytest
import torch

from opd import checkpoints as ckpt
from opd.config import load_config, save_config
from opd.export import export_student
from opd.models import CheckpointError, create_model, load_llamagen_checkpoint
from opd.pretrain import model_overrides


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
