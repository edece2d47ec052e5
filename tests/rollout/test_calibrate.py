"""gamma calibration: curves, the gamma rule, the JSON file and gamma='auto'."""
import copy
import json

import pytest
import torch

from rollout import make_engine
from rollout.calibrate import (calibrate, choose_gamma, default_active_counts, load_gamma,
                               measure_verifier_latencies, model_signature, save_calibration)


@pytest.mark.parametrize("full,compact,gamma", [
    ([5, 5, 5, 5], [1, 2, 6, 7], 3),        # Compact faster below 3 active images
    ([5, 5, 5, 5], [6, 6, 6, 6], 1),        # never Compact
    ([5, 5, 5, 5], [1, 2, 3, 4], 5),        # always Compact (gamma = B + 1)
    ([5, 5, 5, 5], [1, 6, 4, 6], 4),        # a noisy dip at 3: only a Full-wins tail counts
    ([5, 5, 5, 5], [1, 5, 6, 7], 2),        # a tie goes to Full
])
def test_choose_gamma(full, compact, gamma):
    assert choose_gamma([1, 2, 3, 4], full, compact) == gamma


def test_choose_gamma_sorts_by_active_count():
    assert choose_gamma([4, 1, 3, 2], [5] * 4, [7, 1, 6, 2]) == 3


def test_default_active_counts():
    assert default_active_counts(5) == [1, 2, 3, 4, 5]
    spread = default_active_counts(64)
    assert spread[0] == 1 and spread[-1] == 64 and len(spread) == 24


@pytest.mark.parametrize("cfg", [False, True])
def test_measure_gives_positive_curves(tiny, cfg):
    curves = measure_verifier_latencies(tiny(0), 4, [3], cfg=cfg, repeats=2, warmup=1)[3]
    assert curves["active"] == [1, 2, 3, 4]
    assert all(t > 0 for t in curves["full_s"] + curves["compact_s"])
    with pytest.raises(ValueError, match="active counts"):
        measure_verifier_latencies(tiny(0), 4, [3], active=[5])


def test_calibration_file_round_trip_and_gamma_auto(tiny, batch, tmp_path):
    model = tiny(0)
    path = tmp_path / "cal" / "calibration.json"
    entry = calibrate(model, 4, 5, cfg=True, preset="GPT-tiny", repeats=1, warmup=0)
    assert entry["model"] == model_signature(model) and 1 <= entry["gamma"] <= 5
    save_calibration(path, entry)
    save_calibration(path, {**entry, "gamma": 3})                    # same key: replaced
    save_calibration(path, {**entry, "W": 8, "gamma": 2})
    data = json.loads(path.read_text())
    assert data["format"] == 1 and len(data["entries"]) == 2
    assert load_gamma(path, model, 4, 5, True) == 3
    assert load_gamma(path, model, 4, 8, True) == 2

    engine = make_engine("hbsjd", window=5, gamma="auto", calibration=str(path))
    labels, prefix = batch(model, 4, 0)
    res = engine.generate(model, labels, prefix, 16, cfg_scale=2.0)
    ref = make_engine("hbsjd", window=5, gamma=3).generate(model, labels, prefix, 16, cfg_scale=2.0)
    assert torch.equal(res.tokens, ref.tokens) and res.modes == ref.modes
    with pytest.raises(ValueError, match=r"no calibration .* batch=4 W=5 cfg=False.*opd calibrate"):
        engine.generate(model, labels, prefix, 16)                    # no CFG entry
    with pytest.raises(ValueError, match="does not exist"):
        make_engine("hbsjd", gamma="auto", calibration=str(tmp_path / "x.json")).generate(
            model, labels, prefix, 16)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_gamma(tmp_path / "bad.json", model, 4, 5, True)


def test_signature_separates_models(tiny):
    assert model_signature(tiny(0)) == model_signature(tiny(1))      # same shape and dtype
    assert model_signature(tiny(0)) != model_signature(tiny(0, vocab_size=5))
    assert model_signature(tiny(0)).endswith(f"float64-cpu-th{torch.get_num_threads()}")
    model = copy.deepcopy(tiny(0))               # tiny's models are shared: change a copy
    before = model_signature(model)              # its parameter count is kept per model...
    model.float()
    assert model_signature(model) == before.replace("float64", "float32")   # ...its dtype not


def test_signature_separates_thread_counts(tiny):
    """A CPU table is measured at the process's torch threads: a one-thread Ray worker does
    not read the table of a two-thread driver."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = model_signature(tiny(0))
        torch.set_num_threads(2)
        two = model_signature(tiny(0))
    finally:
        torch.set_num_threads(threads)
    assert one.endswith("-cpu-th1") and two.endswith("-cpu-th2")


def test_auto_gamma_calibrates_a_missing_entry_once(tiny, tmp_path):
    model, path = tiny(0), tmp_path / "cal.json"
    labels, prefix = torch.tensor([0, 1, 2]), torch.zeros(3, 2, dtype=torch.long)
    strict = make_engine("hbsjd", window=4, gamma="auto", calibration=str(path))
    with pytest.raises(ValueError, match="does not exist"):
        strict.generate(model, labels, prefix, 6)
    engine = make_engine("hbsjd", window=4, gamma="auto", calibration=str(path),
                         calibrate_missing=True)
    out = engine.generate(model, labels, prefix, 6)
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 1 and entries[0]["batch"] == 3 and entries[0]["W"] == 4
    assert load_gamma(path, model, 3, 4, False) == entries[0]["gamma"]
    ref = make_engine("cached_ar").generate(model, labels, prefix, 6)
    assert torch.equal(out.tokens, ref.tokens)
    strict.generate(model, labels, prefix, 6)                 # the entry now exists
    assert len(json.loads(path.read_text())["entries"]) == 1


def test_one_calibration_file_under_opd_cache(tmp_path, monkeypatch):
    from rollout.calibrate import cache_root, calibration_file, calibration_path
    monkeypatch.setenv("OPD_CACHE", str(tmp_path / "c"))
    assert calibration_file() == tmp_path / "c" / "calibration.json"
    assert cache_root() == tmp_path / "c"
    assert calibration_path({}) == calibration_file()                  # the engines' default
    assert calibration_path({"calibration": "x.json"}).name == "x.json"
    monkeypatch.delenv("OPD_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert calibration_file() == tmp_path / "home" / ".cache" / "opd" / "calibration.json"


def counting_measure(monkeypatch, log: list):
    """Make rollout.calibrate's measurement append its batch to `log`."""
    import rollout.calibrate as rc
    measure = rc.measure_verifier_latencies

    def counted(model, batch, windows, **kw):
        log.append(batch)
        return measure(model, batch, windows, **kw)
    monkeypatch.setattr(rc, "measure_verifier_latencies", counted)


def test_ensure_calibration_measures_only_missing_entries(tiny, tmp_path, monkeypatch):
    from rollout.calibrate import ensure_calibration, read_calibration
    model, path, measured = tiny(0), tmp_path / "cal.json", []
    counting_measure(monkeypatch, measured)
    first = ensure_calibration(model, [3, 2, 3], 4, path=path, repeats=1, warmup=0)
    assert measured == [2, 3] and sorted(first) == [2, 3]
    again = ensure_calibration(model, [2, 3, 4], 4, path=path, repeats=1, warmup=0)
    assert measured == [2, 3, 4]                                  # only batch 4 was missing
    assert again[2] == first[2] and again[3] == first[3]
    assert [(e["batch"], e["W"]) for e in read_calibration(path)] == [(2, 4), (3, 4), (4, 4)]
    engine = make_engine("hbsjd", window=4, gamma="auto", calibration=str(path),
                         calibrate_missing=True)
    engine.generate(model, torch.tensor([0, 1, 2]), torch.zeros(3, 2, dtype=torch.long), 6)
    assert measured == [2, 3, 4]                                  # gamma='auto' read batch 3


def _measure_in_child(model, path: str, log: str, go) -> None:
    """A process that needs batch 3's entry: it waits for `go`, then ensures it; a
    measurement appends a line to `log` (and takes long enough for the other to wait)."""
    import time

    import rollout.calibrate as rc
    measure = rc.measure_verifier_latencies

    def slow(model, batch, windows, **kw):
        with open(log, "a") as f:
            f.write(f"{batch}\n")
        time.sleep(0.5)
        return measure(model, batch, windows, **kw)
    rc.measure_verifier_latencies = slow
    go.wait()
    rc.ensure_calibration(model, [3], 4, path=path, repeats=1, warmup=0)


def test_processes_sharing_the_file_measure_an_entry_once(tiny, tmp_path):
    """Two processes (as two Ray rollout workers) need the same entry at the same moment: the
    file lock makes one measure it and the other read it."""
    import multiprocessing as mp
    from rollout.calibrate import read_calibration
    ctx = mp.get_context("fork")
    go = ctx.Event()
    path, log = tmp_path / "cal.json", tmp_path / "measured.txt"
    procs = [ctx.Process(target=_measure_in_child, args=(tiny(0), str(path), str(log), go))
             for _ in range(2)]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert log.read_text() == "3\n"
    assert [e["batch"] for e in read_calibration(path)] == [3]


def test_windows_are_measured_interleaved(tiny):
    """The cost table's windows are compared with each other (rollout/window.py), so they are
    measured in turn -- each (active count, repeat) runs every W's Full and Compact forward --
    not one W after another, where a load change between them would skew the comparison."""
    from rollout.calibrate import measure_verifier_latencies
    model = tiny(0)
    widths, real = [], model.forward_cached

    def logged(tokens, positions, rows):
        widths.append(tokens.shape[1])
        return real(tokens, positions, rows)
    model.forward_cached = logged
    try:
        curves = measure_verifier_latencies(model, 4, [4, 1, 2], repeats=2, warmup=0,
                                            active=[1, 4])
    finally:
        del model.forward_cached
    assert sorted(curves) == [1, 2, 4]
    assert all(c["active"] == [1, 4] and len(c["full_s"]) == len(c["compact_s"]) == 2
               for c in curves.values())
    assert widths == [1, 1, 2, 2, 4, 4] * 4                 # 2 active counts x 2 repeats
