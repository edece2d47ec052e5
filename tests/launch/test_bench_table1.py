"""`opd bench table1` (launch/bench/table1.py): the rows of the CPU tiny preset relate exactly as
the measured samples and the engines say; the GPU preset without a GPU prints placeholders."""
import json
import math

import numpy as np
import pytest
import torch

from launch.bench import common, table1 as t1
from launch.bench.table1 import NO_GPU, format_markdown, load_table1_bench, run_table1
from rollout import make_engine


@pytest.fixture(scope="module")
def tiny(tiny_overrides):
    """table1_cpu_tiny, its pretrained workload reading the session's digits data."""
    b = load_table1_bench("table1_cpu_tiny")
    for w in b.workloads:
        if w.weights == "pretrained":
            w.overrides = [*w.overrides, *tiny_overrides]
    return b, run_table1(b, log=lambda *_: None)


def rows_of(report, workload, mode):
    return [r for r in report["rows"] if r["workload"] == workload and r["mode"] == mode]


def test_times_speedups_and_rounds_follow_the_samples(tiny):
    b, report = tiny
    assert report["measured"]
    for w in b.workloads:
        for mode in b.modes:
            cfg = t1.resolve(w).cfg
            ar, *jacobi = rows_of(report, w.name, mode)
            with_k = mode == "eager" and cfg.rollout.candidates     # + the row without K
            assert len(jacobi) == (2 if with_k else 1)
            assert ar["engine"] == "Cached AR" and all(r["status"] is None for r in [ar, *jacobi])
            slots = cfg.rollout.slots or ar["batch"]
            generated = ar["batch"] * ar["new_tokens"]
            assert ar["rounds"] == ar["new_tokens"] * math.ceil(ar["batch"] / slots)
            assert ar["tokens_per_image_round"] == 1.0 and ar["verify_ops"] is None
            for r in (ar, *jacobi):
                ms = np.asarray(r["times_s"]) * 1e3
                assert len(ms) == b.repeats
                assert r["mean_ms"] == float(ms.mean())
                assert r["p95_ms"] == float(np.percentile(ms, 95))
                assert r["speedup"] == ar["mean_ms"] / r["mean_ms"]
                assert r["tokens_per_round"] == generated / r["rounds"]
            assert all(r["rounds"] <= ar["rounds"] and r["verify_ops"] > 0 for r in jacobi)
            exact = ar["decoding"] in ("greedy", "sample")      # one token per key: AR's tokens
            assert all(r["equal_ar"] is (True if exact else None) for r in (ar, *jacobi))


def test_rows_measure_the_run_configs_engine(tiny):
    """The eager HB-SJD row is the run config's engine (W 4, greedy, K 2, hybrid, γ 1): its
    rounds and commit lengths are those of the same engine built here by hand; compiled mode
    drops the candidates (no tree window when compiled)."""
    b, report = tiny
    s = t1.resolve(b.workloads[0])
    model = t1.build_student(b, s)
    labels, prefix = common.make_inputs(model, s.batch, 0.25, "random", b.seed, "cpu")
    res = make_engine("hbsjd", window=4, decoding="greedy", candidates=2, execution="hybrid",
                      gamma=1).generate(model, labels, prefix, s.new_tokens, cfg_scale=2.0,
                                        seed=b.seed)
    no_k = make_engine("hbsjd", window=4, decoding="greedy", execution="hybrid", gamma=1).generate(
        model, labels, prefix, s.new_tokens, cfg_scale=2.0, seed=b.seed)
    _, eager, eager_no_k = rows_of(report, "tiny GKD", "eager")
    _, compiled = rows_of(report, "tiny GKD", "compiled")
    assert [r["engine"] for r in (eager, eager_no_k, compiled)] == ["hbsjd W=4 K=2",
                                                                    "hbsjd W=4", "hbsjd W=4"]
    assert (eager["rounds"], eager["tokens_per_image_round"]) == (res.rounds, res.mean_committed)
    for r in (eager_no_k, compiled):          # compiled: the same rounds as eager without K
        assert (r["rounds"], r["tokens_per_image_round"]) == (no_k.rounds, no_k.mean_committed)
    assert res.mean_committed > 1.0              # some drafts accepted: the rows are not AR's


def test_identical_rollouts_are_measured_once(tiny):
    """GKD and VarKD run configs differ only in the objective: VarKD's rows are GKD's."""
    _, report = tiny
    for mode in ("eager", "compiled"):
        gkd, varkd = rows_of(report, "tiny GKD", mode), rows_of(report, "tiny VarKD", mode)
        drop = ("workload", "same_as")
        assert [{k: v for k, v in r.items() if k not in drop} for r in varkd] == \
            [{k: v for k, v in r.items() if k not in drop} for r in gkd]
        assert {r["same_as"] for r in varkd} == {"tiny GKD"}
    # the sampled digits workload: the verification step's operators do not change with compile
    ops = [rows_of(report, "tiny digits, pretrained", m)[1]["verify_ops"]
           for m in ("eager", "compiled")]
    assert ops[0] == ops[1] > 0
    assert any("pretrained on the spot, 10 steps" in n for n in report["notes"])


def test_no_gpu_prints_every_row_as_a_placeholder(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    b = load_table1_bench("table1_gpu")
    report = run_table1(b, log=lambda *_: None)
    rows = report["rows"]
    with_k = sum(t1.resolve(w).cfg.rollout.candidates > 0 for w in b.workloads)
    assert with_k == 5                           # every greedy workload: the presets' K 4
    assert not report["measured"] and len(rows) == 2 * len(b.workloads) * len(b.modes) + with_k
    assert {r["status"] for r in rows} == {NO_GPU} and not any("mean_ms" in r for r in rows)
    llamagen = [r for r in rows if r["student"] in ("GPT-B", "GPT-L")]
    assert {(r["prefix_len"], r["new_tokens"], r["batch"], r["cfg_scale"]) for r in llamagen} \
        == {(288, 288, 32, 2.0)}
    assert {r["engine"] for r in llamagen} == {"Cached AR", "hbsjd W=16 K=4", "hbsjd W=16"}
    digits = [r for r in rows if r["weights"] == "pretrained"]
    assert {(r["student"], r["prefix_len"], r["new_tokens"]) for r in digits} == \
        {("GPT-digits-S", 128, 128)}
    table = [line for line in format_markdown(report).splitlines() if line.startswith("| ")]
    assert len(table) == 2 + len(rows) and all(NO_GPU in line for line in table[2:])


def test_a_failing_mode_keeps_the_other_rows(monkeypatch, tmp_path):
    """A workload-mode that raises prints `failed: ...` in its rows, the others are measured,
    and `opd bench table1` exits 1 after writing the table."""
    from launch.cli import main
    measure = t1.measure

    def broken(b, s, model, mode):
        if mode == "compiled":
            raise RuntimeError("no graph\nsecond line")
        return measure(b, s, model, mode)
    monkeypatch.setattr(t1, "measure", broken)
    workload = ("workloads=[{name: a, config: tiny, overrides: [model.student=GPT-tiny, "
                "model.grid_size=4, data.batch_size=2, rollout.gamma=1]}]")
    assert main(["bench", "table1", "--config", "table1_cpu_tiny", "--out", str(tmp_path),
                 "repeats=1", "warmup=0", workload]) == 1
    rows = json.loads((tmp_path / "table1.json").read_text())["rows"]
    failed = "failed: RuntimeError: no graph"
    assert [(r["mode"], r["status"]) for r in rows] == [
        ("eager", None), ("eager", None), ("compiled", failed), ("compiled", failed)]
    assert "failed: RuntimeError: no graph" in (tmp_path / "table1.md").read_text()


def test_bad_presets_name_the_key():
    with pytest.raises(t1.ConfigError, match="modes"):
        load_table1_bench("table1_cpu_tiny", dict(modes=["fast"]))
    with pytest.raises(t1.ConfigError, match="own name"):
        load_table1_bench("table1_cpu_tiny", dict(workloads=[{"name": "a"}, {"name": "a"}]))
