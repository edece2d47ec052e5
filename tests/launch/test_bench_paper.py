"""`opd bench paper` (launch/bench/paper.py), `opd bench step` (launch/bench/step.py) and
scripts/gpu_bench.sh: presets, reproducibility of rounds and commit lengths, the byte count of
a verifier round, checkpoints, and the suite's CPU code path."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from opd.run import checkpoints as ckpt
from launch.bench.common import interleave
from launch.bench.paper import ABLATIONS, Context, load_paper_bench, run_paper
from launch.bench.paper_measure import AR, Variant, round_floor, verifier_bytes
from launch.bench.paper_report import format_markdown, save_plots
from opd.config.schema import load_config
from opd.config.files import CONFIG_DIR
from opd.config.loader import ConfigError
from rollout import make_engine

ROOT = CONFIG_DIR.parent
PNG = b"\x89PNG\r\n\x1a\n"
EXACT = ("rounds_each", "image_rounds", "mean_committed", "accepted", "rejected",
         "committed_digest", "prefix_len", "new_tokens", "equal_ar")


@pytest.fixture(scope="module")
def tiny_runs():
    """The cpu_tiny preset run twice in one process (a few seconds each)."""
    b = load_paper_bench("cpu_tiny")
    return [run_paper(load_paper_bench("cpu_tiny"), log=lambda *_: None) for _ in range(2)], b


def test_shipped_presets_load():
    d = load_paper_bench("digits_paper")
    assert d.checkpoint == "pretrained" and d.device == "cpu" and d.threads == 1
    assert list(d.ablations) == list(ABLATIONS)                # all nine, the paper's order
    assert d.ablations["batch"]["values"] == [8, 16, 32, 64]
    assert d.ablations["prefix_ratio"]["values"] == [0.75, 0.5, 0.35, 0.2]
    assert d.ablations["window"]["values"] == [4, 8, 16, 24]
    assert d.ablations["execution"]["workloads"] == 2 and d.ablations["engines"]["repeats"] == 5
    g = load_paper_bench("gpu_llamagen")
    assert (g.model, g.overrides, g.device, g.dtype) == ("GPT-B", {"grid_size": 24}, "cuda",
                                                         "bfloat16")
    assert (g.batch, g.cfg_scale, g.bandwidth_gbs, g.checkpoint) == (32, 2.0, 4800, None)
    assert "checkpoints" not in g.ablations and g.budget_s > 0
    t = load_paper_bench("cpu_tiny")
    assert t.device == "cpu" and t.model == "GPT-tiny"


@pytest.mark.parametrize("override,word", [
    (dict(ablations={"window": {"valuez": [2]}}), "ablations.window.valuez.*did you mean 'values'"),
    (dict(ablations=["engins"]), "ablations.engins.*did you mean 'engines'"),
    (dict(ablations={"batch": {"values": []}}), "ablations.batch.values"),
    (dict(ablations={"execution": {"repeats": 0}}), "ablations.execution.repeats"),
    (dict(batch=0), "batch"),
    (dict(decoding="beam"), "decoding"),
    (dict(gamma="auto"), "gamma"),
    (dict(bandwidth_gbs=-1), "bandwidth_gbs"),
    (dict(windows=[4]), "unknown bench preset key 'windows'"),
])
def test_bad_presets_name_the_key(override, word):
    with pytest.raises(ConfigError, match=word):
        load_paper_bench("cpu_tiny", override)


def test_bad_ablation_values_name_the_key():
    with pytest.raises(ConfigError, match="ablations.window.values"):
        run_paper(load_paper_bench("cpu_tiny", dict(ablations={"window": {"values": [0]}})),
                  log=lambda *_: None)
    with pytest.raises(ConfigError, match="ablations.checkpoints.values"):
        run_paper(load_paper_bench("cpu_tiny", dict(ablations=["checkpoints"])),
                  log=lambda *_: None)


def test_interleave_rotates_and_discards_warmup():
    calls = []
    fns = [lambda i=i: (calls.append(i), (float(i), i))[1] for i in range(3)]
    out = interleave(fns, repeats=3, warmup=1)
    assert calls == [0, 1, 2,  0, 1, 2,  1, 2, 0,  2, 0, 1]
    assert [[p for _, p in s] for s in out] == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]


def test_two_runs_agree_on_rounds_and_commit_lengths(tiny_runs):
    (a, b), bench = tiny_runs
    assert list(a["ablations"]) == list(bench.ablations)
    for key in a["ablations"]:
        ra, rb = a["ablations"][key]["rows"], b["ablations"][key]["rows"]
        assert [r["variant"] for r in ra] == [r["variant"] for r in rb]
        for x, y in zip(ra, rb):
            assert {k: x[k] for k in EXACT} == {k: y[k] for k in EXACT}, (key, x["variant"])


def test_tiny_rows_hold_exact_numbers(tiny_runs):
    (report, _), bench = tiny_runs
    abl = report["ablations"]
    for key, a in abl.items():
        for r in a["rows"]:
            assert r["n"] == a["options"]["repeats"] * a["options"]["workloads"]
            assert r["min_ms"] <= r["mean_ms"] <= r["max_ms"]
            if r["engine"] == AR:              # one token per image per round
                assert r["rounds"] == r["new_tokens"] and r["mean_committed"] == 1.0
            elif r["decoding"] == "greedy" and r["equal_ar"] is not None:
                assert r["equal_ar"] is True, (key, r["variant"])       # lossless
            if r["baseline"]:
                assert r["speedup_min"] <= r["speedup_max"]
    rows = {r["variant"]: r for r in abl["engines"]["rows"]}
    assert set(rows) == {"Cached AR", "Batch-Synchronous SJD", "Independent Batched SJD",
                         "HB-SJD (Hybrid)"}
    # execution mode never changes what is committed (invariant 3)
    ex = abl["execution"]["rows"]
    assert len({r["committed_digest"] for r in ex}) == 1
    assert [r["execution"].split()[0] for r in ex] == ["full", "compact", "hybrid"]
    assert ex[1]["compact_rounds"] > 0 and ex[0]["compact_rounds"] == 0
    # the independent engines share one trajectory per image; Hybrid equals Full
    indep, hybrid = rows["Independent Batched SJD"], rows["HB-SJD (Hybrid)"]
    assert indep["image_rounds"] == hybrid["image_rounds"]
    pr = {r["variant"]: r for r in abl["prefix_ratio"]["rows"]}
    assert [pr[f"Cached AR r={x}"]["new_tokens"] for x in (0.75, 0.5, 0.25)] == [4, 8, 12]
    assert [r["batch"] for r in abl["batch"]["rows"]] == [2, 2, 4, 4]
    assert [r["W"] for r in abl["window"]["rows"]] == [None, 2, 4, 8]
    assert [r["H"] for r in abl["history"]["rows"]] == [None, 1, 4, 6]
    gam = abl["gamma"]["rows"]
    assert gam[0]["execution"] == "full" and all(r["gamma"] >= 1 for r in gam[1:])
    ver = {r["variant"]: r for r in abl["verification"]["rows"]}
    assert ver["HB-SJD sample"]["rejection_rate"] is not None
    assert ver["HB-SJD sample"]["equal_ar"] is None
    json.dumps(report)


def test_markdown_and_plots(tiny_runs, tmp_path):
    (report, _), _ = tiny_runs
    text = format_markdown(report)
    for a in report["ablations"].values():
        assert f"## {a['number']}. {a['title']}" in text
    for figure in ("176 rounds, 3275 ms, 1.216×", "2784 ms, P95 3969 ms", "8/16/32/64: 1.403",
                   "1.613×", "2912 ms, 1.384× (fastest)", "memory-bandwidth floor (20 GB/s)"):
        assert figure in text
    paths = save_plots(report, tmp_path)
    assert len(paths) == len(report["ablations"])
    assert all(p.read_bytes()[:8] == PNG for p in paths)


def test_round_floor_counts_bytes():
    """Bytes of a Cached AR round by hand: weights + 2 (CFG) x B rows x (P + r + 1) positions."""
    b = load_paper_bench("cpu_tiny")
    c = Context(b)
    model = c.models["main"]
    B, P = 3, 5
    labels, prefix = torch.arange(B) % model.num_classes, torch.ones(B, P, dtype=torch.long)
    N = model.block_size - P
    res = make_engine("cached_ar").generate(model, labels, prefix, N, cfg_scale=2.0)
    floor = round_floor(model, res, Variant("ar", AR, {"decoding": "greedy"}, B, 0.3), True, 20)
    a = model.args
    weights = sum(p.numel() for n, p in model.named_parameters()
                  if not n.startswith(("tok_embeddings", "cls_embedding"))) * 8     # float64
    kv = 2 * a.n_layer * a.kv_heads * a.head_dim * 8
    assert verifier_bytes(model) == (weights, kv)
    need = [weights + kv * 2 * B * (P + r + 1) for r in range(1, N)]
    assert floor["need_mb"] * 1e6 == pytest.approx(sum(need) / len(need))
    assert floor["reads_mb"] == pytest.approx(floor["need_mb"])       # AR reads what it needs
    assert floor["floor_ms"] == pytest.approx(sum(need) / len(need) / 20e9 * 1e3)
    for execution in ("full", "compact"):
        v = Variant("j", "hbsjd", {"decoding": "greedy", "window": 4, "history_offset": 4,
                                  "execution": execution},
                    B, 0.3)
        res = make_engine("hbsjd", window=4, execution=execution).generate(
            model, labels, prefix, N, cfg_scale=2.0)
        f = round_floor(model, res, v, True, 20)
        assert f["reads_mb"] >= f["need_mb"] > weights / 1e6


def test_checkpoint_files_and_run_dirs(tmp_path):
    """A checkpoints ablation over two files: each row runs its own weights."""
    states = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        from opd.models import create_model
        m = create_model("GPT-tiny")
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.5)
        states.append({k: v.double() for k, v in m.state_dict().items()})
    f = tmp_path / "a.pt"
    torch.save({"model": states[0]}, f)
    tmp = ckpt.begin(tmp_path / "run", 2)           # a run's checkpoint (opd/run/checkpoints.py)
    torch.save({"model": states[1]}, tmp / ckpt.STUDENT_FILE)
    run_ckpt = ckpt.commit(tmp, {"step": 2, "mode": "reference"})
    b = load_paper_bench("cpu_tiny", dict(
        repeats=1, warmup=0, gamma=2,
        ablations={"checkpoints": {"values": [str(f), str(run_ckpt)]}}))
    c = Context(b)
    assert torch.equal(c.model(str(f)).output.weight, states[0]["output.weight"])
    assert torch.equal(c.model(str(run_ckpt)).output.weight, states[1]["output.weight"])
    rows = run_paper(b, log=lambda *_: None)["ablations"]["checkpoints"]["rows"]
    assert [r["variant"] for r in rows] == ["Cached AR a", "HB-SJD a", "Cached AR step_000002",
                                            "HB-SJD step_000002"]
    assert [r["model"] for r in rows] == [str(f), str(f), str(run_ckpt), str(run_ckpt)]
    assert all(r["equal_ar"] for r in rows if r["engine"] == "hbsjd")
    assert rows[1]["paper"] == "—"                             # 2 values: no early/middle/late


def test_pretrained_snapshots(tiny_overrides):
    """checkpoint: pretrained with values null: the student pretrained 1/5, 1/2 and all of the
    run config's student steps (tiny: 2, 5, 10), each cached, each its own weights."""
    b = load_paper_bench("digits_paper", dict(
        pretrain_config="tiny", pretrain_overrides=list(tiny_overrides), overrides={}, batch=2,
        prefix_ratio=0.9, repeats=1, warmup=0, gamma=2, ablations=["checkpoints"]))
    report = run_paper(b, log=lambda *_: None)
    rows = report["ablations"]["checkpoints"]["rows"]
    assert [r["model"] for r in rows[::2]] == ["pretrain:2", "pretrain:5", "pretrain:10"]
    assert [r["paper"] for r in rows[1::2]] == ["1.53× (2K steps)", "1.5× (12K steps)",
                                                "1.483× (22K steps)"]
    assert all(r["equal_ar"] for r in rows[1::2])
    assert rows[0]["new_tokens"] == 6                          # 64 tokens, prefix ratio 0.9


def test_gpu_script_runs_the_suite_on_cpu(tmp_path):
    """scripts/gpu_bench.sh, the same path as on the GPU, with the CPU tiny presets: Table 1
    (table1_cpu_tiny) and the paper's ablations (PAPER=cpu_tiny)."""
    out = tmp_path / "suite"
    env = dict(os.environ, DEVICE="cpu", PAPER="cpu_tiny", STUDENTS="GPT-tiny",
               PAPER_ARGS="repeats=1 warmup=0 ablations=[engines,execution]",
               PYTHON=sys.executable, OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh"), str(out),
                           "repeats=1", "modes=[eager]"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    table1 = json.loads((out / "table1.json").read_text())
    assert table1["config"]["modes"] == ["eager"] and table1["config"]["repeats"] == 1
    assert len(table1["rows"]) == 2 * 3 + 2 and all(r["status"] is None for r in table1["rows"])
    report = json.loads((out / "GPT-tiny" / "paper.json").read_text())
    assert list(report["ablations"]) == ["engines", "execution"]
    assert report["config"]["model"] == "GPT-tiny"
    assert (out / "GPT-tiny" / "1_engines.png").read_bytes()[:8] == PNG
    summary = (out / "summary.md").read_text()
    assert "| tiny GKD | GPT-tiny |" in summary
    assert "## 1. Cached AR vs Batch-Synchronous SJD" in summary and "floor" in summary
    assert "suite done" in (out / "environment.txt").read_text()


def test_bench_step_reference(tiny_overrides, tmp_path):
    """`opd bench step` in mode=reference, eager and compiled side by side (backend "eager":
    the compiled path without code generation): every part of a step is timed; Cached AR
    commits one token per round; compile changes no rollout statistic; the markdown has a row
    per (compile, engine) with the rollout time over the same compile's Cached AR."""
    from launch.cli import main
    out = tmp_path / "step"
    code = main(["bench", "step", "--config", "tiny", "--modes", "reference", "--steps", "2",
                 "--warmup-steps", "1", "--compile", "false,eager", "--out", str(out),
                 *tiny_overrides, "rollout.gamma=2", "data.prefix_ratios=[]"])
    assert code == 0
    report = json.loads((out / "step.json").read_text())
    assert report["compiles"] == [False, "eager"]
    res = {(r["compile"], r["engine"]): r for r in report["results"]}
    assert list(res) == [(False, "cached_ar"), (False, "hbsjd"), ("eager", "cached_ar"),
                         ("eager", "hbsjd")]
    cfg = load_config("tiny", tiny_overrides)
    N = 64 - round(cfg.data.prefix_ratio * 64)
    for r in res.values():
        assert r["steps_measured"] == 2 and len(r["rows"]) == 2
        assert [row["step"] for row in r["rows"]] == [1, 2]
        for part in ("rollout_s", "teacher_s", "learner_s", "step_s"):
            assert r[part]["mean"] > 0
        assert r["other_s"] == pytest.approx(0, abs=1e-9)     # reference: step = sum of parts
        assert not r["weight_sync_measured"]
    for c in (False, "eager"):
        assert res[c, "cached_ar"]["rounds"] == N and res[c, "cached_ar"]["mean_committed"] == 1.0
        assert res[c, "hbsjd"]["rounds"] <= N
        base, hb = ([row["rollout_s"] for row in res[c, e]["rows"]] for e in ("cached_ar", "hbsjd"))
        speed = res[c, "hbsjd"]["rollout_speedup"]           # the ratio of the measured means
        assert speed["speedup"] == pytest.approx(np.mean(base) / np.mean(hb), rel=1e-12)
        assert speed["speedup_min"] == pytest.approx(min(b / h for b, h in zip(base, hb)))
        assert res[c, "cached_ar"]["rollout_speedup"] is None
        assert res[c, "hbsjd"]["baseline"] == "cached_ar"
    assert all(len(r["first_rollout_s"]) == 1 for r in res.values())   # one run each
    for key in ("rounds", "mean_committed", "generated_tokens"):     # same rollouts compiled
        assert res[False, "hbsjd"][key] == res["eager", "hbsjd"][key]
    text = (out / "step.md").read_text()
    assert "## mode=reference" in text and "0 (in process)" in text
    speedup = res["eager", "hbsjd"]["rollout_speedup"]["speedup"]
    assert "| hbsjd | compiled (eager) |" in text and f"| {1 / speedup:.3f} |" in text
    assert (out / "step.png").read_bytes()[:8] == PNG


def test_bench_step_bad_modes_name_the_option(tmp_path):
    from launch.cli import main
    assert main(["bench", "step", "--modes", "reference,gpu", "--out", str(tmp_path)]) == 2
    assert main(["bench", "step", "--compile", "false,fast", "--out", str(tmp_path)]) == 2
    for bad in ("hbsjd:0", "cached_ar:4", "sjd_sync:auto", "hbsjd:x", "hbsjd:4@exact"):
        assert main(["bench", "step", "--engines", bad, "--out", str(tmp_path)]) == 2, bad


def test_bench_step_engine_arms_set_the_window_and_decoding():
    from launch.bench.step import check_step_args, engine_overrides
    engines = check_step_args("cached_ar,hbsjd:4,hbsjd:auto,sjd_independent:16,"
                              "hbsjd:auto@speculative,cached_ar@speculative", "reference",
                              1, 0, 1)[0]
    assert [engine_overrides(e) for e in engines] == [
        ["rollout.engine=cached_ar"], ["rollout.engine=hbsjd", "rollout.window=4"],
        ["rollout.engine=hbsjd", "rollout.window=auto"],
        ["rollout.engine=sjd_independent", "rollout.window=16"],
        ["rollout.engine=hbsjd", "rollout.window=auto", "rollout.decoding=speculative"],
        ["rollout.engine=cached_ar", "rollout.decoding=speculative"]]


@pytest.mark.slow   # the harness: test_bench_step_reference; Ray rows' weight bytes: test_driver_payloads
def test_bench_step_ray(ray_session, tiny_overrides, tmp_path):
    """mode=ray: the Ray pipeline's rows carry a measured weight sync; both engines run."""
    from launch.cli import main
    out = tmp_path / "step"
    code = main(["bench", "step", "--config", "tiny", "--modes", "ray", "--steps", "1",
                 "--warmup-steps", "1", "--out", str(out), *tiny_overrides, "rollout.gamma=2",
                 "rollout.num_cpus=0.25", "teacher.num_cpus=0.25", "learner.num_cpus=0.5"])
    assert code == 0
    report = json.loads((out / "step.json").read_text())
    res = {r["engine"]: r for r in report["results"]}
    assert set(res) == {"cached_ar", "hbsjd"}
    for r in res.values():
        assert r["mode"] == "ray" and r["weight_sync_measured"]
        assert r["rows"][0]["weight_bytes"] > 0 and r["rollout_s"]["mean"] > 0
    assert res["cached_ar"]["mean_committed"] == 1.0
