"""Run configuration: nested dataclasses are the schema, YAML presets and dotted overrides set it.

    cfg = load_config("tiny", ["rollout.window=8", "learner.betas=[0.9,0.99]"])
    cfg.rollout.window            # 8

A run config is built in three layers, later ones winning: the dataclass defaults (the
embedded digits setup), a YAML preset from `configs/` (or any path, `extends:` another), then
`key=value` overrides whose values are parsed as YAML scalars (`null`, `true`, `1e-3`,
`[0.9, 0.99]`).  Everything is validated once, on load, before anything starts: unknown keys
(with the closest valid key suggested), wrong types, out-of-range or not-allowed values and
cross-field constraints raise `ConfigError` naming the full dotted key and the value.

This module is the schema and the run-config entry points; the machinery is shared with the
bench presets: `opd.config.loader` validates a tree against a dataclass schema on pydantic,
applies dotted overrides and words the errors; `opd.config.files` finds presets, merges
`extends:` and writes the resolved config back (YAML, hash).

What a registry owns is read from it, not repeated: the engines, their options' names and
defaults and the decoding / refresh / execution modes (rollout/options.py), the objectives and
the ranges and defaults of λ, β, τ (opd/config/objective_settings.py); `tests/opd/test_registries.py`
holds the two to each other.

Adding a field is one line plus its docstring: `name: type = default`, or
`name: type = bounded(default, ge=..., lt=...)` for a numeric range. Supported types:
bool, int, float, str, `Literal[...]`, `X | None`, unions, `tuple[...]`, `list[X]`,
`dict[str, Any]` (free-form, validated by its user), and a list of sections (`list[PhaseConfig]`:
each entry validated like a section, errors name `distill.phases[1].lam`; one entry's key set
on the command line as `distill.phases.1.lam=0.5`). Cross-field rules are functions
decorated with `@cross_check`.

Over 400 lines: it is the one place that lists every config key with the docstring users read
(one dataclass per section of a run, about 380 lines of them), then the cross-field rules over
those sections and the entry points that apply both; the rules need the whole schema and
`load_config` needs the rules, and split by section, what a user reads to find a key would
scatter.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from opd.config import loader
from opd.config.files import (config_to_dict, read_preset,
                              resolve_preset)
from opd.config.loader import ConfigError, bounded, choices, strict_schema
from opd.config.objective_settings import BETA, LAM, OBJECTIVE_SETTINGS, TEMPERATURE
from rollout.options import (DECODINGS, ENGINE_OPTIONS, EXECUTIONS, REFRESHES, check_options,
                             engine_options, engines_taking, option_defaults)

# --------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------

DType = Literal["float32", "bfloat16", "float64"]
EngineName = choices(ENGINE_OPTIONS)
Decoding = choices(DECODINGS)
Refresh = choices(REFRESHES)
Execution = choices(EXECUTIONS)
Logger = Literal["tensorboard", "mlflow", "wandb"]


@dataclass
class ModelConfig:
    """Student and teacher networks (presets from the model registry, e.g. `GPT-B`)."""

    student: str = "GPT-digits-S"
    """Student model preset name."""
    teacher: str = "GPT-digits-T"
    """Teacher model preset name."""
    student_ckpt: str | None = None
    """Student weights to start from; None = pretrain one (or reuse the cached pretrained model)."""
    teacher_ckpt: str | None = None
    """Teacher weights; None = pretrain one (or reuse the cached pretrained model)."""
    vocab_size: int = bounded(17, ge=2)
    """Image token ids (17 grey levels for digits; 16384 for the VQ-16 codebook)."""
    num_classes: int = bounded(10, ge=1)
    """Class labels 0..num_classes-1; label num_classes is the null class used by CFG."""
    grid_size: int = bounded(8, ge=1)
    """Token grid side; a sequence has grid_size ** 2 image tokens (digits: 8 native pixels, or 16)."""
    vq_ckpt: str | None = None
    """VQ-16 tokenizer checkpoint to decode tokens to pixels; None = tokens are pixels (digits)."""
    dtype: DType = "float32"
    """Parameter / compute dtype of rollout and teacher copies."""


@dataclass
class DataConfig:
    """Where the class-labelled token sequences come from."""

    dataset: Literal["digits", "parquet"] = "digits"
    """`digits`: the embedded UCI digits set (`opd prepare digits`); `parquet`: LlamaGen codes."""
    data_dir: str = "data/digits8"
    """Directory written by `opd prepare` (digits: prepared there on first use for model.grid_size)."""
    train: str = ""
    """Training split file; "" = derived from data_dir."""
    heldout: str = ""
    """Held-out split file (evaluation references); "" = derived from data_dir."""
    prefix_ratio: float = bounded(0.0, ge=0.0, lt=1.0)
    """Fraction of each sequence taken from data as the prompt; the student generates the rest
    (every training batch, unless prefix_ratios is set; always for held-out on-policy KL)."""
    prefix_ratios: tuple[float, ...] = bounded((), ge=0.0, lt=1.0)
    """Training prefix ratios to spread over: each batch takes one, chosen by (run.seed, batch
    id); () = always prefix_ratio. 0 trains whole images from the class token, which sampling
    from scratch (evaluation) needs; the paper varies the ratio from 0.75 to 0.20."""
    batch_size: int = bounded(32, ge=1)
    """Sequences per training step (prefix batch size)."""


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
    num_workers: int | tuple[int, int] = bounded(1, ge=1, span=True)
    """Rollout workers: a count, or "min..max" for an elastic pool grown and shrunk in that range."""
    window: int | Literal["auto"] = bounded(RUN_CHOICES["window"], ge=1)
    """Jacobi window W: tokens per verifier forward (the last committed token + W-1 drafts); "auto" = HB-SJD chooses each round's W (and Full / Compact) by a bandit rule on the tokens per second it measures in this process (docs/WINDOW_POLICY.md); greedy and sample tokens do not depend on it."""
    history_offset: int | None = bounded(ENGINE_DEFAULTS["history_offset"], ge=1)
    """Draft-initialization history offset H in tokens; None = one grid row (grid_size)."""
    decoding: Decoding = RUN_CHOICES["decoding"]
    """greedy: Cached AR's argmax tokens; sample: the keyed Gumbel-max rule, one token per (seed, image, position), so every engine and window commits Cached AR's sampled tokens; speculative: speculative sampling (the model's distribution too, but the tokens depend on the windows run). rollout/options.py DECODINGS."""
    refresh: Refresh = ENGINE_DEFAULTS["refresh"]
    """Decoding speculative: the drafts after the commit point kept by maximal coupling with their new distribution, or redrawn (both lossless)."""
    compare_every: int = bounded(0, ge=0)
    """Every this many prefix batches (batch id divisible by it), a student rollout call is run again by Cached AR, timed, for the run summary's measured speed-up (`rollout_vs_ar`: same tokens with greedy or sample decoding, so only time differs); 0 = never (the default: on Ray the rerun delays the call's report past its pieces, which the driver does not yet wait for)."""
    slots: int = bounded(0, ge=0)
    """Physical rows of a rollout call (continuous batching: a waiting image takes the row of one that finished); 0 = all of the call's images at once."""
    span: int = bounded(0, ge=0)
    """Stream a student rollout call by position span too: every row's next this many tokens once every row of the call has committed them, which the teacher scores at once with a KV cache per row, so that at the call's end only the last span is left to score (rollout/spans.py, opd/distill/span_scoring.py, docs/STREAMING.md); the same scores as one full forward up to float summation order; 0 = off (a piece is scored once its rows are complete).  run.mode=reference only for now."""
    compile: bool = ENGINE_DEFAULTS["compile"]
    """torch.compile each rollout round, forward and verification, as one graph (CUDA graphs on a GPU; Compact rounds in a few bucketed shapes); on a CPU it speeds Cached AR up more than HB-SJD (docs/ROLLOUTS.md, "Compiled rounds"; figures in docs/RESULTS.md)."""
    candidates: int = bounded(ENGINE_DEFAULTS["candidates"], ge=0)
    """After a correction, the next window also verifies candidates - 1 alternatives for the following token (speculative: first the corrected token before it; the token a grid row above; then the likeliest, by the perturbed scores with decoding sample) as token-tree branches (rollout/candidates.py; greedy or sampled, lossless either way); 0 = off. Cuts rounds at W 16, costs time on a CPU (docs/ROLLOUTS.md, "Candidate drafting")."""
    execution: Execution = ENGINE_DEFAULTS["execution"]
    """Physical batch: keep all rows (full), gather active rows (compact), or switch at gamma."""
    gamma: int | Literal["auto"] = bounded(RUN_CHOICES["gamma"], ge=0)
    """Hybrid threshold: compact once fewer than gamma images are active; "auto" = calibrated."""
    cfg_scale: float = bounded(1.0, ge=0.0)
    """Classifier-free guidance scale; 1.0 disables guidance (no unconditional branch)."""
    temperature: float = bounded(1.0, gt=0.0)
    """Sampling temperature, applied after guidance."""
    top_k: int = bounded(0, ge=0)
    """Keep the k most likely tokens; 0 = off."""
    top_p: float = bounded(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass; 1.0 = off."""
    num_cpus: float = bounded(0.5, ge=0.0)
    """Ray CPUs per rollout worker."""
    num_gpus: float = bounded(0.0, ge=0.0)
    """Ray GPUs per rollout worker (fractions share a device)."""

    def engine_options(self, takes: dict) -> dict:
        """The engine options these keys set, of those an engine takes (`takes`: its
        `rollout.options.engine_options`)."""
        return {key: getattr(self, key) for key in ENGINE_KEYS if key in takes}
    elastic_grow_wait: float = bounded(0.5, gt=0.0, le=1.0)
    """Elastic pool ("min..max"): add a worker after steps where the learner waited on student rollouts for at least this fraction of the step."""
    elastic_shrink_wait: float = bounded(0.1, ge=0.0, le=1.0)
    """Elastic pool: a step where the learner waited on rollouts for less than this fraction is idle for the rollout workers."""
    elastic_patience: int = bounded(2, ge=1)
    """Elastic pool: steps in a row at or over elastic_grow_wait before a worker is added."""
    elastic_idle_steps: int = bounded(5, ge=1)
    """Elastic pool: idle steps in a row before an added worker is retired (never below min)."""


ENGINE_KEYS = tuple(f for f in RolloutConfig.__dataclass_fields__ if f in ENGINE_DEFAULTS)
"""The `rollout.*` keys that are engine options (named as the engines name them)."""


ONE_TEACHER = "default"
"""The name of the teacher a `teacher:` section gives (`one_teacher`)."""


@dataclass
class TeacherConfig:
    """One teacher and its workers, which score the student-visited states: an entry of
    `teachers:` (opd/distill/teachers.py; a `teacher:` section is read as the list of that one
    entry, named "default"), where a key left unset (null) takes the run's value."""

    name: str = ""
    """The teacher's name (its worker pool is opd/teacher/<name>/<i>, its metrics
    `teacher_*/<name>`); "default" for a `teacher:` section."""
    model: str | None = None
    """Model preset; null = model.teacher."""
    ckpt: str | None = None
    """Weights; null = model.teacher_ckpt (null there too: pretrained here, on `classes` only
    when it owns some)."""
    classes: tuple[int, ...] = bounded((), ge=0)
    """Routing (`teachers:`): the class labels this teacher owns; each row of a step is scored
    by the teacher that owns its class."""
    weight: float | None = bounded(None, ge=0.0)
    """Mixing (`teachers:`): this teacher's weight w_i in the target log sum_i w_i p_i / sum w."""
    num_workers: int = bounded(1, ge=1)
    """Teacher workers."""
    transport: Literal["full", "topk"] = "full"
    """Scores sent to the learner: full-vocabulary log-probs (exact) or top-k log-probs + ids."""
    topk: int = bounded(0, ge=0)
    """k for transport=topk (1 <= k <= model.vocab_size); unused for full."""
    guided: bool = False
    """Score with CFG-guided teacher logits (scale rollout.cfg_scale) instead of conditional ones."""
    num_cpus: float = bounded(0.5, ge=0.0)
    """Ray CPUs per teacher worker."""
    num_gpus: float = bounded(0.0, ge=0.0)
    """Ray GPUs per teacher worker."""


@dataclass
class LearnerConfig:
    """Student learner group (DeepSpeed) and its optimizer."""

    world_size: int = bounded(1, ge=1)
    """Data-parallel learner ranks."""
    zero_stage: int = bounded(0, ge=0, le=3)
    """DeepSpeed ZeRO stage 0..3."""
    lr: float = bounded(3e-3, gt=0.0)
    """AdamW learning rate (after the warm-up)."""
    warmup_steps: int = bounded(50, ge=0)
    """Linear learning-rate warm-up over the first steps (lr·(step+1)/warmup_steps); 0 = off.
    A fresh AdamW moves every weight by ~lr on its first steps whatever the gradient: without a
    warm-up it knocks a pretrained student off its samples before distillation can help."""
    lr_decay: Literal["none", "linear"] = "linear"
    """After the warm-up: `none` keeps learner.lr; `linear` decays it to 10 % at distill.steps
    (as pretraining does: the last, small steps are the ones that make clean samples)."""
    weight_decay: float = bounded(0.0, ge=0.0)
    """AdamW weight decay; 0.0 for distillation (the teacher is the regularizer; LlamaGen pretraining uses 0.05)."""
    betas: tuple[float, float] = bounded((0.9, 0.95), ge=0.0, lt=1.0)
    """AdamW betas."""
    grad_clip: float = bounded(1.0, ge=0.0)
    """Gradient-norm clip; 0 = off."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Training precision; auto = bf16 on GPUs that support it, else fp32."""
    student_dropout: bool = False
    """Keep class-label dropout on in the student's training forward (off: it would see other labels than the teacher)."""
    num_cpus: float = bounded(0.5, ge=0.0)
    """Ray CPUs per learner rank."""
    num_gpus: float = bounded(0.0, ge=0.0)
    """Ray GPUs per learner rank."""
    weight_sync: Literal["object_store", "collective"] = "object_store"
    """How new student weights reach rollout workers: one object-store put per version, or a broadcast group (nccl on GPUs, gloo on CPUs)."""
    weight_bucket_mb: float = bounded(64.0, gt=0.0)
    """Bucket size of the collective weight broadcast (MiB of parameters per broadcast call)."""


ObjectiveName = choices(OBJECTIVE_SETTINGS)


@dataclass
class PhaseConfig:
    """One phase of `distill.phases`: its steps and what changes in them.  A key left unset
    (null) takes the run's own value (distill.*, data.prefix_ratio(s), learner.*)."""

    name: str = ""
    """Shown in metrics.parquet (`phase`), training.png and the summary; "" = the objective."""
    steps: int | None = bounded(None, ge=1)
    """Learner steps of the phase; null (the last phase only) = the rest of distill.steps."""
    objective: ObjectiveName | None = None
    """Objective of the phase's steps (`kd`, `gkd`, `varkd`, `seqkd`)."""
    lam: float | None = bounded(None, **LAM.bounds)
    """GKD's on-policy fraction lambda at the phase's first step."""
    lam_end: float | None = bounded(None, **LAM.bounds)
    """GKD: lambda at the phase's last step, linear from `lam` in between (a ramp); null = `lam`."""
    beta: float | None = bounded(None, **BETA.bounds)
    """GKD / VarKD generalized-JSD beta."""
    temperature: float | None = bounded(None, **TEMPERATURE.bounds)
    """Softmax temperature of the loss."""
    prefix_ratio: float | None = bounded(None, ge=0.0, lt=1.0)
    """Real-prefix ratio of the phase's batches (instead of data.prefix_ratio(s))."""
    prefix_ratios: tuple[float, ...] | None = bounded(None, ge=0.0, lt=1.0)
    """Prefix ratios to spread the phase's batches over (as data.prefix_ratios)."""
    lr: float | None = bounded(None, gt=0.0)
    """A learning-rate schedule of the phase's own: warm-up over `warmup_steps`, then
    learner.lr_decay over the phase, from this peak; null (and warmup_steps null) = the run's
    schedule goes on."""
    warmup_steps: int | None = bounded(None, ge=0)
    """Warm-up of the phase's own schedule (with `lr`, or learner.lr when only this is set)."""
    objective_options: dict[str, Any] = field(default_factory=dict)
    """Objective options of the phase, over distill.objective_options."""
    reuse: int | None = bounded(None, ge=1)
    """Updates a student rollout of the phase may train (as distill.reuse)."""
    reuse_buffer: int | None = bounded(None, ge=1)
    """Rollouts the phase's reuse buffer holds (as distill.reuse_buffer)."""
    reuse_fresh: float | None = bounded(None, ge=0.0, le=1.0)
    """Probability of a fresh rollout when the buffer has one to reuse (as distill.reuse_fresh)."""


@dataclass
class DistillConfig:
    """The distillation objective and the on-policy schedule."""

    objective: ObjectiveName = "kd"
    """Objective registered by name in opd's objectives, for every step when `phases` is [].  Set on the command line without `distill.phases`, it replaces the preset's
    phases: `opd train distill.objective=kd` is plain KD for the whole run."""
    steps: int = bounded(600, ge=1)
    """Learner steps."""
    beta: float = bounded(BETA.default, **BETA.bounds)
    """GKD / VarKD generalized-JSD interpolation: 0 = forward KL(P||Q), 1 = reverse KL(Q||P)."""
    lam: float = bounded(LAM.default, **LAM.bounds)
    """On-policy fraction lambda: probability that a batch is student-generated (else data)."""
    temperature: float = bounded(TEMPERATURE.default, **TEMPERATURE.bounds)
    """Softmax temperature of teacher and student logits in the loss."""
    staleness: int = bounded(0, ge=0)
    """Max policy-version lag of consumed trajectories; 0 = strict on-policy."""
    reuse: int = bounded(1, ge=1)
    """Rollout reuse (opd/distill/reuse.py, DistiLLM's replay buffer): updates a student rollout,
    with its teacher scores, may train; the learner recomputes the student's distribution at
    every use.  1 = every student step trains on a fresh rollout (strict on-policy)."""
    reuse_buffer: int = bounded(4, ge=1)
    """Rollouts the reuse buffer holds (the last ones made); a buffered rollout is reused at a
    policy lag of at most reuse · reuse_buffer versions."""
    reuse_fresh: float = bounded(0.5, ge=0.0, le=1.0)
    """With reuse > 1: probability that a student step makes a fresh rollout when the buffer
    has one to reuse (else it trains on one drawn uniformly from the buffer)."""
    broadcast_every: int = bounded(1, ge=1)
    """Publish student weights to rollout workers every this many steps."""
    pieces: int = bounded(0, ge=0)
    """Pieces each step streams in (docs/STREAMING.md): piece p is generated, scored and
    trained on while the next is generated; the learner accumulates gradients over the pieces in
    piece order and updates once.  0 = auto: about 8 rows per learner rank a piece, at least one
    per worker of the larger pool; 1 = no streaming (each stage waits for the whole batch).  At
    most data.batch_size / learner.world_size (a row per rank each).  Both run modes cut a step
    the same way."""
    queue_capacity: int = bounded(4, ge=1)
    """Prefix batches buffered between rollout/teacher workers and the learner (Ray pipeline backpressure)."""
    objective_options: dict[str, Any] = field(default_factory=dict)
    """Objective-specific options (e.g. VarKD gates), validated by the objective."""
    phases: list[PhaseConfig] = field(default_factory=lambda: [
        PhaseConfig(name="warm", steps=420, objective="kd"),
        PhaseConfig(name="onpolicy", objective="gkd", lam=0.75, beta=0.5,
                    prefix_ratios=(0.0, 0.5), lr=1e-3, warmup_steps=10)])
    """The schedule: phases run one after another, each with its steps and objective settings
    (opd/distill/phases.py).  Their steps add up to distill.steps (the last may leave its steps out: the
    rest); [] = one phase, distill.* for every step.  The digits default is a KD warm start on
    data, then on-policy GKD (λ 0.75 of the batches on student rollouts, over prefix ratios 0 and
    0.5, its own learning-rate schedule from 1e-3): of the schedules compared over seeds it
    lowered the on-policy KL below KD-only's (docs/RESULTS.md, "Schedules over seeds")."""


@dataclass
class PretrainConfig:
    """Pretraining of the embedded teacher and student when no checkpoint is given."""

    teacher_steps: int = bounded(2400, ge=0)
    """Teacher pretraining steps (digits: 12 epochs of the train split at batch 8)."""
    student_steps: int = bounded(400, ge=0)
    """Student pretraining steps (short: distillation has room to improve it)."""
    batch_size: int = bounded(8, ge=1)
    """Pretraining batch size (small: more updates per epoch; the model is compute-bound, so a step costs its batch)."""
    lr: float = bounded(1e-3, gt=0.0)
    """Pretraining AdamW learning rate (peak; warm-up over the first 5 % of the steps, then linear decay to 10 %)."""
    class_dropout: float = bounded(0.1, ge=0.0, lt=1.0)
    """Probability of replacing a label by the null class (trains the CFG branch)."""
    seed: int = 0
    """Pretraining seed (part of the cache key of pretrained models)."""


@dataclass
class ClusterConfig:
    """The Ray cluster."""

    address: str | None = None
    """Ray address to join ("auto", "ray://host:10001", ...); None = start a local Ray on loopback."""
    num_cpus: int | None = bounded(None, ge=1)
    """CPUs of a locally started Ray; None = all of this machine's."""
    dashboard_host: str = "127.0.0.1"
    """Interface the Ray dashboard binds to."""
    include_dashboard: bool = True
    """Start the Ray dashboard with a local Ray."""
    max_restarts: int = bounded(3, ge=0)
    """Restarts of a failed rollout or teacher worker (it reloads the current weights; its work is issued again)."""
    role_resources: bool = False
    """Workers also ask for one custom resource each: opd_rollout / opd_teacher / opd_learner (the node types of configs/cluster.yaml)."""


@dataclass
class EvalConfig:
    """Sample-quality evaluation (FID, IS, precision / recall), also during `opd train`."""

    track: bool = True
    """Track quality during `opd train` (opd/eval/tracking.py): quality.parquet, sample grids over training, the closing table; false = no evaluation while training."""
    every: int = bounded(200, ge=0)
    """Evaluate the student during training every this many learner steps, besides step 0 and the last step; 0 = only step 0 and the last step."""
    num_samples: int = bounded(1000, ge=1)
    """Images generated per evaluation (FID is biased and noisy on a few hundred)."""
    extractor: Literal["digits-cnn", "inception-v3-compat"] = "digits-cnn"
    """Feature extractor: a small CNN for digits, or torch-fidelity's Inception (needs inception_weights offline)."""
    inception_weights: str | None = None
    """Local Inception weights file for the inception-v3-compat extractor."""
    engine: EngineName | None = None
    """Engine used to sample evaluation images; None = rollout.engine."""
    decoding: Decoding | None = "sample"
    """Decoding of evaluation samples: sample (the field's practice; greedy gives one image per class), None = rollout.decoding."""
    seed: int = 0
    """Seed of the evaluation samples (image i is keyed by (seed, i)); the same for every run compared."""
    batch_size: int = bounded(50, ge=1)
    """Images generated per engine call during evaluation."""
    reference: str | None = None
    """Reference statistics file (opd.eval.fidelity.save_reference_statistics); None = the held-out split's images."""
    prefix_ratio: float = bounded(0.5, ge=0.0, lt=1.0)
    """Held-out prefix ratio of the on-policy KL (`kl_samples`): the student completes held-out
    prefixes; whole images from the class token are what FID / class accuracy measure."""
    kl_rows: int | None = bounded(None, ge=1)
    """Held-out rows for the KL measures tracked during training (held-out KL(teacher‖student), on-policy KL); None = the whole held-out split."""
    num_cpus: float = bounded(0.5, ge=0.0)
    """Ray CPUs of the evaluation worker that tracks quality in run.mode=ray."""
    num_gpus: float = bounded(0.0, ge=0.0)
    """Ray GPUs of the evaluation worker (fractions share a device)."""


@dataclass
class RunOptions:
    """The run itself: where it writes, how it is seeded and executed."""

    dir: str | None = None
    """Run directory; None = runs/<name>-<timestamp>."""
    name: str = ""
    """Run name (the run directory's prefix); "" = the dataset and what the phases train with,
    e.g. digits-kd-gkd for a KD warm start, then GKD."""
    seed: int = 0
    """Global seed (data order, rollouts, initialization)."""
    mode: Literal["ray", "reference"] = "ray"
    """`ray`: the distributed pipeline; `reference`: the single-process reference loop."""
    checkpoint_every: int = bounded(200, ge=0)
    """Checkpoint every this many steps; 0 = only at the end."""
    log_every: int = bounded(1, ge=1)
    """Log metrics every this many steps."""

    # -- experiment trackers (opd/run/trackers.py, docs/TRACKERS.md) --
    loggers: tuple[Logger, ...] = ("tensorboard",)
    """Experiment trackers that receive every metrics.parquet and quality.parquet row, the sample
    grids, the resolved config and the phases: any of `tensorboard`, `mlflow`, `wandb`; () = none.
    TensorBoard by default: it is what the field's trainers (torchtitan, verl, OpenRLHF) write
    without an account or a server, it writes event files into the run directory (offline), and
    `tensorboard --logdir runs/` overlays every run.  mlflow and wandb need their pyproject
    extras (`pip install -e ".[mlflow]"`, `".[wandb]"`); wandb runs offline unless WANDB_MODE
    says otherwise."""
    mlflow_uri: str = ""
    """MLflow tracking URI for run.loggers=[mlflow]: "" = a local store in the run directory
    (sqlite:///<run_dir>/mlflow/mlflow.db), or a tracking server such as http://127.0.0.1:5000."""


@strict_schema
@dataclass
class RunConfig:
    """Everything one `opd` run needs; saved as config.yaml in the run directory."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    teachers: list[TeacherConfig] = field(
        default_factory=lambda: [TeacherConfig(name=ONE_TEACHER)])
    """The run's teachers (opd/distill/teachers.py), each with a `name`; several either route
    (each entry the `classes` it owns) or mix (each a `weight`).  A `teacher:` section (and
    `teacher.KEY=VALUE`) is the list of its one entry, named "default" (`one_teacher`)."""
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunOptions = field(default_factory=RunOptions)


# --------------------------------------------------------------------------------------------
# Cross-field checks
# --------------------------------------------------------------------------------------------

_CROSS_CHECKS: list[Callable[[RunConfig], None]] = []


def cross_check(fn: Callable[[RunConfig], None]) -> Callable[[RunConfig], None]:
    """Register a rule over several fields; it raises ConfigError naming the keys."""
    _CROSS_CHECKS.append(fn)
    return fn


@cross_check
def _teachers(cfg: RunConfig) -> None:
    """`teachers:` routes by class (every class owned once) or mixes by weight, with one
    transport (the learner's target is one tensor); opd/distill/teachers.py."""
    ts = cfg.teachers
    names = [t.name for t in ts]
    for i, t in enumerate(ts):
        if not t.name or "/" in t.name or names.count(t.name) > 1:
            raise ConfigError(f"teachers[{i}].name={t.name!r}: every teacher needs a name of its "
                              f"own, without '/' (its pool is opd/teacher/<name>)",
                              f"teachers[{i}].name")
        _teacher_topk_of(t, cfg.model.vocab_size, f"teachers[{i}]")
        if (t.transport, t.topk) != (ts[0].transport, ts[0].topk):
            raise ConfigError(f"teachers[{i}].transport={t.transport!r} (topk {t.topk}): every "
                              f"teacher sends the learner one kind of target; set the "
                              f"transport of teachers[0] ({ts[0].transport!r}, topk "
                              f"{ts[0].topk}) on each", f"teachers[{i}].transport")
    routed, mixed = [bool(t.classes) for t in ts], [t.weight is not None for t in ts]
    if any(routed) and any(mixed) or (len(ts) > 1 and not (all(routed) or all(mixed))):
        raise ConfigError("teachers: give every teacher either the classes it owns (routing) or "
                          "a weight (mixing), not both and not neither", "teachers")
    if any(mixed):
        if sum(t.weight for t in ts) <= 0:
            raise ConfigError("teachers: the weights sum to 0; give at least one teacher a "
                              "positive weight", "teachers[0].weight")
        if ts[0].transport != "full":
            raise ConfigError("teachers[0].transport='topk': a mixture log sum_i w_i p_i is exact "
                              "only over the full vocabulary (each teacher's top-k ids differ); "
                              "set transport: full on every mixed teacher, or route by class",
                              "teachers[0].transport")
    C = cfg.model.num_classes
    owner: dict[int, str] = {}
    for i, t in enumerate(ts):
        for c in t.classes:
            if c >= C:
                raise ConfigError(f"teachers[{i}].classes: class {c} is not a label of "
                                  f"model.num_classes={C} (0..{C - 1})", f"teachers[{i}].classes")
            if c in owner:
                raise ConfigError(f"teachers[{i}].classes: class {c} is owned by {owner[c]!r} "
                                  f"too; each class has one teacher", f"teachers[{i}].classes")
            owner[c] = t.name
    if any(routed) and len(owner) < C:
        none = sorted(set(range(C)) - set(owner))
        raise ConfigError(f"teachers: classes {none} are owned by no teacher; add them to one "
                          f"teacher's classes", "teachers")
    if len(ts) > 1 and (any(p.objective == "seqkd" for p in cfg.distill.phases) or (
            not cfg.distill.phases and cfg.distill.objective == "seqkd")):
        raise ConfigError("distill.objective=seqkd samples from one teacher; with several "
                          "teachers use kd, gkd or varkd", "distill.objective")


def _teacher_topk_of(t: TeacherConfig, v: int, key: str) -> None:
    if t.transport == "topk" and not 1 <= t.topk <= v:
        raise ConfigError(f"{key}.topk={t.topk}: {key}.transport='topk' needs 1 <= {key}.topk "
                          f"<= model.vocab_size ({v})", f"{key}.topk")


@cross_check
def _rollout_top_k(cfg: RunConfig) -> None:
    if cfg.rollout.top_k > cfg.model.vocab_size:
        raise ConfigError(f"rollout.top_k={cfg.rollout.top_k}: must be <= model.vocab_size "
                          f"({cfg.model.vocab_size}); 0 turns top-k off", "rollout.top_k")


@cross_check
def _candidates(cfg: RunConfig) -> None:
    """Candidate drafting, checked by the engines' own rules (rollout/options.py)."""
    r = cfg.rollout
    if not r.candidates:
        return
    takes = engine_options(r.engine)
    if "candidates" not in takes:
        raise ConfigError(f"rollout.candidates={r.candidates}: only the "
                          f"{' and '.join(sorted(engines_taking('candidates')))} engines draft "
                          f"candidates (rollout.engine={r.engine!r})", "rollout.candidates")
    try:
        check_options(r.engine, r.engine_options(takes), takes)
    except ValueError as e:
        raise ConfigError(f"rollout.candidates={r.candidates}: {e}", "rollout.candidates") from None


@cross_check
def _window(cfg: RunConfig) -> None:
    """`rollout.window: auto` is HB-SJD's window policy (rollout/window.py); the other Jacobi
    engines run a fixed window."""
    r = cfg.rollout
    takes = engine_options(r.engine)
    if r.window != "auto" or "window" not in takes:
        return
    try:
        check_options(r.engine, {"window": "auto"}, takes)
    except ValueError:
        raise ConfigError(f"rollout.window=auto: only the hbsjd engine chooses its window per "
                          f"round; set rollout.window to an int for rollout.engine={r.engine!r}",
                          "rollout.window") from None


@cross_check
def _phases(cfg: RunConfig) -> None:
    d = cfg.distill
    phases = d.phases
    for i, p in enumerate(phases):
        key = f"distill.phases[{i}]"
        if p.steps is None and i < len(phases) - 1:
            raise ConfigError(f"{key}.steps is not set: only the last phase may leave out its "
                              f"steps (it takes the rest of distill.steps)", f"{key}.steps")
        if p.prefix_ratio is not None and p.prefix_ratios is not None:
            raise ConfigError(f"{key}: set prefix_ratio or prefix_ratios, not both",
                              f"{key}.prefix_ratios")
        if p.lam_end is not None and (p.objective or d.objective) != "gkd":
            raise ConfigError(f"{key}.lam_end={p.lam_end:g}: a lambda ramp needs objective gkd "
                              f"(the phase's objective is {p.objective or d.objective!r})",
                              f"{key}.lam_end")
    reuses = [d.reuse] + [p.reuse for p in phases if p.reuse is not None]
    if max(reuses) > 1 and d.staleness > 0:
        raise ConfigError(f"distill.reuse > 1 with distill.staleness={d.staleness}: a step trains on "
                          f"a reused rollout or a stale one, not both; set distill.staleness=0",
                          "distill.staleness")
    fixed = sum(p.steps or 0 for p in phases)
    if phases and phases[-1].steps is not None and fixed != d.steps:
        raise ConfigError(f"distill.phases: the phases' steps add up to {fixed}, not "
                          f"distill.steps={d.steps}; set distill.steps={fixed} or leave out the "
                          f"last phase's steps (it then takes the rest)", "distill.phases")
    if phases and phases[-1].steps is None and fixed >= d.steps:
        raise ConfigError(f"distill.phases: the phases before the last take {fixed} steps, "
                          f"leaving none of distill.steps={d.steps} for the last; raise "
                          f"distill.steps, shorten them (distill.phases.0.steps=N) or set "
                          f"distill.objective alone for one objective throughout", "distill.phases")


@cross_check
def _worker_span(cfg: RunConfig) -> None:
    n = cfg.rollout.num_workers
    if isinstance(n, tuple) and n[0] > n[1]:
        raise ConfigError(f"rollout.num_workers='{n[0]}..{n[1]}': min must be <= max",
                          "rollout.num_workers")


@cross_check
def _pieces(cfg: RunConfig) -> None:
    P, B, R = cfg.distill.pieces, cfg.data.batch_size, cfg.learner.world_size
    if P and P > B // max(R, 1):
        raise ConfigError(f"distill.pieces={P}: a step of data.batch_size={B} rows over "
                          f"learner.world_size={R} ranks has at most {B // max(R, 1)} pieces (a "
                          f"row per rank each); lower distill.pieces or set 0 (auto)",
                          "distill.pieces")


@cross_check
def _span(cfg: RunConfig) -> None:
    if cfg.rollout.span and cfg.run.mode != "reference":
        raise ConfigError(f"rollout.span={cfg.rollout.span}: scoring by span runs in the reference "
                          f"loop only so far; set run.mode=reference or rollout.span=0",
                          "rollout.span")


@cross_check
def _history_offset(cfg: RunConfig) -> None:
    h, t = cfg.rollout.history_offset, cfg.model.grid_size ** 2
    if h is not None and h >= t:
        raise ConfigError(f"rollout.history_offset={h}: must be < the sequence length "
                          f"model.grid_size ** 2 ({t})", "rollout.history_offset")


# --------------------------------------------------------------------------------------------
# Loading and validation
# --------------------------------------------------------------------------------------------

RETIRED_KEYS = {
    "rollout.sub_batches": "a step is cut into distill.pieces now (they stream through rollout, "
                           "teacher and learner); set distill.pieces=N",
    "run.deterministic": "runs are always reproducible (keyed random numbers, seeded "
                         "initialization), so the key did nothing; drop it",
    "run.resume": "continue a run with opd train --resume RUN_DIR",
}
"""Keys that earlier versions wrote into config.yaml but nothing read: a run directory's old
config.yaml still loads (they are dropped); setting one names what to do instead."""

RESUME_SAFE_KEYS = ("distill.steps", "run.checkpoint_every", "run.log_every", "eval.",
                    "run.loggers", "run.mlflow_uri")
"""What `opd train --resume RUN key=value` may change: how long the run goes on (a new
distill.steps also stretches the learning-rate decay from the resumed step on), how often it
checkpoints and logs, which trackers it logs to, and its evaluations (a key ending in "." is a section).  Anything else
would make the resumed steps another run's."""


def check_resume_overrides(overrides: list[str] | tuple[str, ...]) -> None:
    """ConfigError naming the first override that a resumed run may not change."""
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if not any(key == k or (k.endswith(".") and key.startswith(k))
                   for k in RESUME_SAFE_KEYS):
            raise ConfigError(f"--resume cannot change {key}: the resumed steps would be another "
                              f"run's; only distill.steps, run.checkpoint_every, run.log_every, "
                              f"run.loggers, run.mlflow_uri and eval.* change on resume (start a "
                              f"new run for the rest)", key)


def check_retired_keys(overrides: list[str] | tuple[str, ...]) -> None:
    """ConfigError naming the first override of a key that was removed, and what to do instead."""
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key in RETIRED_KEYS:
            raise ConfigError(f"config key '{key}' was removed: {RETIRED_KEYS[key]}", key)


def _drop_retired(tree: dict[str, Any]) -> None:
    for key in RETIRED_KEYS:
        section, name = key.split(".")
        if isinstance(tree.get(section), dict):
            tree[section].pop(name, None)


def one_teacher(tree: dict[str, Any]) -> None:
    """Read a `teacher:` section of `tree` as `teachers: [{name: default, ...}]`, the list of its
    one entry, when `teachers:` is absent or empty; beside `teachers:` entries it is dropped (a
    preset's `teacher:` under an extending preset's `teachers:`, or an earlier version's
    config.yaml, which saved both)."""
    section = tree.pop("teacher", None)
    if section is not None and not isinstance(section, dict):
        raise ConfigError(f"'teacher' must be a mapping of keys, got {section!r}", "teacher")
    if not tree.get("teachers"):
        entry = dict(section or {})
        entry["name"] = entry.get("name") or ONE_TEACHER      # an earlier version saved name: ''
        tree["teachers"] = [entry]


def _set_overrides(tree: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> None:
    """Set dotted overrides in order; `teacher.KEY=VALUE` sets the key of the one entry of
    `teachers:` (`one_teacher`)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if key.startswith("teacher."):
            one_teacher(tree)
            n = len(tree["teachers"])
            if n != 1:
                raise ConfigError(f"{key}: this run has {n} teachers (teachers:); set "
                                  f"teachers.N.{key[len('teacher.'):]}=VALUE on teacher N", key)
            item = f"teachers.0.{key[len('teacher.'):]}{sep}{raw}"
        loader.set_overrides(RunConfig, tree, [item])


def _writes_teacher(tree: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> bool:
    """Whether the run's one teacher is written as `teacher:` (a section, `teacher.KEY=VALUE` or
    nothing) rather than as `teachers:` entries."""
    return not tree.get("teachers") and not any(
        item.strip().startswith("teachers") for item in overrides)


@contextmanager
def _as_written(teacher: bool):
    """A ConfigError names the one teacher's keys as the user wrote them: `teacher.KEY` for
    `teachers[0].KEY` when `teacher` (`_writes_teacher`)."""
    try:
        yield
    except ConfigError as e:
        if not (teacher and e.key and e.key.startswith(("teachers[0]", "teachers.0"))):
            raise
        msg, key = str(e), e.key
        for spelled in ("teachers[0]", "teachers.0"):
            msg, key = msg.replace(spelled, "teacher"), key.replace(spelled, "teacher")
        raise ConfigError(msg, key) from None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Defaults, then the YAML preset `path` (a name in configs/ or a file), then `key=value`
    overrides; validated. Raises ConfigError on any problem."""
    check_retired_keys(overrides)
    tree: dict[str, Any] = {}
    if path is not None:
        preset = resolve_preset(path)
        tree = read_preset(preset, merge=_merge_presets)
        _drop_retired(tree)
    with _as_written(_writes_teacher(tree, overrides)):
        if path is not None:
            one_teacher(tree)
            try:
                loader.build(RunConfig, tree)
            except ConfigError as e:
                raise ConfigError(f"{preset}: {e}", e.key) from None
        _set_overrides(tree, overrides)
        _objective_replaces_phases(tree, overrides)
        return config_from_dict(tree)


def _merge_presets(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """A preset over the one it extends; one that sets distill.objective without
    distill.phases trains with that objective for the whole run (its base's phases go)."""
    out = loader.deep_merge(base, top)
    own = top.get("distill") if isinstance(top.get("distill"), dict) else {}
    if "objective" in own and "phases" not in own and isinstance(out.get("distill"), dict):
        out["distill"]["phases"] = []
    return out


def _objective_replaces_phases(tree: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> None:
    """`distill.objective=X` given without `distill.phases...`: X for the whole run (the
    preset's phases go), so `opd train distill.objective=kd` is plain KD on data."""
    keys = [item.split("=", 1)[0].strip() for item in overrides]
    if "distill.objective" in keys and not any(k.startswith("distill.phases") for k in keys):
        if isinstance(tree.get("distill"), dict):
            tree["distill"]["phases"] = []


def apply_overrides(cfg: RunConfig, overrides: list[str] | tuple[str, ...]) -> RunConfig:
    """A validated copy of `cfg` with dotted `key=value` overrides applied."""
    tree = config_to_dict(cfg)
    with _as_written(_writes_teacher(tree, overrides)):
        _set_overrides(tree, overrides)
        _objective_replaces_phases(tree, overrides)
        return config_from_dict(tree)


def config_from_dict(tree: dict[str, Any]) -> RunConfig:
    """Build and validate a RunConfig from a (partial) nested dict, e.g. one that came over Ray."""
    spelled = isinstance(tree, dict) and _writes_teacher(tree)
    if isinstance(tree, dict):                     # anything else: `build` names it
        tree = dict(tree)
        one_teacher(tree)
    with _as_written(spelled):
        cfg = loader.build(RunConfig, tree)
        for check in _CROSS_CHECKS:
            check(cfg)
    return cfg


def validate(cfg: RunConfig) -> RunConfig:
    """Check a config built in code (types, ranges, cross-field rules); returns a normalized copy."""
    return config_from_dict(config_to_dict(cfg))


def default_run_dir(cfg: RunConfig, now: float | None = None) -> Path:
    """run.dir, or runs/<run name>-<YYYYmmdd-HHMMSS> when it is None (`run_name`)."""
    if cfg.run.dir is not None:
        return Path(cfg.run.dir)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    return Path("runs") / f"{run_name(cfg)}-{stamp}"


def run_name(cfg: RunConfig) -> str:
    """run.name, or "<data.dataset>-<objectives of the phases in order>" (digits-kd-gkd)."""
    if cfg.run.name:
        return cfg.run.name
    d = cfg.distill
    names = [p.objective or d.objective for p in d.phases] or [d.objective]
    kept = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]
    return "-".join([cfg.data.dataset, *kept])
