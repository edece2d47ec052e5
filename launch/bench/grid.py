"""The engine grid that `opd bench rollout`, `opd bench paper` and `opd bench table1` measure:
rollout engines on the same model, labels and prefixes, timed interleaved, each checked against
Cached AR on the same inputs.  The three benches build the calls (their sweeps of engines x
windows x batches x decodings) and format the measurements as their own reports.

    calls = [Call("cached_ar", engine, model, labels, prefix, N, kwargs, inputs=B), ...]
    grid = measure(calls, repeats=3, warmup=1, exact=("greedy", "sample"))
    grid[i].times           # seconds of the timed rollouts (repeat order)
    grid[i].result          # the last RolloutResult: rounds, tokens, commit lengths
    grid[i].first_s         # the first call's seconds (warm-up included: a compile shows here)
    grid[i].equal_ar        # tokens equal those of Cached AR on the same inputs and decoding

The presets of `rollout` and `paper` share their model and sampling keys (`ModelPreset`) and
their checks (`check_model_preset`, `check_device`); `fail` words a bad value the same way in
every preset.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Hashable, Literal

import torch
from pydantic import Field

from launch.bench import common
from launch.bench.common import DTYPES
from opd.config.loader import ConfigError

AR = "cached_ar"


def fail(key: str, value, need: str) -> ConfigError:
    """`bench preset key KEY=VALUE: NEED`, naming the key."""
    return ConfigError(f"bench preset key {key}={value!r}: {need}", key)


# ---- the presets' shared keys ----------------------------------------------------------------

@dataclass
class ModelPreset:
    """The benchmarked student, its inputs and sampling, and the timing rounds (the keys that
    `bench rollout` and `bench paper` presets share)."""

    model: str = "GPT-digits-S"
    """opd.models preset of the benchmarked student."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """ModelArgs overrides (e.g. grid_size: 24)."""
    checkpoint: str | None = None
    """Weights file, run or checkpoints/step_N directory (its student.pt), "pretrained" (opd
    pretrain's cached digits student) or null (random init, see random_init_std)."""
    pretrain_config: str | None = None
    """Run config whose pretraining makes the student of checkpoint: pretrained (null: the
    default run config)."""
    pretrain_overrides: list[str] = field(default_factory=list)
    """Dotted overrides of that run config (checkpoint: pretrained), e.g. the 16x16 student:
    [model.grid_size=16, data.data_dir=data/digits16]; the student is trained on first use."""
    random_init_std: float = 0.02
    """Std of the normal random init of every matrix (checkpoint: null)."""
    device: str = "cpu"
    """cpu or cuda[:N]."""
    dtype: str = "float32"
    """float32 | bfloat16 | float16 | float64 (launch.bench.common.DTYPES)."""
    threads: int | None = None
    """torch intra-op threads; null or 0 = torch's default."""
    prefix: Literal["data", "random"] = "random"
    """data: real digits prefixes and labels (digits-shaped models only); random: uniform tokens."""
    prefix_ratio: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.25
    """Fraction of the sequence given as the prefix; the engines generate the rest."""
    H: Annotated[int, Field(ge=1)] | None = None
    """Draft-initialization history offset; null = one grid row."""
    cfg_scale: float | None = 2.0
    """Classifier-free guidance scale; null or 1.0 = no guidance."""
    temperature: Annotated[float, Field(gt=0.0)] = 1.0
    """Sampling temperature (sampled decodings)."""
    top_k: Annotated[int, Field(ge=0)] = 0
    """Top-k filter; 0 = off."""
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    """Nucleus mass; 1.0 = off."""
    gamma: Annotated[int, Field(ge=0)] | Literal["measure"] = "measure"
    """Hybrid threshold: measure = the calibration file's gamma per (batch, W), or an int."""
    repeats: Annotated[int, Field(ge=1)] = 3
    """Timed rounds per configuration (interleaved)."""
    warmup: Annotated[int, Field(ge=0)] = 1
    """Untimed rounds first."""
    calibration_repeats: Annotated[int, Field(ge=1)] = 3
    """Timed verifier forwards per (active count, mode) when calibrating gamma."""
    seed: int = 0
    """Seed of the inputs and of sampling."""


def check_model_preset(b: ModelPreset) -> None:
    """What the schema's types and ranges do not say of the shared keys; ConfigError naming
    the key."""
    if b.dtype not in DTYPES:
        raise fail("dtype", b.dtype, f"must be one of {', '.join(DTYPES)}")
    check_device(b.device)


def check_device(device: str) -> None:
    """ConfigError naming the key `device` unless it is cpu or cuda[:N]."""
    if device != "cpu" and not device.startswith("cuda"):
        raise fail("device", device, "must be cpu or cuda[:N]")


def preset_model(b: ModelPreset, checkpoint: str | None = "", pretrain: tuple = ()):
    """The preset's model on its device and dtype, in eval mode: its own checkpoint, or
    `checkpoint` (a file, a run directory or "pretrained" with the extra `pretrain` overrides)."""
    return common.build_model(b.model, b.overrides, b.checkpoint if checkpoint == "" else checkpoint,
                              seed=b.seed, random_init_std=b.random_init_std, device=b.device,
                              dtype=b.dtype, run_config=b.pretrain_config,
                              run_overrides=[*b.pretrain_overrides, *pretrain])


def sampling(b: ModelPreset, seed: int | None = None) -> dict:
    """The keyword arguments of `generate` that the preset sets."""
    return dict(cfg_scale=b.cfg_scale, temperature=b.temperature, top_k=b.top_k, top_p=b.top_p,
                seed=b.seed if seed is None else seed)


# ---- the grid --------------------------------------------------------------------------------

@dataclass
class Call:
    """One engine on one input: `engine.generate(model, labels, prefix, new_tokens, **kwargs)`."""
    name: str                       # make_engine name ("cached_ar" is the reference)
    engine: Any
    model: torch.nn.Module
    labels: torch.Tensor            # (B,)
    prefix: torch.Tensor            # (B, P)
    new_tokens: int                 # N
    kwargs: dict                    # cfg_scale, temperature, top_k, top_p, seed, slots
    inputs: Hashable = 0            # calls with equal keys roll out the same images
    decoding: str = "greedy"


@dataclass
class Measured:
    times: list[float]              # seconds of the timed rollouts, in repeat order
    result: Any                     # the last RolloutResult
    first_s: float                  # the first call's seconds
    equal_ar: bool | None = None    # tokens equal Cached AR's (same inputs, decoding); None: unchecked


def measure(calls: list[Call], repeats: int, warmup: int,
            exact: tuple[str, ...] = ("greedy", "sample")) -> list[Measured]:
    """Every call `warmup` times, then `repeats` rotating rounds (common.interleave); a call
    whose decoding is in `exact` is checked against the Cached AR call of its inputs and
    decoding (Cached AR itself too: True)."""
    first: list[float | None] = [None] * len(calls)

    def once(i: int):
        c = calls[i]
        res = c.engine.generate(c.model, c.labels, c.prefix, c.new_tokens, **c.kwargs)
        if first[i] is None:
            first[i] = res.wall_time
        return res.wall_time, res
    samples = common.interleave([lambda i=i: once(i) for i in range(len(calls))], repeats, warmup)
    out = [Measured([t for t, _ in s], s[-1][1], first[i]) for i, s in enumerate(samples)]
    ar = {(c.inputs, c.decoding): m for c, m in zip(calls, out) if c.name == AR}
    for c, m in zip(calls, out):
        base = ar.get((c.inputs, c.decoding))
        if c.decoding in exact and base is not None:
            m.equal_ar = bool(torch.equal(m.result.tokens, base.result.tokens))
    return out
