"""Class-balanced sampling from scratch with a chosen rollout engine, and decoding to pixels.

    labels = balanced_labels(100, 10)                  # 0 1 2 … 9 0 1 2 … (10 per class)
    s = sample_images(model, cfg, 100)                 # engine, decoding from cfg.eval / rollout
    s.tokens   (N, T) int64      s.images  (N, 3, H, W) uint8      s.stats  rounds, commits, …

Every image is generated from prefix length 0 (class token only).  Its random numbers are keyed
by (eval.seed, image index), so a sample set does not depend on the batch size or the engine's
execution mode, and the same seed gives the same tokens.

Decoding for evaluation: `eval.decoding` (default "sample") chooses greedy or probabilistic
verification; None uses `rollout.decoding`.  Quality metrics are computed on *samples* in the
field (LlamaGen: temperature 1.0, top-k 0, top-p 1.0): greedy decoding from scratch gives one
image per class, so diversity-sensitive metrics (FID, recall, IS) are poor by construction.
Temperature, top-k, top-p and the CFG scale are the run's `rollout.*` settings.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor
from tqdm import tqdm

from rollout.calibrate import calibration_file
from opd.config.schema import RunConfig
from opd.config.loader import ConfigError
from opd.distill.steps import build_engine


def balanced_labels(num_samples: int, num_classes: int) -> Tensor:
    """(N,) int64 labels i mod C: classes cycle in a fixed order, so every class gets ⌊N/C⌋
    or ⌈N/C⌉ images (the first N mod C classes one more) and a grid of C columns shows one
    class per column."""
    if num_samples < 1 or num_classes < 1:
        raise ValueError(f"need num_samples >= 1 and num_classes >= 1, got {num_samples}, {num_classes}")
    return torch.arange(num_samples, dtype=torch.long) % num_classes


def eval_decoding(cfg: RunConfig) -> str:
    """The decoding evaluation samples with: eval.decoding, else rollout.decoding."""
    return cfg.eval.decoding or cfg.rollout.decoding


def eval_engine_name(cfg: RunConfig) -> str:
    """The engine evaluation samples with: eval.engine, else rollout.engine."""
    return cfg.eval.engine or cfg.rollout.engine


def sampling_config(cfg: RunConfig, *, engine: str | None = None,
                    decoding: str | None = None) -> RunConfig:
    """A copy of `cfg` whose rollout section samples as evaluation does: the engine and decoding
    given (else `eval_engine_name`, `eval_decoding`).  `rollout.gamma='auto'` without the
    calibration file (`rollout.calibrate.calibration_file()`) becomes the engine's uncalibrated
    default: execution (and so gamma) never changes the tokens (invariant 3,
    docs/ARCHITECTURE.md), only the speed."""
    r = cfg.rollout
    gamma = r.gamma
    if gamma == "auto" and not calibration_file().is_file():
        gamma = None
    rollout = dataclasses.replace(r, engine=engine or eval_engine_name(cfg),
                                  decoding=decoding or eval_decoding(cfg), gamma=gamma)
    return dataclasses.replace(cfg, rollout=rollout)


@dataclass
class Samples:
    """What `sample_tokens` / `sample_images` return."""
    labels: Tensor                  # (N,) int64 class of each image
    tokens: Tensor                  # (N, T) int64 image tokens, T = grid_size ** 2
    stats: dict                     # engine, decoding, rounds, mean_committed, seconds, …
    images: Tensor | None = None    # (N, 3, H, W) uint8 once decoded
    seconds: dict = field(default_factory=dict)


@torch.no_grad()
def sample_tokens(model, cfg: RunConfig, num_samples: int, *, engine: str | None = None,
                  decoding: str | None = None, seed: int | None = None,
                  batch_size: int | None = None, progress: bool = False) -> Samples:
    """`num_samples` class-balanced images generated from scratch by `model`.

    engine / decoding / seed / batch_size default to eval.engine (else rollout.engine),
    eval.decoding (else rollout.decoding), eval.seed and eval.batch_size.  Image i has label
    i mod C and RNG key (seed, i).  stats: engine, decoding, the engine's options, rounds
    (sequential forwards summed over batches), mean_committed (tokens per image per active
    round), accepted, rejected, generated_tokens, sampling_seconds, tokens_per_s.
    """
    scfg = sampling_config(cfg, engine=engine, decoding=decoding)
    eng = build_engine(scfg)
    r, e = scfg.rollout, cfg.eval
    seed = e.seed if seed is None else seed
    batch_size = batch_size or e.batch_size
    labels = balanced_labels(num_samples, model.num_classes)
    T = model.block_size
    device = next(model.parameters()).device
    chunks, rounds, accepted, rejected, commits, image_rounds, wall = [], 0, 0, 0, 0, 0, 0.0
    starts = range(0, num_samples, batch_size)
    for start in tqdm(starts, desc=f"eval samples ({r.engine}, {r.decoding})", disable=not progress,
                      dynamic_ncols=True):
        end = min(start + batch_size, num_samples)
        ids = torch.arange(start, end, dtype=torch.long, device=device)
        res = eng.generate(model, labels[start:end].to(device), None, T, cfg_scale=r.cfg_scale,
                           temperature=r.temperature, top_k=r.top_k or None, top_p=r.top_p,
                           seed=seed, image_ids=ids)
        chunks.append(res.tokens.cpu().clone())
        rounds += res.rounds
        accepted += int(res.accepted.sum())
        rejected += int(res.rejected.sum())
        commits += int(res.committed.sum())
        image_rounds += int(res.image_rounds.sum())
        wall += res.wall_time
    tokens = torch.cat(chunks)
    stats = {"engine": r.engine, "decoding": r.decoding, "options": dict(eng.options),
             "cfg_scale": r.cfg_scale, "temperature": r.temperature, "top_k": r.top_k,
             "top_p": r.top_p, "seed": seed, "batch_size": batch_size,
             "rounds": rounds, "mean_committed": commits / max(1, image_rounds),
             "accepted": accepted, "rejected": rejected, "generated_tokens": int(tokens.numel()),
             "sampling_seconds": wall, "tokens_per_s": tokens.numel() / wall if wall > 0 else 0.0}
    return Samples(labels, tokens, stats)


def is_digits(cfg: RunConfig) -> bool:
    """Tokens are digits grey levels (no VQ tokenizer): the embedded default."""
    return cfg.model.vq_ckpt is None and cfg.data.dataset == "digits"


class ImageDecoder:
    """tokens (N, grid²) → uint8 pixels (N, 3, H, W): the digits codec, or LlamaGen's VQ-16
    decoder from `model.vq_ckpt` (loaded once, on `device`)."""

    def __init__(self, cfg: RunConfig, device: str | torch.device = "cpu", batch_size: int = 32):
        from opd.models.vq import DigitsDecoder, load_vq_checkpoint

        self.batch_size = batch_size
        self.device = torch.device(device)
        m = cfg.model
        if is_digits(cfg):
            self.vq, self.digits = None, DigitsDecoder(m.grid_size)
            return
        if m.vq_ckpt is None:
            raise ConfigError(f"model.vq_ckpt is not set: data.dataset={cfg.data.dataset!r} tokens are "
                              f"VQ codes and need the VQ-16 tokenizer to become images; set "
                              f"model.vq_ckpt=/path/to/vq_ds16_c2i.pt", "model.vq_ckpt")
        self.digits = None
        self.vq = load_vq_checkpoint(m.vq_ckpt, device=self.device)

    @torch.no_grad()
    def __call__(self, tokens: Tensor) -> Tensor:
        if self.digits is not None:
            return self.digits.decode_uint8(tokens.cpu())
        from opd.models.vq import to_uint8
        out = []
        for start in range(0, tokens.shape[0], self.batch_size):
            codes = tokens[start:start + self.batch_size].to(self.device)
            out.append(to_uint8(self.vq.decode_codes(codes)).cpu())
        return torch.cat(out)


def sample_images(model, cfg: RunConfig, num_samples: int, *, decoder: ImageDecoder | None = None,
                  progress: bool = False, **options) -> Samples:
    """`sample_tokens(model, cfg, num_samples, **options)` decoded to uint8 images."""
    decoder = decoder or ImageDecoder(cfg, next(model.parameters()).device)
    s = sample_tokens(model, cfg, num_samples, progress=progress, **options)
    t0 = time.perf_counter()
    s.images = decoder(s.tokens)
    s.seconds = {"sampling": s.stats["sampling_seconds"], "decoding": time.perf_counter() - t0}
    return s
