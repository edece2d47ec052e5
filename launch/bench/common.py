"""What every `opd bench` shares: the model and inputs of a preset, interleaved timing, spread
statistics, Markdown tables and the Agg figure backend.

    calls = [lambda: run_a(), lambda: run_b()]            # each returns (seconds, payload)
    samples = interleave(calls, repeats=3, warmup=1)       # [[(s, payload) x 3], [...]]
    spread([s for s, _ in samples[0]])                     # {"mean_ms": ..., "std_ms": ...}

Interleaving: every call runs `warmup` times in list order, then `repeats` rounds in a rotating
order (round r starts at call r mod n), so slow drift of a shared machine hits all calls alike
and a ratio of two calls is measured side by side.
"""
from __future__ import annotations

import difflib
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from opd.config import loader
from opd.config.files import CONFIG_DIR
from opd.config.loader import ConfigError
from opd.config.files import read_preset

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


# ---- presets ---------------------------------------------------------------------------------

def resolve_bench_preset(name: str | Path) -> Path:
    """`digits`, `digits.yaml` or a path -> the preset file under configs/bench/."""
    p = Path(name).expanduser()
    for c in (p, CONFIG_DIR / "bench" / p.name, CONFIG_DIR / "bench" / f"{p.name}.yaml"):
        if c.is_file():
            return c
    have = ", ".join(sorted(x.stem for x in (CONFIG_DIR / "bench").glob("*.yaml")))
    raise ConfigError(f"bench preset {str(name)!r} not found; available: {have}")


def load_preset(schema: type, name: str | Path, overrides: dict | None = None) -> Any:
    """A bench preset (`extends:` another one, as run presets do) validated against its schema
    by the run config's loader (opd.config.loader: unknown keys named with the closest one,
    types, ranges), then the top-level `overrides` set over it and validated again."""
    path = resolve_bench_preset(name)
    data = read_preset(path, resolve_bench_preset, of="keys")
    try:
        loader.build(schema, data, what="bench preset")
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}", e.key) from None
    data.update(overrides or {})
    return loader.build(schema, data, what="bench preset")


def check_known(data: dict, known: list[str], where: str, prefix: str = "") -> None:
    """ConfigError naming the first key of `data` not in `known`, with the closest match (for
    keys a registry defines, such as the ablations of `bench paper`)."""
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown bench preset key {prefix + str(key)!r} in {where}{hint}",
                              f"{prefix}{key}")


# ---- model and inputs ------------------------------------------------------------------------

def build_model(model: str, overrides: dict, checkpoint: str | None, *, random_init_std: float,
                seed: int, device: str, dtype: str, run_config: str | None = None,
                run_overrides: list[str] | tuple[str, ...] = ()):
    """A preset's model on its device and dtype, in eval mode.

    checkpoint: a weights file, a run or checkpoints/step_N directory of `opd train` (its
    student.pt), "pretrained" (the digits student `opd pretrain` caches for the run config
    `run_config` + `run_overrides`, trained on first use) or None (random init: every matrix
    normal(0, random_init_std), output head included, so logits do not tie)."""
    from opd.run.checkpoints import student_file
    from opd.models import create_model, load_llamagen_checkpoint
    if checkpoint == "pretrained":
        from opd.config.schema import load_config
        from opd.models.factory import pretrained_model
        net, _ = pretrained_model(load_config(run_config, list(run_overrides)), "student")
    elif checkpoint:
        net = load_llamagen_checkpoint(student_file(checkpoint), model, **overrides)
    else:
        torch.manual_seed(seed)
        net = create_model(model, **overrides)
        for p in net.parameters():        # the LlamaGen init zeroes the head: all ties
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=random_init_std)
    return net.to(device=device, dtype=DTYPES[dtype]).eval()


def make_inputs(model, B: int, prefix_ratio: float, source: str, seed: int,
                device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """labels (B,), prefix (B, P) with P = round(prefix_ratio * block_size), drawn with the
    generator seeded `seed`: real digits images (source "data") or uniform tokens ("random")."""
    P = min(int(round(prefix_ratio * model.block_size)), model.block_size - 1)
    g = torch.Generator().manual_seed(seed)
    if source == "data":
        from sklearn.datasets import load_digits

        from opd.data import DIGITS_TOKENIZERS, digits_images_to_tokens
        grids = {g * g: g for g in DIGITS_TOKENIZERS}
        if (model.vocab_size, model.num_classes) != (17, 10) or model.block_size not in grids:
            raise ConfigError("bench preset key prefix=data needs a digits-shaped model "
                              "(vocab 17, an 8x8 or 16x16 grid, 10 classes); use prefix: random",
                              "prefix")
        d = load_digits()
        pick = torch.randint(0, len(d.target), (B,), generator=g).numpy()
        tokens = torch.as_tensor(digits_images_to_tokens(d.images[pick], grids[model.block_size]))
        tokens = tokens.long().reshape(B, -1)
        labels = torch.as_tensor(d.target[pick]).long()
    else:
        labels = torch.randint(0, model.num_classes, (B,), generator=g)
        tokens = torch.randint(0, model.vocab_size, (B, model.block_size), generator=g)
    return labels.to(device), tokens[:, :P].to(device)


# ---- timing ----------------------------------------------------------------------------------

def interleave(calls: list[Callable[[], tuple[float, Any]]], repeats: int,
               warmup: int) -> list[list[tuple[float, Any]]]:
    """Run every call `warmup` times (discarded), then `repeats` rotating rounds; returns the
    timed (seconds, payload) of each call, in repeat order."""
    for _ in range(warmup):
        for call in calls:
            call()
    out: list[list[tuple[float, Any]]] = [[] for _ in calls]
    n = len(calls)
    for r in range(repeats):
        order = list(range(n))
        order = order[r % n:] + order[: r % n]
        for i in order:
            out[i].append(calls[i]())
    return out


def spread(seconds: list[float]) -> dict:
    """Milliseconds: mean, std (sample, 0 for one value), min, max, P95 and the count."""
    ms = np.asarray(seconds, dtype=float) * 1e3
    return {"mean_ms": float(ms.mean()), "std_ms": float(ms.std(ddof=1)) if len(ms) > 1 else 0.0,
            "min_ms": float(ms.min()), "max_ms": float(ms.max()),
            "p95_ms": float(np.percentile(ms, 95)), "n": int(len(ms))}


def ratio(base: list[float], other: list[float]) -> dict:
    """Speedup of `other` over `base`: mean(base) / mean(other), and the min, median and max
    of the paired per-repeat ratios base[i] / other[i] (the same interleaved round)."""
    pairs = [b / o for b, o in zip(base, other) if o > 0]
    return {"speedup": float(np.mean(base) / np.mean(other)),
            "speedup_min": float(min(pairs)) if pairs else None,
            "speedup_median": median(pairs) if pairs else None,
            "speedup_max": float(max(pairs)) if pairs else None}


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def environment(device: str) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": device,
           "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
           "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return env


# ---- reporting -------------------------------------------------------------------------------

def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub Markdown table (text cells; `|` escaped)."""
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
    return "\n".join([line(headers), line(["---"] * len(headers))] + [line(r) for r in rows])


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def fmt_latency(r: dict) -> str:
    """'123.4 ± 5.6' from a row with mean_ms and std_ms."""
    return f"{r['mean_ms']:.1f} ± {r['std_ms']:.1f}"


def fmt_speedup(r: dict) -> str:
    """'1.23× [1.10–1.31]' (ratio of means, paired min–max), '1 (base)' for a baseline."""
    if r.get("speedup") is None:
        return "-"
    if not r.get("baseline"):
        return "1 (base)"
    if r.get("speedup_min") is None:
        return f"{r['speedup']:.3f}×"
    return f"{r['speedup']:.3f}× [{r['speedup_min']:.2f}–{r['speedup_max']:.2f}]"
