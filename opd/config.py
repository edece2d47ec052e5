"""Run configuration: nested dataclasses are the schema, YAML presets and dotted overrides set it.

    cfg = load_config("tiny", ["rollout.window=8", "learner.betas=[0.9,0.99]"])
    cfg.rollout.window            # 8

A run config is built in three layers, later ones winning: the dataclass defaults (the
embedded digits setup), a YAML preset from `configs/` (or any path), then `key=value`
overrides whose values are parsed as YAML scalars (`null`, `true`, `1e-3`, `[0.9, 0.99]`).
Everything is validated once, on load, before anything starts: unknown keys (with the
closest valid key suggested), wrong types, out-of-range or not-allowed values and
cross-field constraints raise `ConfigError` naming the full dotted key and the value.

Adding a field is one line plus its docstring: `name: type = default`, or
`name: type = bounded(default, ge=..., lt=...)` for a numeric range. Supported types:
bool, int, float, str, `Literal[...]`, `X | None`, unions, `tuple[...]`, `list[X]`,
`dict[str, Any]` (free-form, validated by its user). Cross-field rules are functions
decorated with `@cross_check`.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import math
import re
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Union, get_args, get_origin, get_type_hints

import yaml

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
"""The repository's preset directory: `--config tiny` means `CONFIG_DIR / "tiny.yaml"`."""

EXTENDS_KEY = "extends"
"""Top-level preset key naming a base preset that the file is merged over."""


class ConfigError(ValueError):
    """A configuration a user wrote is invalid; the message is one line naming key and value."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


def bounded(default: Any, *, ge: float | None = None, gt: float | None = None,
            le: float | None = None, lt: float | None = None, span: bool = False) -> Any:
    """A dataclass field with a numeric range, checked on load (also for each tuple element).

    span=True also accepts a string "min..max" for a `tuple[int, int]` member (parsed to
    (min, max), min <= max)."""
    meta = {k: v for k, v in dict(ge=ge, gt=gt, le=le, lt=lt).items() if v is not None}
    if span:
        meta["span"] = True
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------

DType = Literal["float32", "bfloat16", "float64"]
Engine = Literal["hbsjd", "cached_ar", "sjd_sync", "sjd_independent"]


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


@dataclass
class RolloutConfig:
    """Student rollout workers and their decoding engine."""

    engine: Engine = "hbsjd"
    """Rollout engine: HB-SJD, Cached AR, batch-synchronous SJD or independent batched SJD."""
    num_workers: int | tuple[int, int] = bounded(1, ge=1, span=True)
    """Rollout workers: a count, or "min..max" for an elastic pool grown and shrunk in that range."""
    window: int = bounded(4, ge=1)
    """Jacobi window W: tokens per verifier forward (the last committed token + W-1 drafts)."""
    history_offset: int | None = bounded(None, ge=1)
    """Draft-initialization history offset H in tokens; None = one grid row (grid_size)."""
    decoding: Literal["greedy", "sample"] = "sample"
    """Greedy verification (lossless vs greedy AR) or probabilistic (sampling) verification."""
    refresh: Literal["coupled", "resample"] = "coupled"
    """Sampled drafts after the commit point: kept by maximal coupling with their new distribution, or redrawn (both lossless)."""
    slots: int = bounded(0, ge=0)
    """Physical rows of a rollout call (continuous batching: a waiting image takes the row of one that finished); 0 = all of the call's images at once."""
    compile: bool = False
    """torch.compile the Full-execution verifier forward (CUDA graphs on a GPU); on a CPU it speeds Cached AR up more than HB-SJD (README, Rollouts)."""
    execution: Literal["full", "compact", "hybrid"] = "hybrid"
    """Physical batch: keep all rows (full), gather active rows (compact), or switch at gamma."""
    gamma: int | Literal["auto"] = bounded("auto", ge=0)
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
    sub_batches: int = bounded(0, ge=0)
    """Parts a step's prefix batch is split into across workers (Ray); 0 = one per worker of the larger pool (rollout or teacher)."""
    elastic_grow_wait: float = bounded(0.5, gt=0.0, le=1.0)
    """Elastic pool ("min..max"): add a worker after steps where the learner waited on student rollouts for at least this fraction of the step."""
    elastic_shrink_wait: float = bounded(0.1, ge=0.0, le=1.0)
    """Elastic pool: a step where the learner waited on rollouts for less than this fraction is idle for the rollout workers."""
    elastic_patience: int = bounded(2, ge=1)
    """Elastic pool: steps in a row at or over elastic_grow_wait before a worker is added."""
    elastic_idle_steps: int = bounded(5, ge=1)
    """Elastic pool: idle steps in a row before an added worker is retired (never below min)."""


@dataclass
class TeacherConfig:
    """Teacher workers that score the student-visited states."""

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


@dataclass
class DistillConfig:
    """The distillation objective and the on-policy schedule."""

    objective: Literal["gkd", "varkd", "kd", "seqkd"] = "kd"
    """Objective registered by name in opd's objectives.  The digits default is `kd` (forward KL
    to the teacher on data sequences): of KD, SeqKD and GKD at lambda 0, 0.25 and 1 it closed
    the most of the teacher-student gap at 600 steps (README, "What opd train does")."""
    steps: int = bounded(600, ge=1)
    """Learner steps."""
    beta: float = bounded(0.5, ge=0.0, le=1.0)
    """GKD generalized-JSD interpolation: 0 = forward KL(P||Q), 1 = reverse KL(Q||P)."""
    lam: float = bounded(1.0, ge=0.0, le=1.0)
    """On-policy fraction lambda: probability that a batch is student-generated (else data)."""
    temperature: float = bounded(1.0, gt=0.0)
    """Softmax temperature of teacher and student logits in the loss."""
    staleness: int = bounded(0, ge=0)
    """Max policy-version lag of consumed trajectories; 0 = strict on-policy."""
    broadcast_every: int = bounded(1, ge=1)
    """Publish student weights to rollout workers every this many steps."""
    queue_capacity: int = bounded(4, ge=1)
    """Prefix batches buffered between rollout/teacher workers and the learner (Ray pipeline backpressure)."""
    objective_options: dict[str, Any] = field(default_factory=dict)
    """Objective-specific options (e.g. VarKD gates), validated by the objective."""


@dataclass
class PretrainConfig:
    """Pretraining of the embedded teacher and student when no checkpoint is given."""

    teacher_steps: int = bounded(1500, ge=0)
    """Teacher pretraining steps (digits: class accuracy of its samples ~0.93, FID ~60)."""
    student_steps: int = bounded(250, ge=0)
    """Student pretraining steps (short: distillation has room to improve it)."""
    batch_size: int = bounded(32, ge=1)
    """Pretraining batch size."""
    lr: float = bounded(2e-3, gt=0.0)
    """Pretraining AdamW learning rate (peak; warm-up, then linear decay to 10 %)."""
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
    every: int = bounded(100, ge=0)
    """Evaluate the student during training every this many learner steps, besides step 0 and the last step; 0 = only step 0 and the last step."""
    num_samples: int = bounded(200, ge=1)
    """Images generated per evaluation."""
    extractor: Literal["digits-cnn", "inception-v3-compat"] = "digits-cnn"
    """Feature extractor: a small CNN for digits, or torch-fidelity's Inception (needs inception_weights offline)."""
    inception_weights: str | None = None
    """Local Inception weights file for the inception-v3-compat extractor."""
    engine: Engine | None = None
    """Engine used to sample evaluation images; None = rollout.engine."""
    decoding: Literal["greedy", "sample"] | None = "sample"
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
    name: str = "digits-gkd"
    """Run name."""
    seed: int = 0
    """Global seed (data order, rollouts, initialization)."""
    mode: Literal["ray", "reference"] = "ray"
    """`ray`: the distributed pipeline; `reference`: the single-process reference loop."""
    checkpoint_every: int = bounded(200, ge=0)
    """Checkpoint every this many steps; 0 = only at the end."""
    log_every: int = bounded(1, ge=1)
    """Log metrics every this many steps."""


@dataclass
class RunConfig:
    """Everything one `opd` run needs; saved as config.yaml in the run directory."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
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
def _teacher_topk(cfg: RunConfig) -> None:
    k, v = cfg.teacher.topk, cfg.model.vocab_size
    if cfg.teacher.transport == "topk" and not 1 <= k <= v:
        raise ConfigError(f"teacher.topk={k}: teacher.transport='topk' needs 1 <= teacher.topk "
                          f"<= model.vocab_size ({v})", "teacher.topk")


@cross_check
def _rollout_top_k(cfg: RunConfig) -> None:
    if cfg.rollout.top_k > cfg.model.vocab_size:
        raise ConfigError(f"rollout.top_k={cfg.rollout.top_k}: must be <= model.vocab_size "
                          f"({cfg.model.vocab_size}); 0 turns top-k off", "rollout.top_k")


@cross_check
def _worker_span(cfg: RunConfig) -> None:
    n = cfg.rollout.num_workers
    if isinstance(n, tuple) and n[0] > n[1]:
        raise ConfigError(f"rollout.num_workers='{n[0]}..{n[1]}': min must be <= max",
                          "rollout.num_workers")


@cross_check
def _history_offset(cfg: RunConfig) -> None:
    h, t = cfg.rollout.history_offset, cfg.model.grid_size ** 2
    if h is not None and h >= t:
        raise ConfigError(f"rollout.history_offset={h}: must be < the sequence length "
                          f"model.grid_size ** 2 ({t})", "rollout.history_offset")


# --------------------------------------------------------------------------------------------
# Loading, validation, serialization
# --------------------------------------------------------------------------------------------

RETIRED_KEYS = {
    "run.deterministic": "runs are always reproducible (keyed random numbers, seeded "
                         "initialization), so the key did nothing; drop it",
    "run.resume": "continue a run with opd train --resume RUN_DIR",
}
"""Keys that earlier versions wrote into config.yaml but nothing read: a run directory's old
config.yaml still loads (they are dropped); setting one names what to do instead."""

RESUME_SAFE_KEYS = ("distill.steps", "run.checkpoint_every", "run.log_every", "eval.")
"""What `opd train --resume RUN key=value` may change: how long the run goes on (a new
distill.steps also stretches the learning-rate decay from the resumed step on), how often it
checkpoints and logs, and its evaluations (a key ending in "." is a section).  Anything else
would make the resumed steps another run's."""


def check_resume_overrides(overrides: list[str] | tuple[str, ...]) -> None:
    """ConfigError naming the first override that a resumed run may not change."""
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if not any(key == k or (k.endswith(".") and key.startswith(k))
                   for k in RESUME_SAFE_KEYS):
            raise ConfigError(f"--resume cannot change {key}: the resumed steps would be another "
                              f"run's; only distill.steps, run.checkpoint_every, run.log_every "
                              f"and eval.* change on resume (start a new run for the rest)", key)


def _drop_retired(tree: dict[str, Any]) -> None:
    for key in RETIRED_KEYS:
        section, name = key.split(".")
        if isinstance(tree.get(section), dict):
            tree[section].pop(name, None)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Defaults, then the YAML preset `path` (a name in configs/ or a file), then `key=value`
    overrides; validated. Raises ConfigError on any problem."""
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key in RETIRED_KEYS:
            raise ConfigError(f"config key '{key}' was removed: {RETIRED_KEYS[key]}", key)
    tree: dict[str, Any] = {}
    if path is not None:
        preset = resolve_preset(path)
        tree = _read_preset(preset, seen=())
        _drop_retired(tree)
        try:
            _from_dict(RunConfig, tree, "")
        except ConfigError as e:
            raise ConfigError(f"{preset}: {e}", e.key) from None
    _apply_overrides(tree, overrides)
    return config_from_dict(tree)


def apply_overrides(cfg: RunConfig, overrides: list[str] | tuple[str, ...]) -> RunConfig:
    """A validated copy of `cfg` with dotted `key=value` overrides applied."""
    tree = config_to_dict(cfg)
    _apply_overrides(tree, overrides)
    return config_from_dict(tree)


def config_from_dict(tree: dict[str, Any]) -> RunConfig:
    """Build and validate a RunConfig from a (partial) nested dict, e.g. one that came over Ray."""
    cfg = _from_dict(RunConfig, tree, "")
    for check in _CROSS_CHECKS:
        check(cfg)
    return cfg


def validate(cfg: RunConfig) -> RunConfig:
    """Check a config built in code (types, ranges, cross-field rules); returns a normalized copy."""
    return config_from_dict(config_to_dict(cfg))


def config_to_dict(obj: Any) -> Any:
    """Nested plain dict of a config (tuples become lists), safe for YAML / JSON / Ray."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: config_to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): config_to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [config_to_dict(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def config_to_yaml(cfg: Any) -> str:
    """The resolved config as YAML; `load_config` of this text gives the same config back."""
    return yaml.dump(config_to_dict(cfg), Dumper=_Dumper, sort_keys=False)


def save_config(cfg: RunConfig, path: str | Path) -> Path:
    """Write the resolved config (YAML) to `path`, creating parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_to_yaml(cfg))
    return path


def config_hash(obj: Any, length: int = 12) -> str:
    """Stable short hex hash of a dataclass or dict (key order and tuple/list do not matter)."""
    text = json.dumps(config_to_dict(obj), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def default_run_dir(cfg: RunConfig, now: float | None = None) -> Path:
    """run.dir, or runs/<run.name>-<YYYYmmdd-HHMMSS> when it is None."""
    if cfg.run.dir is not None:
        return Path(cfg.run.dir)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    return Path("runs") / f"{cfg.run.name}-{stamp}"


NOT_PRESETS = {"cluster"}


def available_presets() -> list[str]:
    """Preset names in CONFIG_DIR (cluster.yaml is the Ray autoscaler's file, not a preset)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if p.stem not in NOT_PRESETS)


def resolve_preset(name: str | Path) -> Path:
    """`tiny`, `tiny.yaml`, `configs/tiny.yaml` or any existing path -> the preset file."""
    p = Path(name).expanduser()
    if p.is_file():
        return p
    candidates = []
    if p.parent == Path(".") or p.parent.name == "configs":
        candidates = [CONFIG_DIR / p.name, CONFIG_DIR / f"{p.name}.yaml"]
    for c in candidates:
        if c.is_file():
            return c
    raise ConfigError(f"config {str(name)!r} not found (looked for {p}"
                      + "".join(f", {c}" for c in candidates)
                      + f"); available presets: {', '.join(available_presets()) or 'none'}")


# --------------------------------------------------------------------------------------------
# Internals
# --------------------------------------------------------------------------------------------

def _read_preset(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    """Parse a preset file, merging it over the preset named by its `extends:` key."""
    if path.resolve() in seen:
        raise ConfigError(f"{path}: '{EXTENDS_KEY}' cycle: "
                          + " -> ".join(str(s) for s in (*seen, path.resolve())))
    try:
        tree = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {' '.join(str(e).split())}") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: a preset must be a mapping of sections, got {type(tree).__name__}")
    base_name = tree.pop(EXTENDS_KEY, None)
    if base_name is None:
        return tree
    base = path.parent / str(base_name)
    base = base if base.is_file() else resolve_preset(str(base_name))
    return _deep_merge(_read_preset(base, (*seen, path.resolve())), tree)


class _Dumper(yaml.SafeDumper):
    """Block-style mappings, flow-style lists (`betas: [0.9, 0.95]`)."""


_Dumper.add_representer(
    list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))


def _apply_overrides(tree: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> None:
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like section.key=value, "
                              f"e.g. rollout.window=8")
        _set_override(tree, key.strip(), raw.strip())


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


@functools.cache
def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _all_keys(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (sections and leaves)."""
    out = []
    hints = _hints(cls)
    for name in _fields(cls):
        key = f"{prefix}{name}"
        out.append(key)
        if dataclasses.is_dataclass(hints[name]):
            out.extend(_all_keys(hints[name], key + "."))
    return out


def _unknown(full_key: str, cls: type, prefix: str, part: str, rest: list[str]) -> ConfigError:
    """Unknown-key error naming the full key and the closest valid one."""
    names = list(_fields(cls))
    close = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
    suggestion = None
    if close:
        suggestion = prefix + close[0] + "".join("." + r for r in rest)
        if suggestion not in _all_keys() and not _is_under_dict(suggestion):
            suggestion = prefix + close[0]
    else:  # the right name in the wrong section: rollout.lr -> learner.lr / pretrain.lr
        leaf = rest[-1] if rest else part
        pool = [k for k in _all_keys() if "." in k]
        match = difflib.get_close_matches(leaf, sorted({k.rsplit(".", 1)[1] for k in pool}),
                                          n=1, cutoff=0.8)
        if match:
            suggestion = "' or '".join(k for k in pool if k.rsplit(".", 1)[1] == match[0])
    where = f"'{prefix[:-1]}'" if prefix else "the config"
    hint = (f"did you mean '{suggestion}'?" if suggestion
            else f"valid keys in {where}: {', '.join(names)}")
    return ConfigError(f"unknown config key '{full_key}'; {hint}", full_key)


def _is_under_dict(key: str) -> bool:
    cls: Any = RunConfig
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return False
        hint = _hints(cls).get(part)
        if hint is None:
            return False
        if get_origin(hint) is dict:
            return True
        cls = hint
    return False


def _set_override(tree: dict[str, Any], key: str, raw: str) -> None:
    """Set tree[a][b]... = value for key "a.b...", checking the path against the schema."""
    parts = key.split(".")
    cls: Any = RunConfig
    node = tree
    for i, part in enumerate(parts):
        prefix = ".".join(parts[:i]) + ("." if i else "")
        last = i == len(parts) - 1
        if part not in _fields(cls):
            raise _unknown(key, cls, prefix, part, parts[i + 1:])
        tp = _hints(cls)[part]
        if dataclasses.is_dataclass(tp):
            if last:
                value = _parse_scalar(raw)
                if not isinstance(value, dict):
                    sub = next(iter(_fields(tp)))
                    raise ConfigError(f"'{key}' is a section; set one of its keys, e.g. "
                                      f"{key}.{sub}=...", key)
                node[part] = _deep_merge(node.get(part) or {}, value)
                return
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise ConfigError(f"'{prefix}{part}' must be a mapping of keys", prefix + part)
            cls = tp
            continue
        if last:
            node[part] = _override_value(raw, tp, _fields(cls)[part].metadata)
            return
        if get_origin(tp) is dict:  # free-form options: a.b.opt=value
            for j, sub in enumerate(parts[i:-1], start=i):
                node = node.setdefault(sub, {})
                if not isinstance(node, dict):
                    where = ".".join(parts[:j + 1])
                    raise ConfigError(f"'{where}' holds {node!r}, not a mapping; cannot set {key}",
                                      where)
            node[parts[-1]] = _parse_scalar(raw)
            return
        raise ConfigError(f"'{prefix}{part}' is a value, not a section; set {prefix}{part}=VALUE",
                          prefix + part)


def _parse_scalar(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw


def _override_value(raw: str, tp: Any, meta: Any) -> Any:
    """YAML-parse an override; a field that takes text gets the raw text if the parse does not fit
    (run.name=1.10 stays "1.10", not 1.1)."""
    value = _parse_scalar(raw)
    if value is None or isinstance(value, str) or not _accepts_str(tp):
        return value
    try:
        _convert(value, tp, meta)
        return value
    except _Mismatch:
        return raw


def _accepts_str(tp: Any) -> bool:
    if tp is str or tp is Any:
        return True
    origin = get_origin(tp)
    if origin is Literal:
        return any(isinstance(a, str) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return any(_accepts_str(a) for a in get_args(tp))
    return False


class _Mismatch(Exception):
    """Value does not have the expected type (turned into a ConfigError with the key)."""


_NONE_WORDS = ("None", "none", "null", "~")
_SPAN = re.compile(r"^\s*(\d+)\s*\.\.\s*(\d+)\s*$")


def _convert(value: Any, tp: Any, meta: Any) -> Any:
    """Value converted to type tp, or _Mismatch."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if tp is type(None):
        if value is None or (isinstance(value, str) and value in _NONE_WORDS):
            return None
        raise _Mismatch
    if origin in (Union, types.UnionType):
        if type(None) in args and (value is None or (isinstance(value, str) and value in _NONE_WORDS)):
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, meta)
            except _Mismatch:
                pass
        raise _Mismatch
    if origin is Literal:
        for a in args:
            if type(a) is type(value) and a == value:
                return a
        raise _Mismatch
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out = float(value)
        elif isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as text
            try:
                out = float(value)
            except ValueError:
                raise _Mismatch from None
        else:
            raise _Mismatch
        if math.isnan(out):
            raise _Mismatch
        return out
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        raise _Mismatch
    if origin is tuple:
        if isinstance(value, str):
            m = _SPAN.match(value)
            if meta.get("span") and m:
                value = [int(m.group(1)), int(m.group(2))]
            elif "," in value:
                value = [_parse_scalar(v.strip()) for v in value.split(",")]
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], meta) for v in value)
        if len(value) != len(args):
            raise _Mismatch
        return tuple(_convert(v, a, meta) for v, a in zip(value, args))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        return [_convert(v, args[0], meta) for v in value] if args else list(value)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _Mismatch
        return dict(value)
    raise TypeError(f"config schema uses an unsupported type {tp!r}")


def _describe(tp: Any, meta: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if tp is type(None):
        return "null"
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a, meta) for a in args)
    if origin is Literal:
        return repr(args[0]) if len(args) == 1 else "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        items = [a for a in args if a is not Ellipsis]
        n = "" if Ellipsis in args else f"{len(args)} "
        inner = (f"a list of {n}{_describe(items[0], meta)}s" if len(set(items)) == 1
                 else f"a list of {n}" + " / ".join(_describe(a, meta) for a in items))
        return inner + (" or a 'min..max' string" if meta.get("span") else "")
    if origin is list:
        return "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    return {bool: "bool (true/false)", int: "int", float: "float", str: "str"}.get(tp, repr(tp))


def _range_text(meta: Any) -> str:
    ops = [(">=", "ge"), (">", "gt"), ("<=", "le"), ("<", "lt")]
    return " and ".join(f"{op} {meta[k]:g}" for op, k in ops if k in meta)


def _check_range(key: str, value: Any, raw: Any, meta: Any) -> None:
    """Range check of a converted value; the message shows the value as the user wrote it."""
    nums = value if isinstance(value, tuple) else (value,)
    for x in nums:
        if not isinstance(x, (int, float)) or isinstance(x, bool):
            continue
        ok = (("ge" not in meta or x >= meta["ge"]) and ("gt" not in meta or x > meta["gt"])
              and ("le" not in meta or x <= meta["le"]) and ("lt" not in meta or x < meta["lt"]))
        if not ok:
            shown = _show(value) if isinstance(raw, (list, tuple)) else repr(raw)
            raise ConfigError(f"{key}={shown}: must be {_range_text(meta)}", key)


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value)


def _from_dict(cls: type, data: Any, prefix: str) -> Any:
    """Instantiate dataclass `cls` from a partial nested dict; every key and value checked."""
    section = prefix[:-1] if prefix else "the config"
    if not isinstance(data, dict):
        raise ConfigError(f"'{section}' must be a mapping of keys, got {data!r}", prefix[:-1] or None)
    fields, hints = _fields(cls), _hints(cls)
    kwargs = {}
    for name, value in data.items():
        name = str(name)
        key = prefix + name
        if name not in fields:
            raise _unknown(key, cls, prefix, name, [])
        tp, meta = hints[name], fields[name].metadata
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _from_dict(tp, {} if value is None else value, key + ".")
            continue
        try:
            out = _convert(value, tp, meta)
        except _Mismatch:
            if get_origin(tp) is Literal:
                raise ConfigError(f"{key}={value!r}: must be one of "
                                  + ", ".join(repr(a) for a in get_args(tp)), key) from None
            raise ConfigError(f"{key}={value!r}: expected {_describe(tp, meta)}", key) from None
        _check_range(key, out, value, meta)
        kwargs[name] = out
    return cls(**kwargs)
