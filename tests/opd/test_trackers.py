"""run.loggers in the reference loop, read back with each tool's own reader: TensorBoard's
EventAccumulator, MlflowClient against a real tracking server on 127.0.0.1, and W&B's offline
run files (its protobuf records).  One run is stopped after a step whose checkpoint is behind
it and resumed, so the resume repeats that step: every tracker still holds each step once."""
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from launch.cli import main
from opd.config.schema import load_config
from opd.eval.tracking import read_quality, student_grid_path
from opd.run.metrics_log import read_metrics
from opd.run.reference import run_reference
from opd.run.trackers import (STATE_FILE, RunTrackers, quality_scalars, read_state, step_scalars,
                          tag)

STEPS = 4
FIRST = 3                       # steps of the first attempt; its checkpoint is of step 2


def cfg_for(tiny_overrides, *extra):
    return load_config("tiny", [*tiny_overrides, "run.mode=reference", f"distill.steps={STEPS}",
                                "run.checkpoint_every=2", "rollout.engine=cached_ar", *extra])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`mlflow server` on 127.0.0.1:<free port> with its own sqlite store, until stop()."""

    def __init__(self, root: Path):
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        root.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
             "--artifacts-destination", str(root / "artifacts")],
            stdout=(root / "server.log").open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{self.uri}/health", timeout=2).read()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"mlflow server did not start: "
                                       f"{(root / 'server.log').read_text()[-2000:]}")
                time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def tensorboard_events(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0,
                                                                         "tensors": 0})
    acc.Reload()
    return acc


def wandb_records(run_dir: Path) -> list:
    """Every record of the run's offline .wandb files, oldest run first: W&B's own protobuf
    `Record` messages in its leveldb-log framing (7-byte header, 32 KiB blocks, records of
    crc32 · length · type)."""
    from wandb.proto.wandb_internal_pb2 import Record
    out = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        data = path.read_bytes()
        assert data[:4] == b":W&B"
        pos, chunk = 7, b""
        while pos + 7 <= len(data):
            block_left = 32768 - pos % 32768
            if block_left < 7:
                pos += block_left
                continue
            _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if kind == 0 and length == 0:
                pos += block_left
                continue
            chunk += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):                   # FULL or LAST
                r = Record()
                r.ParseFromString(chunk)
                out.append(r)
                chunk = b""
    return out


def expected_steps(rows):
    phase_names = [rows[0]["phase"]]
    return {int(r["step"]): step_scalars(r, phase_names) for r in rows}


def timing(tag: str) -> bool:
    """A wall-clock column, which a repeated step measures anew: `*_s`, or a teacher's
    `*_s/<name>`."""
    return tag.endswith("_s") or "_s/" in tag


@pytest.fixture(scope="module")
def tracked(tiny_overrides, tmp_path_factory, opd_cache):
    from opd.models.factory import load_role_model
    root = tmp_path_factory.mktemp("trackers")
    cfg = cfg_for(tiny_overrides, "run.loggers=[tensorboard,mlflow,wandb]")
    for role in ("teacher", "student"):
        load_role_model(cfg, role, progress=False)
    server = MlflowServer(root / "mlflow-server")
    try:
        cfg = cfg_for(tiny_overrides, "run.loggers=[tensorboard,mlflow,wandb]",
                      f"run.mlflow_uri={server.uri}")
        run_dir = root / "run"
        run_reference(cfg, run_dir, progress=False, stop_after=FIRST)
        first = read_state(run_dir)
        rows = run_reference(cfg, run_dir, progress=False, resume=True)
        from mlflow.tracking import MlflowClient
        client = MlflowClient(tracking_uri=server.uri)
        run_id = read_state(run_dir)["mlflow"]["run_id"]
        mlflow = {"run": client.get_run(run_id), "runs": client.search_runs(
                      [client.get_experiment_by_name("opd").experiment_id]),
                  "history": {k: client.get_metric_history(run_id, k)
                              for k in client.get_run(run_id).data.metrics},
                  "artifacts": [a.path for a in client.list_artifacts(run_id, "samples")]}
    finally:
        server.stop()
    return {"rows": rows, "run_dir": run_dir, "first": first, "mlflow": mlflow}


def test_the_first_attempt_ran_past_its_checkpoint(tracked):
    """The resume repeats a step the trackers already had (what the rest checks against)."""
    first, run_dir = tracked["first"], tracked["run_dir"]
    assert {name: first[name]["steps"] for name in first} == \
        {"tensorboard": FIRST - 1, "mlflow": FIRST - 1, "wandb": FIRST - 1}
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == \
        ["step_000002", "step_000004"]
    state = read_state(run_dir)
    assert {n: (state[n]["run_id"], state[n]["steps"]) for n in state} == \
        {n: (first[n]["run_id"], STEPS - 1) for n in first}          # the same tracker runs


def test_tensorboard_holds_every_row_and_grid(tracked, check_tensorboard):
    rows, run_dir = tracked["rows"], tracked["run_dir"]
    assert read_metrics(run_dir) == rows
    acc = check_tensorboard(run_dir, [0, 2, 4])          # purge_step: the resumed values
    tags = set().union(*expected_steps(rows).values())
    assert {t.split("/")[0] for t in tags} == {"loss", "rollout", "teacher", "learner", "onpolicy",
                                                "queue"}
    images = acc.Images("samples/student")
    assert [e.step for e in images] == [0, 2, 4]
    from PIL import Image
    import io
    for e in images:
        shown = np.asarray(Image.open(io.BytesIO(e.encoded_image_string)).convert("RGB"))
        png = np.asarray(Image.open(student_grid_path(run_dir, e.step)).convert("RGB"))
        assert np.array_equal(shown, png)
    assert [e.step for e in acc.Images("samples/teacher")] == [0]
    assert {"config/text_summary", "phases/text_summary"} <= set(acc.Tags()["tensors"])


def test_mlflow_server_got_each_step_once(tracked):
    rows, ml = tracked["rows"], tracked["mlflow"]
    assert len(ml["runs"]) == 1                          # the resume continued the same run
    assert ml["run"].info.status == "FINISHED"
    expected = expected_steps(rows)
    first_attempt = FIRST - 1                            # the step logged before the resume
    for t in set().union(*expected.values()):
        history = ml["history"][t]
        assert sorted(m.step for m in history) == [s for s in range(STEPS) if t in expected[s]]
        for m in history:
            if not (m.step == first_attempt and timing(t)):
                assert m.value == pytest.approx(expected[m.step][t], rel=1e-12), (t, m.step)
    quality = read_quality(tracked["run_dir"])
    teacher = next(r for r in quality if r["role"] == "teacher")
    assert sorted(m.step for m in ml["history"]["quality/fid"]) == [0, 2, 4]
    for r in (r for r in quality if r["role"] == "student"):
        for t, v in quality_scalars(r, teacher).items():
            assert [m.value for m in ml["history"][t] if m.step == r["step"]] == \
                [pytest.approx(v, rel=1e-12)], t
    params = ml["run"].data.params
    assert params["distill.steps"] == str(STEPS) and params["run.mode"] == "reference"
    assert params["phases.0"].startswith(f"{rows[0]['phase']}: steps 0-{STEPS - 1}")
    assert sorted(ml["artifacts"]) == sorted(
        f"samples/{n}" for n in ("teacher.png", *(student_grid_path(".", s).name
                                                  for s in (0, 2, 4))))


def test_wandb_offline_run_holds_the_last_step(tracked):
    rows, run_dir = tracked["rows"], tracked["run_dir"]
    import json
    records = wandb_records(run_dir)
    runs = {r.run.run_id for r in records if r.WhichOneof("record_type") == "run"}
    assert runs == {read_state(run_dir)["wandb"]["run_id"]}              # one run id, resumed
    history = [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                for i in r.history.item} for r in records if r.WhichOneof("record_type") == "history"]
    assert sorted(h["step"] for h in history if "step" in h) == list(range(STEPS))
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                            for i in r.summary.update})
    last = expected_steps(rows)[STEPS - 1]
    assert summary["step"] == STEPS - 1
    for t, v in last.items():
        assert summary[t] == pytest.approx(v, rel=1e-12), t
    quality = read_quality(run_dir)
    assert summary["quality/fid"] == pytest.approx(quality[-1]["fid"], rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Without a run: the mapping rule, a failing tracker, a missing package.

def test_tag_groups_every_column_by_stage():
    assert [tag(c) for c in ("loss", "kl", "rollout_s", "teacher_s", "learner_idle", "onpolicy_s",
                             "queue_depth", "rounds", "grad_norm", "on_policy", "policy_lag",
                             "phase")] == \
        ["loss/loss", "loss/kl", "rollout/rollout_s", "teacher/teacher_s", "learner/learner_idle",
         "onpolicy/onpolicy_s", "queue/queue_depth", "rollout/rounds", "learner/grad_norm",
         "onpolicy/on_policy", "queue/policy_lag", "loss/phase"]
    row = {"step": 3, "phase": "gkd", "source": "student", "loss": 0.5, "commit_hist": [2, 1],
           "tokens": 7, "kl": None}
    assert step_scalars(row, ["kd", "gkd"]) == {"loss/phase": 1.0, "rollout/source": 1.0,
                                                "loss/loss": 0.5, "rollout/commit_hist/0": 2.0,
                                                "rollout/commit_hist/1": 1.0, "loss/tokens": 7.0}


class Broken:
    """A backend whose second step fails (an unreachable server, mid-run)."""
    purges, run_id, calls = False, "broken-1", []

    def __init__(self, *a, **k):
        pass

    def config(self, *a):
        pass

    def scalars(self, step, values):
        Broken.calls.append(step)
        if step == 1:
            raise ConnectionError("HTTPConnectionPool(host='127.0.0.1', port=9): refused\nmore")

    def quality(self, *a):
        pass

    def close(self):
        raise AssertionError("a failed tracker is not closed")

    def abandon(self):
        pass


def test_failing_tracker_prints_one_line_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    from opd.run import tracker_backends
    monkeypatch.setitem(tracker_backends.BACKENDS, "mlflow", Broken)
    cfg = load_config("tiny", ["run.loggers=[mlflow,tensorboard]"])
    trackers = RunTrackers(cfg, tmp_path, start=0, resume=False)
    for step in range(3):
        trackers.step({"step": step, "loss": 1.0 / (step + 1)})
    trackers.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["opd: mlflow failed and logs no more in this run: ConnectionError: "
                   "HTTPConnectionPool(host='127.0.0.1', port=9): refused"]
    assert Broken.calls == [0, 1]
    acc = tensorboard_events(tmp_path)                              # the others went on
    assert [(e.step, e.value) for e in acc.Scalars("loss/loss")] == \
        [(s, np.float32(1.0 / (s + 1))) for s in range(3)]
    assert read_state(tmp_path)["mlflow"]["steps"] == 0
    assert (tmp_path / STATE_FILE).is_file()


def test_unreachable_mlflow_server_never_stops_training(tiny_overrides, tmp_path, capsys):
    cfg = cfg_for(tiny_overrides, "run.loggers=[mlflow]", "distill.steps=2", "eval.track=false",
                  f"run.mlflow_uri=http://127.0.0.1:{free_port()}")
    rows = run_reference(cfg, tmp_path, progress=False)
    assert [r["step"] for r in rows] == [0, 1]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_000002"]
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("opd:")]
    assert len(err) == 1 and err[0].startswith("opd: mlflow did not start and logs nothing")


def test_missing_tracker_package_stops_the_command(tmp_path, capsys, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    assert main(["train", "--config", "tiny", f"run.dir={tmp_path}/run", "run.mode=reference",
                 "run.loggers=[tensorboard,wandb]"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("opd: error: run.loggers names wandb, but the wandb package is not installed; "
                   "install it with pip install -e \".[wandb]\" (or pip install wandb), or leave "
                   "wandb out of run.loggers")
    assert not (tmp_path / "run").exists()
