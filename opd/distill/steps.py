"""The roles of one OPD step as pure functions: generate (the rollout) → score → learn.

The single-process reference loop (`opd.run.reference`) and the Ray actors (`actors/`) call exactly
these functions, so a distributed run computes what the reference computes (invariant 5,
docs/ARCHITECTURE.md).
Every random choice is keyed by (run seed, step or batch id), never drawn in call order.
"""
from __future__ import annotations

import functools
import hashlib
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from opd.models import precision
from opd.distill.batch import TrajectoryBatch, index_dtype
from rollout.calibrate import calibration_file
from opd.config.schema import RunConfig, TeacherConfig
from opd.distill.objectives import Objective
from opd.distill.onpolicy import logprob_gap
from opd.distill.results import combine_metrics
from opd.distill.rollout_stats import RolloutStats
from opd.distill.phases import objective_at, phase_at
from rollout import make_engine
from rollout.options import engine_options


def prefix_len_for(ratio: float, seq_len: int) -> int:
    """Real prefix tokens per sequence: round(ratio · T), at most T − 1 (one token generated)."""
    return min(int(round(ratio * seq_len)), seq_len - 1)


def keyed_seed(*keys: int) -> int:
    """A 62-bit seed from integer keys (seed, batch id, ...), independent of call order."""
    digest = hashlib.blake2b(repr(tuple(int(k) for k in keys)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


PREFIX_KEY = 0x5052   # keyed_seed's third key for the prefix-ratio choice ("PR")


def batch_prefix_len(cfg: RunConfig, batch_id: int, seq_len: int, step: int = 0) -> int:
    """Real prefix tokens of training batch `batch_id` at learner step `step`: one of the step's
    phase's prefix ratios (opd/distill/phases.py; the run's `data.prefix_ratios`, or `data.prefix_ratio`
    when no spread is set), chosen by (run.seed, batch id).  Keyed, so the reference loop and
    every Ray worker agree, also after a resume or a re-issue."""
    ratios = phase_at(cfg, step).prefix_ratios
    ratio = ratios[keyed_seed(cfg.run.seed, batch_id, PREFIX_KEY) % len(ratios)]
    return prefix_len_for(ratio, seq_len)


def build_objective(cfg: RunConfig, step: int = 0) -> Objective:
    """The objective of learner step `step` with its knobs (its phase's settings over distill.*
    and distill.objective_options; opd/distill/phases.py)."""
    return objective_at(cfg, step)


def batch_source(objective: Objective, step: int, seed: int) -> str:
    """Where step `step`'s sequences come from: "student", "data" or "teacher"."""
    return objective.choose_source(step, seed)


def build_engine(cfg: RunConfig, engine: str | None = None):
    """The configured rollout engine: the `rollout.*` options it takes (opd.config.schema
    ENGINE_KEYS, rollout.options.engine_options), the others left out.  `rollout.window:
    auto` is HB-SJD's window policy; another Jacobi engine named here runs its default W."""
    name = engine or cfg.rollout.engine
    takes = engine_options(name)
    options = cfg.rollout.engine_options(takes)
    if options.get("window") == "auto" and name != "hbsjd":
        options["window"] = takes["window"]
    if "calibration" in takes:                      # gamma=auto: measured once, under the lock
        options.update(calibration=str(calibration_file()), calibrate_missing=True)
    return make_engine(name, **options)


@dataclass(frozen=True)
class RolloutJob:
    """What a rollout worker needs to produce one trajectory batch."""
    batch_id: int
    labels: Tensor          # (B,) int64
    tokens: Tensor          # (B, T) int64 data sequences (prefix source; the suffix for "data")
    prefix_len: int
    source: str             # "student" | "data" | "teacher"
    seed: int               # run seed; the rollout's RNG key is (seed, batch_id)
    image_ids: Tensor | None = None  # (B,) int64 rows of the prefix batch (None = 0..B-1); a
    #                                  sub-batch keeps its rows' ids so its random numbers match

    @property
    def suffix_len(self) -> int:
        """N: the tokens each row completes after its prefix."""
        return int(self.tokens.shape[1]) - self.prefix_len


def engine_call(model, job: RolloutJob, cfg: RunConfig) -> tuple[tuple, dict]:
    """(args, kwargs) of the engine call (`generate` or `stream`) that completes `job`'s real
    prefixes with `model`: its images keyed by (run seed, batch id) and their image ids."""
    r = cfg.rollout
    P, T = job.prefix_len, job.tokens.shape[1]
    device = next(model.parameters()).device
    return ((model, job.labels.to(device), job.tokens[:, :P].to(device), T - P),
            dict(cfg_scale=r.cfg_scale, temperature=r.temperature, top_k=r.top_k or None,
                 top_p=r.top_p, seed=keyed_seed(job.seed, job.batch_id),
                 image_ids=job.image_ids, slots=r.slots or None))


def ar_timed(job: RolloutJob, cfg: RunConfig) -> bool:
    """Whether `job`'s student rollout call is run by Cached AR in place of the engine, timed,
    for the summary's `rollout_vs_ar` (`rollout.compare_every` n: the n-th batch, the 2n-th,
    ..., batch ids n - 1, 2n - 1, ...; so a run of fewer than n steps runs the engine only).
    Greedy and sample decoding commit the same tokens and spans in every engine (log-probs to
    float32 rounding), so the run trains the same; Cached AR's seconds depend on a call's
    shape, not its tokens, so they price every call of that shape, and they are taken in the
    engine's place in the step.  A second call run beside the engine's is not: run before
    it, the engine's call after it took 0.81 of the engine's calls of the same shape (a step's
    first call shares the CPUs with the step before's tail); run after it, Cached AR took
    1.2-1.3 of its calls in the engine's place (docs/WINDOW_POLICY.md, "What the summary's
    rollout_vs_ar measured")."""
    r = cfg.rollout
    return bool(r.compare_every and (job.batch_id + 1) % r.compare_every == 0
                and job.source == "student" and r.engine != "cached_ar"
                and r.decoding != "speculative")


def call_engine(engine, job: RolloutJob, cfg: RunConfig):
    """The engine that runs `job`'s rollout call: `engine`, or Cached AR where `ar_timed`
    (with the run's options; one per process, its compiled rounds kept from call to call)."""
    if not ar_timed(job, cfg):
        return engine
    options = cfg.rollout.engine_options(engine_options("cached_ar"))
    return _cached_ar(tuple(sorted(options.items())))


@functools.lru_cache(maxsize=4)
def _cached_ar(options: tuple):
    return make_engine("cached_ar", **dict(options))


def rollout_stats(result, job: RolloutJob, cfg: RunConfig) -> RolloutStats:
    """The statistics of `job`'s rollout call (a `RolloutResult`), against Cached AR's rounds
    (one per token and row batch); a call Cached AR ran (`ar_timed`) carries its seconds as
    `ar_seconds` too."""
    B, N = int(job.labels.shape[0]), int(job.tokens.shape[1]) - job.prefix_len
    slots = cfg.rollout.slots or B
    stats = RolloutStats.of(result, N * -(-B // slots))
    stats.ar_seconds = stats.rollout_seconds if ar_timed(job, cfg) else 0.0
    return stats


def trajectory(job: RolloutJob, rows: Tensor | None, tokens: Tensor, logprobs: Tensor | None,
               policy_version: int, stats: RolloutStats) -> TrajectoryBatch:
    """The trajectory of `job`'s `rows` (None: all) from generated `tokens` (n, T) and, for a
    student rollout, their behaviour log-probs (n, N)."""
    labels = job.labels if rows is None else job.labels[rows]
    keep = logprobs is not None and job.source == "student"
    return TrajectoryBatch(job.batch_id, labels, job.prefix_len, tokens.cpu().clone(),
                           policy_version, job.source, stats,
                           behaviour_logprobs=logprobs.cpu().clone() if keep else None)


def generate(model, engine, job: RolloutJob, cfg: RunConfig, policy_version: int) -> TrajectoryBatch:
    """Complete the real prefixes of `job` with `model` (the student, or the teacher for
    SeqKD).  A "data" job takes its suffix from the dataset and runs no model.  A student
    rollout keeps its tokens' behaviour log-probs (`behaviour_logprobs`, opd/distill/onpolicy.py)
    (the tokens are normal tensors, not inference-mode ones)."""
    if job.source == "data":
        return TrajectoryBatch(job.batch_id, job.labels, job.prefix_len, job.tokens,
                               policy_version, "data", RolloutStats())
    args, kwargs = engine_call(model, job, cfg)
    result = call_engine(engine, job, cfg).generate(*args, **kwargs)
    return trajectory(job, None, result.tokens, result.logprobs, policy_version,
                      rollout_stats(result, job, cfg))


@torch.no_grad()
def teacher_logits(teacher, batch: TrajectoryBatch, *, guided: bool, cfg_scale: float) -> Tensor:
    """(B, L, V) float32 teacher logits of every token of the batch given its predecessors;
    CFG-guided (uncond + (cond − uncond)·scale) when `guided`."""
    device = next(teacher.parameters()).device
    labels, tokens = batch.labels.to(device), batch.tokens.to(device)
    logits = teacher(labels, tokens[:, :-1])
    if guided and cfg_scale != 1.0:
        null = torch.full_like(labels, teacher.num_classes)
        uncond = teacher(null, tokens[:, :-1])
        logits = uncond + (logits - uncond) * cfg_scale
    return logits.float()


def score(teacher, batch: TrajectoryBatch, t: TeacherConfig, cfg_scale: float,
          measure=None) -> TrajectoryBatch:
    """The batch with teacher `t`'s scores (its model `teacher`; guided: at CFG scale
    `cfg_scale`, the run's rollout.cfg_scale) of its suffix positions (P..L-1, the only ones a
    loss reads) attached: float32 full-vocabulary log-probs (B, N, V), or top-k float32
    log-probs (normalised over the full vocabulary) with their token ids in the smallest
    exact integer type (B, N, k) (opd.distill.batch: `teacher_start`, `index_dtype`).
    `measure(logp)`, if given, sees the full (B, N, V) log-probs before any top-k
    (opd/distill/teachers.py: the on-policy KL to this teacher)."""
    start = time.perf_counter()
    logits = teacher_logits(teacher, batch, guided=t.guided, cfg_scale=cfg_scale)
    logp = F.log_softmax(logits[:, batch.prefix_len:], -1).cpu()          # (B, N, V)
    if measure is not None:
        measure(logp)
    if t.transport == "full":
        out = batch.with_teacher(logprobs=logp.contiguous())
    else:
        values, indices = logp.topk(t.topk, dim=-1)
        out = batch.with_teacher(topk_values=values.contiguous(),
                                 topk_indices=indices.to(index_dtype(logp.shape[-1])).contiguous())
    out.rollout_stats.teacher_seconds = time.perf_counter() - start
    return out


def needs_teacher_scores(objective: Objective) -> bool:
    return objective.needs != ("tokens",)


def plain_model(model) -> torch.nn.Module:
    """The module a DeepSpeed engine wraps (`engine.module`), or `model` itself when it is a
    plain module."""
    return getattr(model, "module", model)


def is_ds_engine(model) -> bool:
    """Whether `model` is a DeepSpeed engine (it steps its own optimizer)."""
    return hasattr(model, "zero_optimization_stage")


def student_loss(model, batch: TrajectoryBatch, objective: Objective, *,
                 dropout: bool, check: RunConfig | None = None,
                 autocast: torch.dtype | None = None) -> tuple[Tensor, dict]:
    """The objective on the student's teacher-forced logits of the batch; `model` is the
    student module or the DeepSpeed engine that wraps it (`plain_model`).  With
    `dropout=False` the forward runs in eval mode (no label or residual dropout), so the
    student sees the same conditions as during its rollout and the teacher's scoring.
    `check` (the run config): the metrics also hold the on-policy check of the batch with these
    weights (opd/distill/onpolicy.py), reusing this forward's logits when it ran in eval mode.
    `autocast`: the forwards' autocast dtype (`opd.models.precision.learner_autocast`); the loss itself
    is computed from the float32 logits outside it."""
    model.train(dropout)
    device = next(model.parameters()).device
    batch = batch.to(device)
    with precision.autocast(autocast, device):
        logits = model(batch.labels, batch.tokens[:, :-1])
    loss, metrics = objective.loss(logits, batch)
    if check is not None:
        with precision.autocast(autocast, device):
            gap = logprob_gap(plain_model(model), batch, check, None if dropout else logits)
        metrics = {**metrics, **gap}
    return loss, metrics


def backward_piece(model, piece: TrajectoryBatch, objective: Objective, *, weight: float,
                   dropout: bool, check: RunConfig | None = None,
                   autocast: torch.dtype | None = None) -> dict:
    """Forward and backward of one piece of a step (opd/distill/pieces.py): the objective's loss on the
    piece (its token mean) times `weight`, the piece's share n_p / N of the step's loss tokens,
    so the gradients the pieces accumulate add up to the gradient of the step's token mean (a
    DeepSpeed engine's `backward`, which averages over the R ranks: `weight` R · n_p / N).
    Returns the piece's metrics: its own loss, its tokens n_p, the on-policy check (`check`;
    `autocast` as `student_loss`)."""
    loss, metrics = student_loss(model, piece, objective, dropout=dropout, check=check,
                                 autocast=autocast)
    scaled = loss * weight if weight != 1.0 else loss
    if is_ds_engine(model):
        model.backward(scaled)
    else:
        scaled.backward()
    return {**metrics, "loss": float(loss.detach()), "tokens": float(piece.num_generated_tokens)}


def grad_norm(model: torch.nn.Module) -> float | None:
    """The global L2 norm of `model`'s gradients (the norm of the per-parameter norms, in
    float32); None when no parameter has a gradient."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return None
    return float(torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads])))


def optimizer_step(model, optimizer: torch.optim.Optimizer, *, grad_clip: float,
                   lr: float | None = None) -> float:
    """The update after a step's last backward, at learning rate `lr` (None: the optimizer's);
    returns the gradients' global norm before clipping, and leaves `model` in eval mode with
    its gradients cleared.  Both learners call it:

    - `model` a plain module (the reference learner; `optimizer` a torch optimizer): the
      gradients are clipped to `grad_clip` here (0: not clipped).
    - `model` a DeepSpeed engine (actors/workers/learner.py; `optimizer` its
      `engine.optimizer`): `engine.step()` clips at its `gradient_clipping`, reduces and steps
      at its gradient-accumulation boundary (set by the caller before the last backward) for
      every ZeRO stage, and clears the gradients.  The norm is `grad_norm` of the module under
      ZeRO 0 (where DeepSpeed records none), else DeepSpeed's `get_global_grad_norm()` (NaN
      when it has none)."""
    if lr is not None:
        set_learning_rate(optimizer, lr)
    if is_ds_engine(model):
        norm = grad_norm(model.module) if model.zero_optimization_stage() == 0 else None
        model.step()
        if norm is None:
            g = model.get_global_grad_norm()
            norm = float(g) if g is not None else float("nan")
    else:
        if grad_clip > 0:
            params = [p for p in model.parameters() if p.grad is not None]
            norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
        else:
            norm = grad_norm(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    return float(norm)


def learn(model, optimizer, pieces: TrajectoryBatch | list[TrajectoryBatch],
          objective: Objective, *, grad_clip: float, dropout: bool, lr: float | None = None,
          check: RunConfig | None = None, autocast: torch.dtype | None = None) -> dict:
    """One optimizer step on a scored batch, or on its pieces accumulated in order (the
    reference learner, `model` the student module; the DeepSpeed learner does the same through
    its engine, piece by piece as they arrive, with the same `optimizer_step`).  Returns the objective's metrics over the step (token means), tokens,
    grad_norm, and the on-policy check with `check` (see `student_loss`; `autocast` as there)."""
    pieces = [pieces] if isinstance(pieces, TrajectoryBatch) else pieces
    total = sum(p.num_generated_tokens for p in pieces)
    optimizer.zero_grad(set_to_none=True)
    results = [backward_piece(model, p, objective, weight=p.num_generated_tokens / total,
                              dropout=dropout, check=check, autocast=autocast) for p in pieces]
    norm = optimizer_step(model, optimizer, grad_clip=grad_clip, lr=lr)
    return {**combine_metrics(results), "grad_norm": norm}


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def make_optimizer(student, cfg: RunConfig) -> torch.optim.Optimizer:
    learner = cfg.learner
    return torch.optim.AdamW(student.parameters(), lr=learner.lr, weight_decay=learner.weight_decay,
                             betas=tuple(learner.betas))
