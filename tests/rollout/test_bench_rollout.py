"""`opd bench rollout` (launch/bench/rollout.py) and `opd calibrate`: presets, the sweep, the
table, the figures and the CLI wiring, on GPT-tiny."""
import json
import statistics

import pytest
import yaml

from launch.bench.rollout import (VARIANTS, auto_lines, format_table, load_bench,
                                  resolve_bench_preset, run_bench, save_figures)
from opd.config.files import CONFIG_DIR
from opd.config.loader import ConfigError

TINY = dict(model="GPT-tiny", dtype="float64", prefix="random", prefix_ratio=0.25,
            batch_sizes=[3], windows=[2, 5], decodings=["greedy", "sample"], repeats=2,
            warmup=0, calibration_repeats=1, threads=1, random_init_std=0.5)


@pytest.fixture
def tiny_preset(tmp_path):
    path = tmp_path / "tiny_bench.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


@pytest.mark.parametrize("name", ["digits", "llamagen_b_256", "llamagen_b_576"])
def test_shipped_presets_load(name):
    b = load_bench(name)
    assert resolve_bench_preset(name) == CONFIG_DIR / "bench" / f"{name}.yaml"
    if name == "digits":
        assert b.model == "GPT-digits-S" and b.batch_sizes == [1, 4, 16]
        assert b.windows == [2, 4, 8, 16] and b.device == "cpu"
    else:
        assert b.model == "GPT-B" and b.device == "cuda" and b.dtype == "bfloat16"
        assert b.overrides["grid_size"] == (16 if name.endswith("256") else 24)


@pytest.mark.parametrize("override,word", [
    (dict(batch_size=[1]), "unknown bench preset key 'batch_size'.*did you mean 'batch_sizes'"),
    (dict(windows=[0]), "windows"),
    (dict(engines=["hbsjd-fast"]), "engines"),
    (dict(decodings="greedy"), "decodings"),
    (dict(dtype="int8"), "dtype"),
    (dict(prefix_ratio=1.0), "prefix_ratio"),
    (dict(gamma="auto"), "gamma"),
    (dict(repeats=0), "repeats"),
    (dict(device="tpu"), "device"),
    (dict(refreshes=["maximal"]), "refreshes"),
    (dict(slots=0), "slots"),
    (dict(candidates=[1]), "candidates"),
    (dict(candidates=[]), "candidates"),
])
def test_bad_presets_name_the_key(tiny_preset, override, word):
    with pytest.raises(ConfigError, match=word):
        load_bench(tiny_preset, override)


def test_missing_preset():
    with pytest.raises(ConfigError, match="not found; available: .*digits"):
        load_bench("no_such_bench")


def test_sweep_table_and_figures(tiny_preset, tmp_path):
    report = run_bench(load_bench(tiny_preset), log=lambda *_: None)
    rows = report["rows"]
    assert len(rows) == 2 * (1 + len(VARIANTS) * 2)          # decodings x (AR + variants x W)
    for r in rows:
        assert r["batch"] == 3 and r["rounds"] >= 1 and r["latency_ms"] > 0
        assert r["p95_ms"] >= r["latency_ms"] * 0.5
        if r["verification"] in ("greedy", "sample"):      # one token per key
            assert r["equal_ar"] is True, r
        else:
            assert r["equal_ar"] is None
        if r["engine"] == "cached_ar":
            assert r["speedup"] == pytest.approx(1.0) and r["rounds"] == 12
            assert r["verify_ops"] is None and r["verify_ms"] is None
        else:                    # one round's cost: verification step against the forward
            assert r["verify_ms"] > 0 and r["forward_ms"] > 0
    ops = {(r["engine"], r["verification"], r["W"]): r["verify_ops"] for r in rows
           if r["engine"] != "cached_ar"}
    for d in ("greedy", "sample"):       # Full execution of the same plan, at any window
        independent = {ops[e, d, W] for e in VARIANTS if e != "sjd_sync" for W in (2, 5)}
        assert len(independent) == 1
        assert ops["sjd_sync", d, 2] > independent.pop()        # the batch minimum's operators
    assert ops["hbsjd-full", "sample", 2] > ops["hbsjd-full", "greedy", 2]   # the noise
    hybrid = [r for r in rows if r["engine"] == "hbsjd-hybrid"]
    assert all(isinstance(r["gamma"], int) for r in hybrid)
    assert {(c["batch"], c["W"]) for c in report["curves"]} == {(3, 2), (3, 5)}
    table = format_table(rows)
    assert "speedup" in table and "hbsjd-hybrid" in table and "best at batch 3 (greedy)" in table
    assert "ops/rnd" in table.splitlines()[0]
    paths = save_figures(report, tmp_path / "figs")
    assert [p.name for p in paths] == ["progress.png", "verifier_latency.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    json.dumps(report)                                          # serialisable


def test_cli_bench_and_calibrate(tiny_preset, tmp_path, capsys):
    from launch.cli import main
    out, js = tmp_path / "figs", tmp_path / "report.json"
    assert main(["bench", "rollout", "--config", str(tiny_preset), "--json", str(js),
                 "--out", str(out), "windows=[3]", "decodings=[greedy]", "repeats=1"]) == 0
    text = capsys.readouterr().out
    assert "cached_ar" in text and "hbsjd-compact" in text
    report = json.loads(js.read_text())
    assert {r["W"] for r in report["rows"]} == {None, 3}
    assert (out / "progress.png").is_file() and (out / "verifier_latency.png").is_file()

    cal = tmp_path / "cal.json"
    assert main(["calibrate", "--model", "GPT-tiny", "--batch", "3", "--window", "4",
                 "--cfg-scale", "2.0", "--device", "cpu", "--repeats", "1", "--threads", "1",
                 "--out", str(cal)]) == 0
    entry = json.loads(cal.read_text())["entries"][0]
    assert entry["batch"] == 3 and entry["W"] == 4 and entry["cfg"] is True
    assert "gamma = " in capsys.readouterr().out
    assert main(["calibrate", "--config", "tiny", "rollout.window=3", "--device", "cpu",
                 "--repeats", "1", "--threads", "1", "--out", str(cal)]) == 0
    entries = json.loads(cal.read_text())["entries"]   # the run config's student, every batch
    assert [e["preset"] for e in entries] == ["GPT-tiny", "GPT-digits-S", "GPT-digits-S"]
    assert [(e["batch"], e["W"], e["cfg"]) for e in entries[1:]] == [(4, 3, False), (8, 3, False)]
    capsys.readouterr()
    assert main(["bench", "rollout", "--config", str(tiny_preset), "nonsense=1"]) == 2
    assert "unknown bench preset key 'nonsense'" in capsys.readouterr().err


def test_slots_and_sampling_rules_side_by_side(tiny_preset, tmp_path):
    """A 7-image job through 3 rows: Cached AR takes 3 batches of 12 rounds; the Jacobi rows
    report their rounds against those; the two sampling rules run side by side, speculative
    rows once per refresh rule; the keyed rule's tokens are Cached AR's."""
    b = load_bench(tiny_preset, dict(batch_sizes=[7], windows=[4], slots=3,
                                     decodings=["sample", "speculative"],
                                     engines=["hbsjd-hybrid"], refreshes=["coupled", "resample"]))
    rows = run_bench(b, log=lambda *_: None)["rows"]
    assert [(r["engine"], r["verification"], r["refresh"]) for r in rows] == [
        ("cached_ar", "sample", None), ("cached_ar", "speculative", None),
        ("hbsjd-hybrid", "sample", None), ("hbsjd-hybrid", "speculative", "coupled"),
        ("hbsjd-hybrid", "speculative", "resample")]
    for r in rows:
        assert r["slots"] == 3
        if r["engine"] == "cached_ar":
            assert r["rounds"] == 3 * 12 and r["round_ratio"] == 1.0 and r["prefills"] == 2
        else:
            assert r["round_ratio"] == r["rounds"] / 36 and r["prefills"] <= 4
    assert rows[2]["equal_ar"] is True and rows[3]["equal_ar"] is None
    assert "resample" in format_table(rows) and "speculative" in format_table(rows)
    ar = {r["verification"]: r["times_ms"] for r in rows if r["engine"] == "cached_ar"}
    for r in rows:      # rollout time against Cached AR's, same decoding, paired by round
        assert len(r["times_ms"]) == b.repeats and r["latency_ms"] == pytest.approx(
            sum(r["times_ms"]) / b.repeats)
        assert r["time_ratio"] == pytest.approx(statistics.median(
            t / a for t, a in zip(r["times_ms"], ar[r["verification"]])))
        assert r["time_ratio"] == pytest.approx(1 / r["speedup"])
    assert "time/AR" in format_table(rows).splitlines()[0]


def test_pretrain_overrides_reach_the_pretrained_student(tiny_preset, monkeypatch):
    """checkpoint: pretrained with pretrain_overrides (the 16x16 student) builds the run
    config's student with them; overrides without them, or them without pretrained, are
    named."""
    import launch.bench.common
    from launch.bench.rollout import build_model
    seen = {}
    monkeypatch.setattr(launch.bench.common, "build_model", lambda *a, **kw: seen.update(kw))
    sixteen = ["model.grid_size=16", "data.data_dir=data/digits16"]
    build_model(load_bench(tiny_preset, dict(checkpoint="pretrained", overrides={"grid_size": 16},
                                             pretrain_overrides=sixteen)))
    assert seen["run_overrides"] == sixteen and seen["run_config"] is None
    with pytest.raises(ConfigError, match="overrides=.*set pretrain_overrides too"):
        load_bench(tiny_preset, dict(checkpoint="pretrained", overrides={"grid_size": 16}))
    with pytest.raises(ConfigError, match="pretrain_overrides=.*checkpoint: pretrained only"):
        load_bench(tiny_preset, dict(pretrain_overrides=sixteen))


def test_candidate_rows_side_by_side(tiny_preset):
    """Greedy and sampled rows of the independent engines come once per K; sjd_sync rows once,
    without candidates; every row equals Cached AR's tokens."""
    b = load_bench(tiny_preset, dict(batch_sizes=[4], windows=[4], candidates=[0, 3],
                                     engines=["sjd_sync", "hbsjd-full"]))
    rows = run_bench(b, log=lambda *_: None)["rows"]
    assert [(r["engine"], r["verification"], r["candidates"]) for r in rows] == [
        ("cached_ar", "greedy", None), ("cached_ar", "sample", None),
        ("sjd_sync", "greedy", None), ("hbsjd-full", "greedy", 0), ("hbsjd-full", "greedy", 3),
        ("sjd_sync", "sample", None), ("hbsjd-full", "sample", 0), ("hbsjd-full", "sample", 3)]
    assert all(r["equal_ar"] for r in rows if r["engine"] != "cached_ar")
    assert rows[-1]["verify_ops"] > rows[-2]["verify_ops"]          # the tree costs operators
    assert " K" in format_table(rows).splitlines()[0]


def test_auto_is_priced_against_the_fastest_call_by_call():
    """auto's line: its calls over each fixed window's and Cached AR's of the same round, the
    median of those ratios (W 8: 1.2, 1.0, 1.05; its copy, Cached AR and W 4 read lower); the
    fastest is the one auto reads slowest against; another engine's window (hbsjd-full W 16)
    is not auto's; W 8 run twice gives the floor (1.0, 1.1, 1.1)."""
    def row(W, times, engine="hbsjd-hybrid"):
        return dict(batch=8, verification="sample", engine=engine, W=W, times_ms=times)
    rows = [row(None, [10.0, 20.0, 10.0], "cached_ar"), row(4, [8.0, 16.0, 8.0]),
            row(8, [5.0, 12.0, 6.0]), row(8, [5.0, 13.2, 6.6]),
            row("auto", [6.0, 12.0, 6.3]), row(16, [4.0, 8.0, 4.0], "hbsjd-full")]
    assert auto_lines(rows) == ["auto at batch 8 (sample): 1.050 of the fastest (W 8), "
                                "0.600 of Cached AR; floor (a window's copy over it) 1.100"]
