"""The rollout section of a run config: the student's rollout workers and their decoding engine.

    cfg.rollout.engine, cfg.rollout.window      # "hbsjd", "auto"
    cfg.rollout.engine_options(engine_options("hbsjd"))   # the engine's options these keys set

A section of the run config's schema (opd/config/root.py joins them; opd/config/schema.py
loads them).  The engines, their options' names and defaults and the decoding / refresh /
execution modes are read from rollout/options.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from opd.config.loader import choices, min_max
from rollout.options import DECODINGS, ENGINE_OPTIONS, EXECUTIONS, REFRESHES, option_defaults

EngineName = choices(ENGINE_OPTIONS)
Decoding = choices(DECODINGS)
Refresh = choices(REFRESHES)
Execution = choices(EXECUTIONS)
Workers = Annotated[int, Field(ge=1)]


ENGINE_DEFAULTS = option_defaults()
"""The engines' option defaults (rollout/options.py).  A `rollout.*` key named like an engine
option is that option: each engine takes those it declares, checks them, and holds every rule
between them (e.g. candidates cannot be compiled).  The run defaults below are the engines',
but for `window`, `decoding` and `gamma`, the digits run's own choices (RUN_CHOICES)."""

RUN_CHOICES = dict(window="auto", decoding="sample", gamma="auto")
"""The run defaults that differ from the engines': each round's window chosen from the rates
this process measures ("auto", rollout/window.py; the engines' fixed 16 is the paper's),
sampled rollouts for on-policy distillation (greedy ones
collapse onto the background; "sample" commits the same tokens in every engine), and Hybrid's threshold calibrated on this machine (the engines'
None is the uncalibrated half-batch fallback)."""


@dataclass
class RolloutConfig:
    """Student rollout workers and their decoding engine."""

    engine: EngineName = "hbsjd"
    """Rollout engine: HB-SJD, Cached AR, batch-synchronous SJD or independent batched SJD."""
    num_workers: Workers | min_max(Workers) = 1
    """Rollout workers: a count, or "min..max" for an elastic pool grown and shrunk in that range."""
    window: Annotated[int, Field(ge=1)] | Literal["auto"] = RUN_CHOICES["window"]
    """Jacobi window W: tokens per verifier forward (the last committed token + W-1 drafts); "auto" = HB-SJD chooses W per call (from whole calls' seconds per committed token; a worker's first call by round) and Full / Compact per round, by bandit rules on what it measures in this process (docs/WINDOW_POLICY.md); greedy and sample tokens do not depend on it."""
    history_offset: Annotated[int, Field(ge=1)] | None = ENGINE_DEFAULTS["history_offset"]
    """Draft-initialization history offset H in tokens; None = one grid row (grid_size)."""
    decoding: Decoding = RUN_CHOICES["decoding"]
    """greedy: Cached AR's argmax tokens; sample: the keyed Gumbel-max rule, one token per (seed, image, position), so every engine and window commits Cached AR's sampled tokens; speculative: speculative sampling (the model's distribution too, but the tokens depend on the windows run). rollout/options.py DECODINGS."""
    refresh: Refresh = ENGINE_DEFAULTS["refresh"]
    """Decoding speculative: the drafts after the commit point kept by maximal coupling with their new distribution, or redrawn (both lossless)."""
    compare_every: Annotated[int, Field(ge=0)] = 10
    """Every this many prefix batches (the n-th, the 2n-th, ...: batch ids n - 1, 2n - 1, ...), a student rollout call is run by Cached AR in the engine's place, timed, for the run summary's measured speed-up (`rollout_vs_ar`: the engine's seconds against Cached AR's for calls of the same shapes; same tokens and log-probs with greedy or sample decoding, so the run trains the same); 0 = never."""
    slots: Annotated[int, Field(ge=0)] = 0
    """Physical rows of a rollout call (continuous batching: a waiting image takes the row of one that finished); 0 = all of the call's images at once."""
    span: Annotated[int, Field(ge=0)] = 0
    """Stream a student rollout call by position span too: every row's next this many tokens once every row of the call has committed them, which the teacher scores at once with a KV cache per row, so that at the call's end only the last span is left to score (rollout/spans.py, opd/distill/span_scoring.py, docs/STREAMING.md); the same scores as one full forward up to float summation order; 0 = off (a piece is scored once its rows are complete).  Both run modes: on Ray one teacher worker per teacher scores a call's spans and then its pieces."""
    compile: bool = ENGINE_DEFAULTS["compile"]
    """torch.compile each rollout round, forward and verification, as one graph (CUDA graphs on a GPU; Compact rounds in a few bucketed shapes); on a CPU it speeds Cached AR up more than HB-SJD (docs/ROLLOUTS.md, "Compiled rounds"; figures in docs/RESULTS.md)."""
    candidates: Annotated[int, Field(ge=0)] = ENGINE_DEFAULTS["candidates"]
    """After a correction, the next window also verifies candidates - 1 alternatives for the following token (speculative: first the corrected token before it; the token a grid row above; then the likeliest, by the perturbed scores with decoding sample) as token-tree branches (rollout/candidates.py; greedy or sampled, lossless either way); 0 = off. Cuts rounds at W 16, costs time on a CPU (docs/ROLLOUTS.md, "Candidate drafting")."""
    execution: Execution = ENGINE_DEFAULTS["execution"]
    """Physical batch: keep all rows (full), gather active rows (compact), or switch at gamma."""
    gamma: Annotated[int, Field(ge=0)] | Literal["auto"] = RUN_CHOICES["gamma"]
    """Hybrid threshold of a fixed window: compact once fewer than gamma images are active; "auto" = calibrated.  Window "auto" does not read it: its policy chooses Full or Compact each round."""
    cfg_scale: Annotated[float, Field(ge=0.0)] = 1.0
    """Classifier-free guidance scale; 1.0 disables guidance (no unconditional branch)."""
    temperature: Annotated[float, Field(gt=0.0)] = 1.0
    """Sampling temperature, applied after guidance."""
    top_k: Annotated[int, Field(ge=0)] = 0
    """Keep the k most likely tokens; 0 = off."""
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    """Nucleus sampling mass; 1.0 = off."""
    num_cpus: Annotated[float, Field(ge=0.0)] = 0.5
    """Ray CPUs per rollout worker."""
    num_gpus: Annotated[float, Field(ge=0.0)] = 0.0
    """Ray GPUs per rollout worker (fractions share a device)."""

    def engine_options(self, takes: dict) -> dict:
        """The engine options these keys set, of those an engine takes (`takes`: its
        `rollout.options.engine_options`)."""
        return {key: getattr(self, key) for key in ENGINE_KEYS if key in takes}
    elastic_grow_wait: Annotated[float, Field(gt=0.0, le=1.0)] = 0.5
    """Elastic pool ("min..max"): add a worker after steps where the learner waited on student rollouts for at least this fraction of the step."""
    elastic_shrink_wait: Annotated[float, Field(ge=0.0, le=1.0)] = 0.1
    """Elastic pool: a step where the learner waited on rollouts for less than this fraction is idle for the rollout workers."""
    elastic_patience: Annotated[int, Field(ge=1)] = 2
    """Elastic pool: steps in a row at or over elastic_grow_wait before a worker is added."""
    elastic_idle_steps: Annotated[int, Field(ge=1)] = 5
    """Elastic pool: idle steps in a row before an added worker is retired (never below min)."""


ENGINE_KEYS = tuple(f for f in RolloutConfig.__dataclass_fields__ if f in ENGINE_DEFAULTS)
"""The `rollout.*` keys that are engine options (named as the engines name them)."""
