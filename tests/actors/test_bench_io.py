"""The scale dry run (`opd bench step --synthetic`, actors/bench/io.py, launch/bench/step_io.py)
shrunk to GPT-tiny shapes: the table's rows and columns, the learner's received bytes equal to
the scored batch's exact payload size, and the driver receives none.  No timing is asserted."""
from __future__ import annotations

import json

import pytest
import torch

TINY = ["model.student=GPT-tiny", "model.teacher=GPT-tiny", "model.vocab_size=11",
        "model.num_classes=4", "model.grid_size=4", "rollout.history_offset=null",
        "rollout.window=4", "teacher.topk=4", "data.batch_size=4", "rollout.num_cpus=0.25",
        "teacher.num_cpus=0.25", "learner.num_cpus=0.5"]


@pytest.mark.slow   # the bytes each role receives, on a Ray run: tests/actors/test_driver_payloads.py
def test_scale_dry_run_reports_bytes_by_role(ray_session, tmp_path):
    from launch.cli import main
    from opd.distill.batch import index_dtype
    from opd.models import create_model
    out = tmp_path / "scale"
    code = main(["bench", "step", "--config", "llamagen_scale_cpu", "--synthetic", "--modes",
                 "ray", "--engines", "cached_ar", "--steps", "2", "--warmup-steps", "1",
                 "--out", str(out), *TINY])
    assert code == 0
    assert (out / "synthetic" / "train.parquet").is_file()
    report = json.loads((out / "step.json").read_text())
    (res,) = report["results"]
    io = res["io"]
    roles = ["driver", "rollout/0", "teacher/0", "learner/0"]
    assert list(io["roles"]) == roles and io["steps"] == [1, 2]
    B, L, k = 4, 16, 4
    itemsize = torch.empty(0, dtype=index_dtype(11)).element_size()     # int16: 2
    for row in res["rows"]:
        N = L - row["prefix_len"]
        # labels (B,) int64 + tokens (B, L) int64 + top-k values (B, N, k) float32 and indices
        # + the behaviour log-probs (B, N) float32 of the student's tokens
        scored = B * 8 + B * L * 8 + B * N * k * (4 + itemsize) + B * N * 4
        step_io = row["io"]
        assert step_io["learner/0"]["received_bytes"] == scored
        assert step_io["teacher/0"]["sent_bytes"] == scored
        assert step_io["driver"]["received_bytes"] == 0                 # reports and counts only
        student = create_model("GPT-tiny", vocab_size=11, num_classes=4, grid_size=4)
        weights = sum(v.numel() * 4 for v in student.state_dict().values())
        assert step_io["learner/0"]["sent_bytes"] == weights            # one publish per step
        assert step_io["rollout/0"]["received_bytes"] >= weights
        # ru_maxrss is KiB on Linux: in bytes, any process that imported torch is > 100 MiB
        assert all(v["peak_rss_bytes"] > 100 * 2 ** 20 for v in step_io.values()), step_io
    store = io["object_store"]
    assert store["max_used_bytes"] is not None and store["max_used_bytes"] >= weights, store
    text = (out / "step.md").read_text()
    assert "| role | received MiB/step | sent MiB/step | peak RSS MiB |" in text
    for role in roles:
        assert f"| {role} |" in text
    assert "Step time split (mean s): rollout" in text and "Object store (plasma" in text
