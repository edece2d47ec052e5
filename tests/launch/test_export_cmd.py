"""Every checkpoint `opd train` writes in run.mode=ray can be evaluated and exported
(invariant 9): `opd train --config tiny` on Ray, then `opd eval` on the run and on a step
directory, and `opd export`, whose file loads strictly into the run's student model."""
from __future__ import annotations

import json

import pytest
import torch

from launch import cli
from launch.commands import COMMANDS
from opd.run import checkpoints as ckpt
from opd.config.schema import load_config
from opd.models import create_model
from opd.models.factory import model_overrides

ACTORS = ["rollout.num_cpus=0.25", "teacher.num_cpus=0.25", "learner.num_cpus=0.5"]


@pytest.fixture(scope="module")
def ray_run(ray_session, tiny_overrides, tmp_path_factory):
    """A 3-step tiny run on Ray (checkpoints after steps 2 and 3), started like a user does."""
    run_dir = tmp_path_factory.mktemp("ray") / "run"
    assert cli.main(["train", "--config", "tiny", *tiny_overrides, *ACTORS,
                     f"run.dir={run_dir}"]) == 0
    return run_dir


def eval_report(argv: list[str], out) -> dict:
    assert cli.main(["eval", *argv, "--num-samples", "8", "--engine", "cached_ar",
                     "--out", str(out)]) == 0
    return json.loads((out / "eval.json").read_text())


def test_export_is_a_command():
    assert "export" in COMMANDS


def test_ray_run_is_evaluated_and_exported(ray_run, tmp_path, capsys):
    steps = ckpt.checkpoint_dirs(ray_run)
    assert [p.name for p in steps] == ["step_000002", "step_000003"]
    assert (ray_run / "checkpoints" / "latest").read_text() == "step_000003\n"
    state = ckpt.read_state(steps[1])
    assert (state["mode"], state["step"], state["policy_version"], state["consumed"]) == (
        "ray", 3, 3, [0, 1, 2])
    run_report = eval_report(["--ckpt", str(ray_run)], tmp_path / "run")
    assert (run_report["step"], run_report["checkpoint_kind"]) == (3, "run")
    assert run_report["checkpoint"] == str(steps[1] / "student.pt")
    assert run_report["training"]["mode"] == "ray" and run_report["class_counts"] == [1] * 8 + [0] * 2
    step_report = eval_report(["--ckpt", str(steps[0])], tmp_path / "step")
    assert (step_report["step"], step_report["checkpoint_kind"]) == (2, "checkpoint")

    out = tmp_path / "student.pt"
    capsys.readouterr()
    assert cli.main(["export", "--ckpt", str(ray_run), "--out", str(out)]) == 0
    cfg = load_config(ray_run / "config.yaml")
    model = create_model(cfg.model.student, **model_overrides(cfg))
    n = sum(p.numel() for p in model.parameters())
    assert capsys.readouterr().out == (f"opd export: wrote {out} (step 3, {n:,} params, "
                                       f"{cfg.model.student}) from {steps[1]}\n")
    exported = torch.load(out, weights_only=True)
    assert list(exported) == ["model"]
    model.load_state_dict(exported["model"], strict=True)
    student = torch.load(steps[1] / "student.pt", weights_only=True)["model"]
    assert exported["model"].keys() == student.keys() == model.state_dict().keys()
    assert all(torch.equal(exported["model"][k], v) for k, v in student.items())
    # rank 0's student.pt is the DeepSpeed engine's module, and training moved it
    engine = torch.load(steps[1] / "optimizer" / "mp_rank_00_model_states.pt",
                        map_location="cpu", weights_only=False)["module"]
    assert all(torch.equal(engine[k].float(), v) for k, v in student.items())
    before = torch.load(steps[0] / "student.pt", weights_only=True)["model"]
    assert not torch.equal(before["tok_embeddings.weight"], student["tok_embeddings.weight"])

    assert cli.main(["export", "--ckpt", str(ray_run), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (f"opd: error: --out {out} already exists; pass --force to "
                                       f"overwrite it or choose another file\n")
    assert cli.main(["export", "--ckpt", str(steps[0]), "--out", str(out), "--force"]) == 0
    assert "(step 2," in capsys.readouterr().out
    assert torch.equal(torch.load(out, weights_only=True)["model"]["tok_embeddings.weight"],
                       before["tok_embeddings.weight"])


def test_an_unfinished_checkpoint_is_never_read(ray_run, tmp_path, capsys):
    """A step_N.tmp (a writer that died) is skipped by eval and export; named, it is refused."""
    tmp = ckpt.begin(ray_run, 4)
    try:
        ckpt.write_student(tmp, {k: torch.zeros_like(v) for k, v in torch.load(
            ray_run / "checkpoints" / "step_000003" / "student.pt", weights_only=True)["model"].items()})
        assert cli.main(["export", "--ckpt", str(ray_run), "--out", str(tmp_path / "s.pt")]) == 0
        assert "(step 3," in capsys.readouterr().out
        assert cli.main(["eval", "--ckpt", str(tmp), "--num-samples", "8"]) == 2
        assert capsys.readouterr().err == (
            f"opd: error: {tmp} is a checkpoint whose writing did not finish; pass a run directory "
            f"(its newest complete checkpoint) or a complete checkpoints/step_N directory\n")
    finally:
        import shutil
        shutil.rmtree(tmp)
