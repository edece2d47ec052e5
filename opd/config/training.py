"""The training sections of a run config: the learner and its optimizer, the distillation
objective and its phases, and the pretraining of models that have no checkpoint.

    cfg.learner.lr, cfg.distill.objective       # 3e-3, "kd"
    cfg.distill.phases[1].lam                   # 0.75

Sections of the run config's schema (opd/config/root.py joins them; opd/config/schema.py
loads them).  The objectives and the ranges and defaults of λ, β, τ are read from
opd/config/objective_settings.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field

from opd.config.loader import choices
from opd.config.objective_settings import BETA, LAM, OBJECTIVE_SETTINGS, TEMPERATURE

AdamBeta = Annotated[float, Field(ge=0.0, lt=1.0)]


@dataclass
class LearnerConfig:
    """Student learner group (DeepSpeed) and its optimizer."""

    world_size: Annotated[int, Field(ge=1)] = 1
    """Data-parallel learner ranks."""
    zero_stage: Annotated[int, Field(ge=0, le=3)] = 0
    """DeepSpeed ZeRO stage 0..3."""
    lr: Annotated[float, Field(gt=0.0)] = 3e-3
    """AdamW learning rate (after the warm-up)."""
    warmup_steps: Annotated[int, Field(ge=0)] = 50
    """Linear learning-rate warm-up over the first steps (lr·(step+1)/warmup_steps); 0 = off.
    A fresh AdamW moves every weight by ~lr on its first steps whatever the gradient: without a
    warm-up it knocks a pretrained student off its samples before distillation can help."""
    lr_decay: Literal["none", "linear"] = "linear"
    """After the warm-up: `none` keeps learner.lr; `linear` decays it to 10 % at distill.steps
    (as pretraining does: the last, small steps are the ones that make clean samples)."""
    weight_decay: Annotated[float, Field(ge=0.0)] = 0.0
    """AdamW weight decay; 0.0 for distillation (the teacher is the regularizer; LlamaGen pretraining uses 0.05)."""
    betas: tuple[AdamBeta, AdamBeta] = (0.9, 0.95)
    """AdamW betas."""
    grad_clip: Annotated[float, Field(ge=0.0)] = 1.0
    """Gradient-norm clip; 0 = off."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Training precision; auto = bf16 on GPUs that support it, else fp32."""
    student_dropout: bool = False
    """Keep class-label dropout on in the student's training forward (off: it would see other labels than the teacher)."""
    num_cpus: Annotated[float, Field(ge=0.0)] = 0.5
    """Ray CPUs per learner rank."""
    num_gpus: Annotated[float, Field(ge=0.0)] = 0.0
    """Ray GPUs per learner rank."""
    weight_sync: Literal["object_store", "collective"] = "object_store"
    """How new student weights reach rollout workers: one object-store put per version, or a broadcast group (nccl on GPUs, gloo on CPUs)."""
    weight_bucket_mb: Annotated[float, Field(gt=0.0)] = 64.0
    """Bucket size of the collective weight broadcast (MiB of parameters per broadcast call)."""


ObjectiveName = choices(OBJECTIVE_SETTINGS)


@dataclass
class PhaseConfig:
    """One phase of `distill.phases`: its steps and what changes in them.  A key left unset
    (null) takes the run's own value (distill.*, data.prefix_ratio(s), learner.*)."""

    name: str = ""
    """Shown in metrics.parquet (`phase`), training.png and the summary; "" = the objective."""
    steps: Annotated[int, Field(ge=1)] | None = None
    """Learner steps of the phase; null (the last phase only) = the rest of distill.steps."""
    objective: ObjectiveName | None = None
    """Objective of the phase's steps (`kd`, `gkd`, `varkd`, `seqkd`)."""
    lam: Annotated[float, Field(**LAM.bounds)] | None = None
    """GKD's on-policy fraction lambda at the phase's first step."""
    lam_end: Annotated[float, Field(**LAM.bounds)] | None = None
    """GKD: lambda at the phase's last step, linear from `lam` in between (a ramp); null = `lam`."""
    beta: Annotated[float, Field(**BETA.bounds)] | None = None
    """GKD / VarKD generalized-JSD beta."""
    temperature: Annotated[float, Field(**TEMPERATURE.bounds)] | None = None
    """Softmax temperature of the loss."""
    prefix_ratio: Annotated[float, Field(ge=0.0, lt=1.0)] | None = None
    """Real-prefix ratio of the phase's batches (instead of data.prefix_ratio(s))."""
    prefix_ratios: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], ...] | None = None
    """Prefix ratios to spread the phase's batches over (as data.prefix_ratios)."""
    lr: Annotated[float, Field(gt=0.0)] | None = None
    """A learning-rate schedule of the phase's own: warm-up over `warmup_steps`, then
    learner.lr_decay over the phase, from this peak; null (and warmup_steps null) = the run's
    schedule goes on."""
    warmup_steps: Annotated[int, Field(ge=0)] | None = None
    """Warm-up of the phase's own schedule (with `lr`, or learner.lr when only this is set)."""
    objective_options: dict[str, Any] = field(default_factory=dict)
    """Objective options of the phase, over distill.objective_options."""
    reuse: Annotated[int, Field(ge=1)] | None = None
    """Updates a student rollout of the phase may train (as distill.reuse)."""
    reuse_buffer: Annotated[int, Field(ge=1)] | None = None
    """Rollouts the phase's reuse buffer holds (as distill.reuse_buffer)."""
    reuse_fresh: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    """Probability of a fresh rollout when the buffer has one to reuse (as distill.reuse_fresh)."""


@dataclass
class DistillConfig:
    """The distillation objective and the on-policy schedule."""

    objective: ObjectiveName = "kd"
    """Objective registered by name in opd's objectives, for every step when `phases` is [].  Set on the command line without `distill.phases`, it replaces the preset's
    phases: `opd train distill.objective=kd` is plain KD for the whole run."""
    steps: Annotated[int, Field(ge=1)] = 2400
    """Learner steps."""
    beta: Annotated[float, Field(**BETA.bounds)] = BETA.default
    """GKD / VarKD generalized-JSD interpolation: 0 = forward KL(P||Q), 1 = reverse KL(Q||P)."""
    lam: Annotated[float, Field(**LAM.bounds)] = LAM.default
    """On-policy fraction lambda: probability that a batch is student-generated (else data)."""
    temperature: Annotated[float, Field(**TEMPERATURE.bounds)] = TEMPERATURE.default
    """Softmax temperature of teacher and student logits in the loss."""
    staleness: Annotated[int, Field(ge=0)] = 0
    """Max policy-version lag of consumed trajectories; 0 = strict on-policy."""
    reuse: Annotated[int, Field(ge=1)] = 1
    """Rollout reuse (opd/distill/reuse.py, DistiLLM's replay buffer): updates a student rollout,
    with its teacher scores, may train; the learner recomputes the student's distribution at
    every use.  1 = every student step trains on a fresh rollout (strict on-policy)."""
    reuse_buffer: Annotated[int, Field(ge=1)] = 4
    """Rollouts the reuse buffer holds (the last ones made); a buffered rollout is reused at a
    policy lag of at most reuse · reuse_buffer versions."""
    reuse_fresh: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    """With reuse > 1: probability that a student step makes a fresh rollout when the buffer
    has one to reuse (else it trains on one drawn uniformly from the buffer)."""
    cache_data_scores: bool = False
    """Score each data image by the teacher once and reuse its scores in later epochs
    (opd/distill/score_cache.py): the teacher is frozen and the data fixed, so a data step's
    target does not change between epochs; the run's losses stay the same bit for bit and the
    teacher forwards each distinct image once.  Reference mode only; the cache lives in memory
    (about 4 KiB an image at the digits shape)."""
    broadcast_every: Annotated[int, Field(ge=1)] = 1
    """Publish student weights to rollout workers every this many steps."""
    pieces: Annotated[int, Field(ge=0)] = 0
    """Pieces each step streams in (docs/STREAMING.md): piece p is generated, scored and
    trained on while the next is generated; the learner accumulates gradients over the pieces in
    piece order and updates once.  0 = auto: about 8 rows per learner rank a piece, at least one
    per worker of the larger pool; 1 = no streaming (each stage waits for the whole batch).  At
    most data.batch_size / learner.world_size (a row per rank each).  Both run modes cut a step
    the same way."""
    queue_capacity: Annotated[int, Field(ge=1)] = 4
    """Steps the Ray pipeline plans ahead of the learner (backpressure: a step beyond it is not
    started, so at most this many steps' pieces wait in the trajectory queue)."""
    objective_options: dict[str, Any] = field(default_factory=dict)
    """Objective-specific options (e.g. VarKD gates), validated by the objective."""
    phases: list[PhaseConfig] = field(default_factory=lambda: [
        PhaseConfig(name="warm", steps=1800, objective="kd"),
        PhaseConfig(name="onpolicy", objective="gkd", lam=0.75, beta=0.5,
                    prefix_ratios=(0.0, 0.5), lr=1e-3, warmup_steps=10)])
    """The schedule: phases run one after another, each with its steps and objective settings
    (opd/distill/phases.py).  Their steps add up to distill.steps (the last may leave its steps out: the
    rest); [] = one phase, distill.* for every step.  The digits default is KD on data for 1,800
    steps, where KD-only has slowed down, then on-policy GKD for the last 600 (λ 0.75 of the
    batches on student rollouts, over prefix ratios 0 and 0.5, its own learning-rate schedule
    from 1e-3): at equal training time it reached a lower on-policy KL than KD-only given
    thousands more steps (docs/RESULTS.md, "Quality against training time, to the plateau")."""


@dataclass
class PretrainConfig:
    """Pretraining of the embedded teacher and student when no checkpoint is given."""

    teacher_steps: Annotated[int, Field(ge=0)] = 2400
    """Teacher pretraining steps (digits: 12 epochs of the train split at batch 8)."""
    student_steps: Annotated[int, Field(ge=0)] = 400
    """Student pretraining steps (short: distillation has room to improve it)."""
    batch_size: Annotated[int, Field(ge=1)] = 8
    """Pretraining batch size (small: more updates per epoch; the model is compute-bound, so a step costs its batch)."""
    lr: Annotated[float, Field(gt=0.0)] = 1e-3
    """Pretraining AdamW learning rate (peak; warm-up over the first 5 % of the steps, then linear decay to 10 %)."""
    class_dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.1
    """Probability of replacing a label by the null class (trains the CFG branch)."""
    seed: int = 0
    """Pretraining seed (part of the cache key of pretrained models)."""
