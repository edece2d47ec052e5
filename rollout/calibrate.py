"""gamma calibration for Hybrid execution: measure the verifier forward on this hardware.

For a model, a batch of B images and a window W, Full execution costs one forward of all B
physical rows (2B with CFG) whatever the active count A; Compact costs a forward of the A active
rows, gathered from the KV cache.  We time both for A = 1..B (median over repeats, device
synchronised) and choose

    gamma = the smallest measured A such that Full is at least as fast as Compact at A and at
            every larger measured active count

so Hybrid runs Compact exactly where Compact measured faster (active < gamma).  gamma = B + 1
means Compact was faster even with every image active; gamma = 1 means never Compact.

A batch's windows are measured interleaved (`calibrate_windows`: each active count and repeat
runs every W in turn, `measure_verifier_latencies`), so a load change on a shared CPU hits them
alike.

The JSON file holds a list of entries keyed by (model signature, batch, W, cfg); writing an
entry replaces the one with the same key.  `load_gamma` is what `gamma="auto"` uses.

There is one calibration file, `calibration_file()` = `$OPD_CACHE/calibration.json` (default
`~/.cache/opd/calibration.json`): `opd calibrate` writes it, training, evaluation and the benches
read it.  The cache directory (`cache_root()`: pretrained models, calibration, the digits feature
extractor) is defined here because rollout/ imports nothing from opd/ and every layer above
reads it from here.  `ensure_calibration` measures
missing entries under an exclusive lock on the file, so processes sharing it (Ray workers)
measure each entry once: the first one measures, the others wait and read it.
"""
from __future__ import annotations

import fcntl
import json
import os
import statistics
import time
import weakref
from contextlib import contextmanager
from pathlib import Path

import torch

from rollout.engine import model_device, synchronize

FORMAT = 1
CACHE_ENV = "OPD_CACHE"
CALIBRATION_NAME = "calibration.json"


def cache_root() -> Path:
    """`$OPD_CACHE` if set, else `~/.cache/opd`: where opd keeps what it computes once."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "opd")


def calibration_file() -> Path:
    """The calibration file every part of opd reads and writes: `$OPD_CACHE/calibration.json`."""
    return cache_root() / CALIBRATION_NAME


def calibration_path(options: dict) -> Path:
    """The engine option `calibration`, else the one calibration file (`calibration_file`)."""
    return Path(options.get("calibration") or calibration_file())


def model_signature(model) -> str:
    """A key for 'this model on this hardware': parameter count, vocabulary, sequence
    length, parameter dtype and device type, and on a CPU the process's torch threads, e.g.
    'p185600-v17-t256-float32-cpu-th2'.  The threads, because what a window costs against a
    1-token forward depends on them: a Ray worker runs as many as its CPU share
    (actors/workers/base.py), one on this machine, while the driver and the benches run one
    per core, and a table measured at two threads chose other windows for a one-thread rollout
    (docs/WINDOW_POLICY.md).  The parameter count is counted once per model object (every W
    "auto" call keys its policy by the signature: walking a LlamaGen's parameters every call
    would cost more than the policy's rounds); dtype and device are read each time."""
    first = next(model.parameters(), None) if hasattr(model, "parameters") else None
    n = _COUNTS.get(model) if first is not None else 0
    if n is None:
        n = _COUNTS[model] = sum(p.numel() for p in model.parameters())
    dtype = str(first.dtype).replace("torch.", "") if first is not None else "unknown"
    device = first.device.type if first is not None else "cpu"
    threads = f"-th{torch.get_num_threads()}" if device == "cpu" else ""
    return f"p{n}-v{model.vocab_size}-t{model.block_size}-{dtype}-{device}{threads}"


_COUNTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> its parameters


def _device(model) -> torch.device:
    return model_device(model, torch.device("cpu"))


def default_active_counts(batch: int, points: int = 24) -> list[int]:
    """Every count up to `points`, else an even spread that includes 1 and B."""
    if batch <= points:
        return list(range(1, batch + 1))
    step = (batch - 1) / (points - 1)
    return sorted({1 + round(i * step) for i in range(points)})


def measure_verifier_latencies(model, batch: int, windows, *, cfg: bool = False,
                               active: list[int] | None = None, repeats: int = 5,
                               warmup: int = 2, context: int | None = None,
                               seed: int = 0) -> dict[int, dict]:
    """{W: {"active": [A...], "full_s": [...], "compact_s": [...]}}: median seconds of Full and
    Compact verifier forwards of width W over active counts, for every W of windows, measured
    interleaved (for each active count and repeat, every W's Full and Compact forward in turn),
    so a shared machine's load drift hits every window alike.  The cache is filled to `context` positions (default half the
    sequence, at most T - the largest W) by a prefill of random tokens, so attention spans a
    realistic length."""
    windows = sorted({int(W) for W in windows})
    if batch < 1 or not windows or windows[0] < 1 or repeats < 1:
        raise ValueError(f"batch, W and repeats must be >= 1, got {batch}, {windows}, {repeats}")
    T = model.block_size
    width = {W: min(W, T - 1) for W in windows}            # the forward's tokens per row
    ctx = min(context if context is not None else T // 2, T - width[windows[-1]])
    active = active or default_active_counts(batch)
    if min(active) < 1 or max(active) > batch:
        raise ValueError(f"active counts must be in [1, batch={batch}], got {active}")
    dev, rows = _device(model), batch * (2 if cfg else 1)
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, model.vocab_size, (rows, ctx - 1), generator=g).to(dev)
    labels = torch.randint(0, model.num_classes, (rows,), generator=g).to(dev)
    tokens = torch.randint(0, model.vocab_size, (rows, width[windows[-1]]), generator=g).to(dev)
    positions = (ctx + torch.arange(width[windows[-1]], device=dev)).expand(rows, -1)
    perm = torch.randperm(batch, generator=g).to(dev)

    def full(W):
        model.forward_cached(tokens[:, :width[W]], positions[:, :width[W]], None)

    def compact(W, a):
        idx = perm[:a].sort().values
        r = torch.cat([idx, idx + batch]) if cfg else idx
        model.forward_cached(tokens[: len(r), :width[W]], positions[: len(r), :width[W]], r)

    def timed(fn, *args) -> float:
        synchronize(dev)
        t = time.perf_counter()
        fn(*args)
        synchronize(dev)
        return time.perf_counter() - t

    out = {W: {"active": list(active), "full_s": [], "compact_s": []} for W in windows}
    with torch.inference_mode():
        model.setup_cache(rows, T)
        model.prefill(labels, prefix, None)
        for _ in range(warmup):
            for W in windows:
                full(W)
                compact(W, max(active))
        for a in active:
            f, c = {W: [] for W in windows}, {W: [] for W in windows}
            for _ in range(repeats):               # interleaved: drift hits all alike
                for W in windows:
                    f[W].append(timed(full, W))
                    c[W].append(timed(compact, W, a))
            for W in windows:
                out[W]["full_s"].append(statistics.median(f[W]))
                out[W]["compact_s"].append(statistics.median(c[W]))
    return out


def choose_gamma(active: list[int], full_s: list[float], compact_s: list[float]) -> int:
    """Compact runs when active < gamma; see the module docstring."""
    if not active or not (len(active) == len(full_s) == len(compact_s)):
        raise ValueError("choose_gamma needs equally long, non-empty curves")
    order = sorted(range(len(active)), key=lambda i: active[i])
    gamma = active[order[-1]] + 1
    for i in reversed(order):
        if full_s[i] > compact_s[i]:
            break
        gamma = active[i]
    return gamma


def calibrate(model, batch: int, W: int, *, cfg: bool = False, preset: str | None = None,
              **measure_kw) -> dict:
    """Measure and choose gamma -> one calibration entry (JSON-serialisable)."""
    return calibrate_windows(model, batch, [W], cfg=cfg, preset=preset, **measure_kw)[W]


def calibrate_windows(model, batch: int, windows, *, cfg: bool = False,
                      preset: str | None = None, **measure_kw) -> dict[int, dict]:
    """`calibrate` at every W of windows, measured interleaved (`measure_verifier_latencies`)
    -> {W: entry}."""
    curves = measure_verifier_latencies(model, batch, windows, cfg=cfg, **measure_kw)
    return {W: {"model": model_signature(model), "preset": preset, "batch": batch, "W": W,
                "cfg": bool(cfg), "gamma": choose_gamma(**c), **c,
                "device": str(_device(model)), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
            for W, c in curves.items()}


def _key(entry: dict) -> tuple:
    return entry["model"], entry["batch"], entry["W"], entry["cfg"]


def read_calibration(path: str | Path) -> list[dict]:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"calibration file {path} is not valid JSON ({e}); delete it and "
                         f"run `opd calibrate` again") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or \
            not isinstance(data.get("entries"), list):
        raise ValueError(f"calibration file {path} is not an `opd calibrate` file "
                         f"(format {FORMAT})")
    return data["entries"]


def save_calibration(path: str | Path, entry: dict) -> None:
    """Add `entry` to the JSON file at `path` (replacing one with the same key), under
    `file_lock(path)`."""
    with file_lock(path):
        _write_entry(Path(path), entry)


def _write_entry(path: Path, entry: dict) -> None:
    entries = read_calibration(path) if path.exists() else []
    entries = [e for e in entries if _key(e) != _key(entry)] + [entry]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")     # workers may share the file
    tmp.write_text(json.dumps({"format": FORMAT, "entries": entries}, indent=1) + "\n")
    os.replace(tmp, path)


@contextmanager
def file_lock(path: str | Path):
    """An exclusive lock on `path` (a `<name>.lock` file beside it), held for the block;
    another process asking for it waits."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def find_entry(path: str | Path, model, batch: int, W: int, cfg: bool) -> dict | None:
    """The entry of (this model, batch, W, cfg) in the file at `path`, else None (also when
    the file does not exist)."""
    path = Path(path)
    if not path.exists():
        return None
    key = (model_signature(model), batch, W, bool(cfg))
    return next((e for e in read_calibration(path) if _key(e) == key), None)


def ensure_calibration(model, batches, W: int, *, cfg: bool = False,
                       path: str | Path | None = None, preset: str | None = None,
                       repeats: int = 3, **measure_kw) -> dict[int, dict]:
    """{batch: entry} for (this model, each batch, W, cfg) (`ensure_calibrations`)."""
    found = ensure_calibrations(model, batches, [W], cfg=cfg, path=path, preset=preset,
                                repeats=repeats, **measure_kw)
    return {b: e for (b, _), e in found.items()}


def ensure_calibrations(model, batches, windows, *, cfg: bool = False,
                        path: str | Path | None = None, preset: str | None = None,
                        repeats: int = 3, **measure_kw) -> dict[tuple, dict]:
    """{(batch, W): entry} for (this model, each batch, each W of windows, cfg) from the
    calibration file (default `calibration_file()`), measuring and saving only the entries it
    lacks, a batch's missing windows together (`calibrate_windows`: interleaved).  The
    measuring happens under `file_lock(path)` after reading the file again, so of several
    processes that need the same entry one measures it and the others read it."""
    path = Path(path or calibration_file())
    batches = sorted(set(int(b) for b in batches))
    windows = sorted(set(int(W) for W in windows))

    def complete(e):
        return e is not None
    found = {(b, W): find_entry(path, model, b, W, cfg) for b in batches for W in windows}
    if all(complete(e) for e in found.values()):
        return found
    with file_lock(path):
        for b in batches:
            for W in windows:
                found[b, W] = find_entry(path, model, b, W, cfg)
            missing = [W for W in windows if not complete(found[b, W])]
            if missing:
                for W, entry in calibrate_windows(model, b, missing, cfg=cfg, preset=preset,
                                                  repeats=repeats, **measure_kw).items():
                    found[b, W] = entry
                    _write_entry(path, entry)
    return found


def load_gamma(path: str | Path, model, batch: int, W: int, cfg: bool) -> int:
    """gamma for (this model, batch, W, cfg) from `opd calibrate`'s file; ValueError if the
    file or the entry is missing, saying how to make it."""
    path = Path(path)
    sig = model_signature(model)
    out = "" if path == calibration_file() else f" --out {path}"
    hint = (f"run `opd calibrate --model PRESET --batch {batch} --window {W}"
            f"{' --cfg-scale 2.0' if cfg else ''}{out}`")
    if not path.exists():
        raise ValueError(f"gamma='auto': calibration file {path} does not exist; {hint}")
    for e in read_calibration(path):
        if _key(e) == (sig, batch, W, bool(cfg)):
            return int(e["gamma"])
    have = sorted({f"batch={e['batch']} W={e['W']} cfg={e['cfg']}" for e in
                   read_calibration(path) if e["model"] == sig}) or ["none for this model"]
    raise ValueError(f"gamma='auto': no calibration for model {sig} with batch={batch} W={W} "
                     f"cfg={bool(cfg)} in {path} (it has: {', '.join(have)}); {hint}")
