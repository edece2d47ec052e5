"""Bad input, nothing lost: every bad input a user can give `opd train` (and `opd export`) gets
one line on stderr naming the thing and what to do, exit code 2 (130 for Ctrl-C), and leaves an
existing run and its checkpoints byte for byte as they were; a run that failed leaves nothing a
later run counts as used.  In-process (`launch.cli.main`), run.mode=reference, tiny preset.
The table of what each input shows is in the issue's note (issue 14)."""
from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from launch.cli import main
from opd.run import checkpoints as ckpt
from opd.data import write_token_parquet
from opd.config.schema import load_config
from opd.run.metrics_log import read_metrics

STEPS = 4


def tiny(digits_dir) -> list[str]:
    return ["--config", "tiny", f"data.data_dir={digits_dir}", "run.mode=reference",
            "eval.track=false", f"distill.steps={STEPS}", "rollout.decoding=greedy",
            "rollout.gamma=2"]


def snapshot(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes()
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def existing(tmp_path_factory, digits_dir):
    """A finished run (steps 0..3, checkpoints step_2 and step_4) and its bytes."""
    run = tmp_path_factory.mktemp("existing") / "run"
    assert main(["train", *tiny(digits_dir), f"run.dir={run}"]) == 0
    return run, snapshot(run)


@pytest.fixture(scope="module")
def bad(tmp_path_factory, existing, opd_cache) -> Path:
    """The bad files: YAML, Parquet files, checkpoints."""
    b = tmp_path_factory.mktemp("bad")
    rng = np.random.default_rng(0)
    write_token_parquet(b / "vocab/train.parquet", rng.integers(0, 10, 8),
                        rng.integers(0, 1024, (8, 64)), vocab_size=1024, num_classes=10,
                        grid_size=8, tokenizer="other-vq")
    write_token_parquet(b / "seqlen/train.parquet", rng.integers(0, 10, 8),
                        rng.integers(0, 17, (8, 256)), vocab_size=17, num_classes=10,
                        grid_size=16, tokenizer="digits16-v1")
    (b / "empty").mkdir()
    (b / "empty/train.parquet").write_bytes(b"")
    (b / "truncated").mkdir()
    whole = (b / "seqlen/train.parquet").read_bytes()
    (b / "truncated/train.parquet").write_bytes(whole[:len(whole) // 2])
    (b / "bad.yaml").write_text("extends: tiny\ndata: [unclosed\n")
    (b / "notes.txt").write_text("not a checkpoint\n")
    student = (existing[0] / "checkpoints/step_000004/student.pt").read_bytes()
    (b / "truncated.pt").write_bytes(student[:3000])
    teacher = next((Path(opd_cache) / "pretrained").glob("teacher-GPT-digits-T-*.pt"))
    shutil.copy(teacher, b / "teacher.pt")
    (b / "afile").write_text("x")
    return b


# (name, the arguments after `opd train` (TINY, B: bad files), the one line on stderr)
CASES = [
    ("malformed YAML", ["--config", "{B}/bad.yaml"],
     'opd: error: {B}/bad.yaml: invalid YAML: while parsing a flow sequence in "<unicode '
     'string>", line 2, column 7: data: [unclosed ^ expected \',\' or \']\', but got \'<stream '
     'end>\' in "<unicode string>", line 3, column 1: ^'),
    ("unknown key", ["TINY", "rollout.windw=8"],
     "opd: error: unknown config key 'rollout.windw'; did you mean 'rollout.window'?"),
    ("mistyped value", ["TINY", "rollout.window=abc"],
     "opd: error: rollout.window='abc': expected int or 'auto'"),
    ("an entry of an empty phases list", ["TINY", "distill.phases.0.steps=3"],
     "opd: error: distill.phases.0.steps: distill.phases is empty, so it has no entry 0; set "
     "the whole list as distill.phases=[{...}, ...]"),
    ("data of another vocabulary", ["TINY", "data.dataset=parquet", "data.data_dir={B}/vocab"],
     "opd: error: {B}/vocab/train.parquet: the data was tokenized with vocab_size=1024 "
     "(other-vq) but vocab_size=17 is expected; use a dataset and model that share one "
     "tokenizer and label set."),
    ("data of another sequence length", ["TINY", "data.dataset=parquet", "data.data_dir={B}/seqlen"],
     "opd: error: {B}/seqlen/train.parquet: the data was tokenized with grid_size=16 "
     "(digits16-v1) but grid_size=8 is expected; use a dataset and model that share one "
     "tokenizer and label set."),
    ("empty Parquet file", ["TINY", "data.dataset=parquet", "data.data_dir={B}/empty"],
     "opd: error: {B}/empty/train.parquet: not a readable Parquet file (Parquet file size is 0 "
     "bytes); regenerate it, write it with opd.data.write_token_parquet (or `opd prepare`)."),
    ("truncated Parquet file", ["TINY", "data.dataset=parquet", "data.data_dir={B}/truncated"],
     "opd: error: {B}/truncated/train.parquet: not a readable Parquet file (Parquet magic bytes "
     "not found in footer. Either the file is corrupted or this is not a parquet file.); "
     "regenerate it, write it with opd.data.write_token_parquet (or `opd prepare`)."),
    ("checkpoint of another model size", ["TINY", "model.student_ckpt={B}/teacher.pt"],
     "opd: error: {B}/teacher.pt does not fit the model: unexpected keys [layers.2.attention."
     "wo.weight, layers.2.attention.wqkv.weight, layers.2.attention_norm.weight, layers.2."
     "feed_forward.w1.weight, layers.2.feed_forward.w2.weight, layers.2.feed_forward.w3.weight "
     "(+8 more)]; mis-shaped keys [cls_embedding.embedding_table.weight: file (11, 128) vs model "
     "(11, 64), layers.0.attention.wo.weight: file (128, 128) vs model (64, 64), layers.0."
     "attention.wqkv.weight: file (384, 128) vs model (192, 64), layers.0.attention_norm.weight:"
     " file (128,) vs model (64,), layers.0.feed_forward.w1.weight: file (352, 128) vs model "
     "(192, 64), layers.0.feed_forward.w2.weight: file (128, 352) vs model (64, 192) (+12 more)]"
     "; check that the preset (and vocab/grid overrides) match the file"),
    ("truncated checkpoint", ["TINY", "model.student_ckpt={B}/truncated.pt"],
     "opd: error: cannot read checkpoint {B}/truncated.pt: PytorchStreamReader failed reading "
     "zip archive: failed finding central directory. This is an internal miniz error. If you "
     "are seeing this error, there is a high likelihood that your checkpoint file is corrupted. "
     "This can happen if the checkpoint was not saved properly, was transferred incorrectly, or "
     "the file was modified after saving."),
    ("a file that is not a checkpoint", ["TINY", "model.student_ckpt={B}/notes.txt"],
     "opd: error: {B}/notes.txt is not a checkpoint (neither a file written by torch.save nor "
     "safetensors); pass a LlamaGen c2i_*.pt, a .safetensors file, a run's "
     "checkpoints/step_N/student.pt or a run directory"),
    ("a missing checkpoint", ["TINY", "model.student_ckpt={B}/nope.pt"],
     "opd: error: model.student_ckpt={B}/nope.pt does not exist; download the LlamaGen c2i_*.pt "
     "file there, or set the key to null to pretrain a student on the configured data"),
]


def argv_of(args: list[str], digits_dir, b: Path) -> list[str]:
    out = []
    for a in args:
        out += tiny(digits_dir) if a == "TINY" else [a.replace("{B}", str(b))]
    return out


def one_line(capsys) -> str:
    """The one line on stderr, besides the progress bar of a run that had started."""
    err = capsys.readouterr().err
    lines = [line for line in err.split("\n") if line and not line.startswith("\ropd reference:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("name,args,line", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_nothing_is_lost(name, args, line, existing, bad,
                                                          digits_dir, tmp_path, capsys):
    run, before = existing
    assert main(["train", *argv_of(args, digits_dir, bad), f"run.dir={tmp_path / 'new'}"]) == 2
    assert one_line(capsys) == line.replace("{B}", str(bad))
    # nothing a later run counts as used: no directory, or only the resolved config.yaml
    assert not (tmp_path / "new").exists() or os.listdir(tmp_path / "new") == ["config.yaml"]
    assert snapshot(run) == before


def test_a_run_that_failed_before_its_first_step_leaves_a_directory_a_new_run_takes(
        existing, bad, digits_dir, tmp_path, capsys):
    new = tmp_path / "new"
    assert main(["train", *tiny(digits_dir), "data.dataset=parquet",
                 f"data.data_dir={bad}/empty", f"run.dir={new}"]) == 2
    assert os.listdir(new) == ["config.yaml"]
    capsys.readouterr()
    assert main(["train", *tiny(digits_dir), "distill.steps=2", f"run.dir={new}"]) == 0
    assert capsys.readouterr().err.splitlines()[0] == (
        f"opd train: {new} holds only the config.yaml of a run that stopped before its first "
        f"step; starting a new run there")
    assert [r["step"] for r in read_metrics(new)] == [0, 1]
    assert "data_dir: " + str(digits_dir) in (new / "config.yaml").read_text()


def test_run_directory_that_cannot_be_written(existing, bad, digits_dir, tmp_path, capsys,
                                              monkeypatch):
    """As root chmod does not stop writes: a run.dir under a file (mkdir fails, real), and an
    existing directory whose writes fail with EACCES (os.open patched for paths inside it)."""
    run, before = existing
    assert main(["train", *tiny(digits_dir), f"run.dir={bad}/afile/run"]) == 2
    assert one_line(capsys) == (f"opd: error: cannot create run directory {bad}/afile/run (Not a "
                                f"directory); choose a run.dir you can write to")
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    real_open = os.open

    def no_write(path, flags, *a, **k):
        if str(path).startswith(str(copy)) and flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *a, **k)
    monkeypatch.setattr(os, "open", no_write)
    assert main(["train", "--resume", str(copy)]) == 2
    monkeypatch.undo()
    assert one_line(capsys) == (f"opd: error: cannot write to run directory {copy} (Permission "
                                f"denied); choose a run.dir you can write to")
    assert snapshot(copy) == before and snapshot(run) == before


def test_a_full_disk_during_a_checkpoint_write(existing, digits_dir, tmp_path, capsys,
                                               monkeypatch):
    """torch.save of step 4's checkpoint fails with ENOSPC: one line naming the checkpoint and
    the fix; step_000002 stays, the partial step_000004.tmp is removed; --resume finishes."""
    run = tmp_path / "run"
    save = torch.save

    def full(obj, f, *a, **k):
        if "step_000004.tmp" in str(getattr(f, "name", f)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(obj, f, *a, **k)
    monkeypatch.setattr(torch, "save", full)
    assert main(["train", *tiny(digits_dir), f"run.dir={run}"]) == 2
    monkeypatch.undo()
    assert one_line(capsys) == (
        f"opd: error: cannot write checkpoint {run}/checkpoints/step_000004 (No space left on "
        f"device); free space on that disk or make it writable, then continue with: opd train "
        f"--resume {run} (its last complete checkpoint: step_000002)")
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_000002"]
    assert not (run / "lock").exists()
    assert main(["train", "--resume", str(run)]) == 0
    assert [r["step"] for r in read_metrics(run)] == list(range(STEPS))
    assert [r["loss"] for r in read_metrics(run)] == [r["loss"] for r in read_metrics(existing[0])]


def test_a_full_disk_while_writing_the_metrics(digits_dir, tmp_path, capsys, monkeypatch):
    from opd.run.metrics_log import MetricsLog
    run = tmp_path / "run"

    def full(self):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
    monkeypatch.setattr(MetricsLog, "flush", full)
    assert main(["train", *tiny(digits_dir), f"run.dir={run}"]) == 2
    assert one_line(capsys) == (f"opd: error: {run}/metrics.parquet: No space left on device; "
                                f"free space or fix the permissions there, then continue with: "
                                f"opd train --resume {run}")
    assert not (run / "lock").exists()


def test_ctrl_c_twice_aborts_with_130_and_keeps_the_last_checkpoint(digits_dir, tmp_path,
                                                                    capsys, monkeypatch):
    import opd.run.reference
    run = tmp_path / "run"
    learn = opd.run.reference.learn
    calls = []

    def learn_then_ctrl_c_twice(*a, **k):
        calls.append(1)
        out = learn(*a, **k)
        if len(calls) == 3:                    # during step 2, after checkpoint step_000002
            os.kill(os.getpid(), signal.SIGINT)    # deferred to the end of the step ...
            os.kill(os.getpid(), signal.SIGINT)    # ... a second one aborts at once
        return out
    monkeypatch.setattr(opd.run.reference, "learn", learn_then_ctrl_c_twice)
    assert main(["train", *tiny(digits_dir), f"run.dir={run}"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"opd train: aborted without a checkpoint of this step; the last complete "
                       f"one is {run}/checkpoints/step_000002; continue with: opd train --resume "
                       f"{run}")
    assert ckpt.latest_checkpoint(run) == run / "checkpoints/step_000002"
    assert not (run / "lock").exists()


def test_a_second_train_on_a_run_that_a_live_run_holds_is_refused(existing, digits_dir,
                                                                  tmp_path, capsys):
    import socket
    run, before = existing
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (copy / "lock").write_text(f"{holder.pid} {socket.gethostname()}\n")
        line = (f"opd: error: run directory {copy} is in use by another opd train (pid "
                f"{holder.pid} on {socket.gethostname()}, {copy}/lock); wait for it or stop it, "
                f"or delete {copy}/lock if that process is gone")
        assert main(["train", "--resume", str(copy)]) == 2
        assert one_line(capsys) == line
        assert main(["train", *tiny(digits_dir), f"run.dir={copy}"]) == 2
        assert one_line(capsys) == line
        assert (copy / "lock").read_text() == f"{holder.pid} {socket.gethostname()}\n"
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: its lock is taken over with one line (the run is finished: 0 steps)
    assert main(["train", "--resume", str(copy)]) == 0
    assert capsys.readouterr().err.splitlines()[0] == (
        f"opd train: taking over {copy}/lock from pid {holder.pid}, which is no longer running")
    assert not (copy / "lock").exists()
    kept = lambda snap: {k: v for k, v in snap.items() if k.startswith(("checkpoints/", "config"))}
    assert kept(snapshot(copy)) == kept(before)
    assert read_metrics(copy) == read_metrics(run)


def test_resume_falls_back_past_a_damaged_checkpoint_in_one_line(existing, tmp_path, capsys):
    """Item 2 of issue 14: the newest checkpoint's student.pt is cut short, then one byte of it
    is changed at the same size; each time --resume says which one it skipped, why and which
    it uses, and the run finishes with every step's metrics and the uninterrupted losses."""
    run, before = existing
    losses = [r["loss"] for r in read_metrics(run)]
    for damage, why in [
            (lambda b: b[:len(b) // 2], "has {n} bytes, not the {size} it was written with"),
            (lambda b: b[:100] + bytes([b[100] ^ 1]) + b[101:],
             "has another CRC-32 than when it was written")]:
        copy = tmp_path / f"copy{len(why)}"
        shutil.copytree(run, copy)
        student = copy / "checkpoints/step_000004/student.pt"
        size = student.stat().st_size
        student.write_bytes(damage(student.read_bytes()))
        assert main(["train", "--resume", str(copy)]) == 0
        reason = why.format(n=size // 2, size=size)
        assert capsys.readouterr().err.splitlines()[0] == (
            f"opd: skipped damaged checkpoint step_000004 ({student} {reason}); using "
            f"{copy}/checkpoints/step_000002")
        rows = read_metrics(copy)
        assert [r["step"] for r in rows] == list(range(STEPS))
        assert [r["loss"] for r in rows] == losses
        assert snapshot(copy)["checkpoints/step_000004/student.pt"] == \
            before["checkpoints/step_000004/student.pt"]           # rewritten, the same bytes


def test_resume_of_a_directory_that_is_not_a_run(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert one_line(capsys) == (f"opd: error: cannot resume from {tmp_path}: it holds no "
                                f"config.yaml; pass the directory of an earlier opd train run")


@pytest.mark.parametrize("cut", ["inside data.data_dir", "before the data section"])
def test_resume_of_a_run_whose_config_yaml_was_cut_short(existing, tmp_path, capsys, cut):
    """Issue 31's once-failed fuzz case (run directories: break_config + no_metrics, --resume),
    written by hand: the cut config.yaml loaded, the keys after the cut took their defaults,
    and the resume trained another run (default steps and schedule) and, cut inside
    data.data_dir, prepared a digits set at the cut path, outside the run.  Refused now, in one
    line naming the file and the first missing keys; nothing changes, nothing is made."""
    run, _ = existing
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    text = (copy / "config.yaml").read_text()
    start = text.index("data_dir: ") + len("data_dir: ")
    at = (start + text.index("\n", start)) // 2 if cut.startswith("inside") else \
        text.index("\ndata:") + 1
    (copy / "config.yaml").write_text(text[:at])
    (copy / "metrics.parquet").unlink()
    before = snapshot(copy)
    assert main(["train", "--resume", str(copy)]) == 2
    first = "data.train, data.heldout" if cut.startswith("inside") else "data, rollout"
    assert one_line(capsys).startswith(f"opd: error: {copy}/config.yaml lacks {first}")
    assert snapshot(copy) == before
    if cut.startswith("inside"):     # no data set at the cut path (which may exist: a parent dir)
        assert not any((Path(text[start:at]) / f).exists() for f in ("train.parquet", "heldout.parquet"))


def test_export_of_a_file_or_of_a_run_without_a_complete_checkpoint(existing, bad, tmp_path,
                                                                    capsys):
    assert main(["export", "--ckpt", str(bad / "notes.txt"), "--out", str(tmp_path / "s.pt")]) == 2
    assert one_line(capsys) == (f"opd: error: {bad}/notes.txt is a file; pass a run directory "
                                f"of opd train or its checkpoints/step_N directory")
    copy = tmp_path / "copy"
    shutil.copytree(existing[0], copy)
    shutil.rmtree(copy / "checkpoints/step_000002")
    (copy / "checkpoints/step_000004/student.pt").write_bytes(b"")
    assert main(["export", "--ckpt", str(copy), "--out", str(tmp_path / "s.pt")]) == 2
    size = len(existing[1]["checkpoints/step_000004/student.pt"])
    assert one_line(capsys) == (
        f"opd: error: run directory {copy} holds no complete checkpoint (checkpoints/step_N/"
        f"student.pt) (damaged: step_000004 ({copy}/checkpoints/step_000004/student.pt has 0 "
        f"bytes, not the {size} it was written with)); train it (opd train, --resume) or wait "
        f"for its first one (run.checkpoint_every)")
    assert not (tmp_path / "s.pt").exists()


def test_resume_applies_safe_overrides_and_refuses_the_others(existing, tmp_path, capsys):
    """Issue 13 item 5: `--resume RUN key=value` extends a finished run (distill.steps, the
    checkpoint cadence; its first steps' rows stay as they were), keeps the new values in
    config.yaml for the next resume, and refuses a key that would change what the steps compute
    -- or --config, or a retired key -- naming it, with the run left byte for byte."""
    run, before = existing
    copy = tmp_path / "extended"
    shutil.copytree(run, copy)
    for argv, line in [
            (["rollout.window=8"], "opd: error: --resume cannot change rollout.window: the "
             "resumed steps would be another run's; only distill.steps, run.checkpoint_every, "
             "run.log_every, run.loggers, run.mlflow_uri and eval.* change on resume (start a "
             "new run for the rest)"),
            (["--config", "tiny"], "opd: error: --resume takes the run's own config.yaml, not "
             "--config tiny; pass only key=value overrides of what may change"),
            (["run.deterministic=false"], "opd: error: config key 'run.deterministic' was "
             "removed: runs are always reproducible (keyed random numbers, seeded "
             "initialization), so the key did nothing; drop it")]:
        assert main(["train", "--resume", str(copy), *argv]) == 2
        assert one_line(capsys) == line
        assert snapshot(copy) == before
    assert main(["train", "--resume", str(copy), f"distill.steps={STEPS + 2}",
                 "run.checkpoint_every=3"]) == 0
    assert capsys.readouterr().err.splitlines()[0] == (
        f"opd train: resuming {copy} with distill.steps={STEPS + 2} run.checkpoint_every=3")
    rows = read_metrics(copy)
    assert [r["step"] for r in rows] == list(range(STEPS + 2))
    assert [r["loss"] for r in rows[:STEPS]] == [r["loss"] for r in read_metrics(run)]
    assert [p.name for p in ckpt.checkpoint_dirs(copy)] == [
        "step_000002", "step_000004", "step_000006"]
    saved = load_config(copy / "config.yaml")
    assert (saved.distill.steps, saved.run.checkpoint_every) == (STEPS + 2, 3)


def test_an_old_config_yaml_with_retired_keys_still_loads(tmp_path):
    old = tmp_path / "config.yaml"
    old.write_text("run:\n  deterministic: true\n  resume: null\n  seed: 3\n")
    assert load_config(old).run.seed == 3
