"""The checkpoint layout of both run modes (opd/run/checkpoints.py): written under step_N.tmp and
renamed when complete, `latest` updated last, a manifest of sizes and CRC-32s, incomplete and
damaged checkpoints never read (the previous complete one is used, said in one line), a failed
write removes its step_N.tmp and leaves the earlier checkpoints alone."""
import errno
import json
import zlib

import pytest
import torch

from opd.run import checkpoints as ckpt
from opd.config.schema import load_config
from opd.config.loader import ConfigError
from opd.models import CheckpointError, create_model, load_llamagen_checkpoint


def write(run_dir, step, model, *, mode="reference", cfg=None):
    """One checkpoint in the layout, the way the reference loop writes it."""
    with ckpt.writing(run_dir, step) as tmp:
        ckpt.write_student(tmp, model.state_dict())
        (tmp / ckpt.OPTIMIZER_DIR / ckpt.TORCH_OPTIMIZER_FILE).write_bytes(b"o" * (100 + step))
        return ckpt.commit(tmp, ckpt.checkpoint_state(cfg or load_config("tiny"), step,
                                                      {"position": 4 * step}, mode))


@pytest.fixture
def model():
    torch.manual_seed(0)
    return create_model("GPT-tiny")


def test_layout_and_state(model, tmp_path):
    path = write(tmp_path, 2, model)
    assert path == tmp_path / "checkpoints" / "step_000002"
    assert sorted(p.relative_to(path).as_posix() for p in path.rglob("*")) == [
        "optimizer", "optimizer/optimizer.pt", "state.json", "student.pt"]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000002\n"
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))
    state = ckpt.read_state(path)
    assert (state["step"], state["policy_version"], state["mode"], state["data"]) == (
        2, 2, "reference", {"position": 8})
    assert state["files"] == {"optimizer/optimizer.pt": 102,
                              "student.pt": (path / "student.pt").stat().st_size}
    assert state["crc32"] == {"optimizer/optimizer.pt": f"{zlib.crc32(b'o' * 102):08x}",
                              "student.pt": f"{zlib.crc32((path / 'student.pt').read_bytes()):08x}"}
    assert len(state["config_hash"]) == 12


def test_config_hash_ignores_only_the_run_directory():
    a = ckpt.checkpoint_state(load_config("tiny", ["run.dir=/a"]), 1, {}, "ray")
    b = ckpt.checkpoint_state(load_config("tiny", ["run.dir=/b"]), 1, {}, "ray")
    c = ckpt.checkpoint_state(load_config("tiny", ["run.dir=/a", "rollout.window=8"]), 1, {}, "ray")
    assert a["config_hash"] == b["config_hash"] != c["config_hash"]


def test_student_is_a_plain_llamagen_state_dict(model, tmp_path):
    path = write(tmp_path, 1, model)
    blob = torch.load(path / "student.pt", weights_only=True)
    assert list(blob) == ["model"]
    assert blob["model"].keys() == model.state_dict().keys()
    assert all(v.dtype == torch.float32 and v.device.type == "cpu" for v in blob["model"].values())
    loaded = load_llamagen_checkpoint(path / "student.pt", "GPT-tiny")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(),
                                                 model.state_dict().values()))
    assert ckpt.student_file(tmp_path) == path / "student.pt"
    assert ckpt.student_file(path / "student.pt") == path / "student.pt"


def test_newest_complete_checkpoint_ignores_tmp_and_damage(model, tmp_path):
    lines = []
    two = write(tmp_path, 2, model)
    four = write(tmp_path, 4, model)
    assert ckpt.latest_checkpoint(tmp_path, report=lines.append) == four and lines == []
    # a writer that died in the middle of step 6: never read, even with a student.pt in it
    tmp = ckpt.begin(tmp_path, 6)
    ckpt.write_student(tmp, model.state_dict())
    assert ckpt.latest_checkpoint(tmp_path, report=lines.append) == four and lines == []
    assert ckpt.damage(tmp) == f"{tmp} is a checkpoint whose writing did not finish"
    # a committed step 4 whose optimizer file was cut short: damaged, step 2 is used, one line
    opt = four / "optimizer" / "optimizer.pt"
    opt.write_bytes(b"o" * 10)
    why = f"{opt} has 10 bytes, not the 104 it was written with"
    assert ckpt.damage(four) == why
    assert ckpt.latest_checkpoint(tmp_path, report=lines.append) == two
    assert lines == [f"opd: skipped damaged checkpoint step_000004 ({why}); using {two}"]
    # the same size with other bytes: caught by the CRC-32
    opt.write_bytes(b"o" * 103 + b"x")
    assert ckpt.damage(four) == f"{opt} has another CRC-32 than when it was written"
    # saving step 6 again replaces the leftover and moves `latest`
    six = write(tmp_path, 6, model)
    assert ckpt.is_complete(six) and not tmp.exists()
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000006\n"
    assert [p.name for p in ckpt.checkpoint_dirs(tmp_path)] == [
        "step_000002", "step_000004", "step_000006"]
    # every one damaged: one line naming all of them, nothing is used
    (two / "student.pt").unlink()
    (six / "student.pt").write_bytes(b"")
    lines.clear()
    assert ckpt.latest_checkpoint(tmp_path, report=lines.append) is None
    assert lines == [f"opd: skipped damaged checkpoints step_000006 ({six / 'student.pt'} has 0 "
                     f"bytes, not the {ckpt.read_state(six)['files']['student.pt']} it was "
                     f"written with); step_000004 ({opt} has another CRC-32 than when it was "
                     f"written); step_000002 ({two / 'student.pt'} is missing); no complete "
                     f"checkpoint is left: starting at step 0"]


def test_manifests_without_checksums_are_checked_by_size(model, tmp_path):
    path = write(tmp_path, 3, model)
    state = json.loads((path / "state.json").read_text())
    del state["crc32"]                                  # written before checksums existed
    (path / "state.json").write_text(json.dumps(state))
    (path / "optimizer" / "optimizer.pt").write_bytes(b"x" * 103)
    assert ckpt.damage(path) is None
    (path / "optimizer" / "optimizer.pt").write_bytes(b"x" * 3)
    assert ckpt.damage(path) == f"{path / 'optimizer' / 'optimizer.pt'} has 3 bytes, not the 103 it was written with"


def test_a_full_disk_removes_the_partial_checkpoint_and_keeps_the_others(model, tmp_path,
                                                                          monkeypatch):
    two = write(tmp_path, 2, model)
    before = {p: p.read_bytes() for p in two.rglob("*") if p.is_file()}

    def full(obj, f):
        f.write(b"PK\x03\x04")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(ckpt.CheckpointWriteError) as e:
        write(tmp_path, 4, model)
    assert str(e.value) == (
        f"cannot write checkpoint {tmp_path / 'checkpoints' / 'step_000004'} (No space left on "
        f"device); free space on that disk or make it writable, then continue with: opd train "
        f"--resume {tmp_path} (its last complete checkpoint: step_000002)")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000002"]
    assert {p: p.read_bytes() for p in two.rglob("*") if p.is_file()} == before
    assert ckpt.latest_checkpoint(tmp_path) == two


def test_find_checkpoint_takes_run_checkpoints_and_step_dirs(model, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("{}\n")
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        ckpt.find_checkpoint(run)
    two, three = write(run, 2, model), write(run, 3, model)
    assert ckpt.find_checkpoint(run) == (three, run)
    assert ckpt.find_checkpoint(run / "checkpoints") == (three, run)
    assert ckpt.find_checkpoint(two) == (two, run)
    assert ckpt.checkpoint_step(two) == 2
    for bad, message in [(run / "nope", "does not exist"), (two / "student.pt", "is a file"),
                         (ckpt.begin(run, 4), "did not finish"),
                         (tmp_path, "not a checkpoints/step_N directory")]:
        with pytest.raises(CheckpointError, match=message):
            ckpt.find_checkpoint(bad)
    (two / "state.json").write_text('{"step": 2')
    with pytest.raises(CheckpointError, match="no readable state.json"):
        ckpt.find_checkpoint(two)


def test_resume_refuses_the_other_mode(model, tmp_path):
    path = write(tmp_path, 1, model, mode="ray")
    assert ckpt.read_state(path, mode="ray")["mode"] == "ray"
    with pytest.raises(ConfigError, match="run.mode=ray run; resume it with run.mode=ray"):
        ckpt.read_state(path, mode="reference")
    assert json.loads((path / "state.json").read_text())["mode"] == "ray"
