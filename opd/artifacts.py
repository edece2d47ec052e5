"""What a run leaves for a person to look at: sample grids and a training plot (PNG).

- `samples/teacher.png` once, `samples/student_step_<n>.png` at every checkpoint: one image
  per class (up to 10 classes, two rows), generated from the class token alone with the
  configured rollout engine, sampling at temperature 1 with fixed RNG keys (comparable across
  steps; greedy decoding of digits from the class token alone mostly paints background).
- `training.png`: loss and rollout speed (generated tokens / s) over steps.
Digits tokens are grey levels; LlamaGen tokens are decoded with the VQ-16 decoder when
`model.vq_ckpt` is set (otherwise no grid is drawn).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from opd.config import RunConfig
from opd.data import digits_tokens_to_images
from opd.eval.grid import save_grid
from opd.steps import build_engine


def tokens_to_images(tokens: torch.Tensor, cfg: RunConfig, vq=None) -> torch.Tensor | None:
    """(N, T) image tokens -> (N, 3, H, W) uint8, or None when no decoder is available."""
    if cfg.data.dataset == "digits":
        grey = torch.from_numpy(digits_tokens_to_images(tokens.cpu().numpy()))
        return grey[:, None].expand(-1, 3, -1, -1).contiguous()
    if vq is not None:
        from opd.models.vq import to_uint8
        with torch.no_grad():
            return to_uint8(vq.decode_codes(tokens.to(next(vq.parameters()).device))).cpu()
    return None


@torch.no_grad()
def sample_grid(model, cfg: RunConfig, path: Path, *, per_class: int = 2, seed: int = 0,
                vq=None) -> Path | None:
    """Generate `per_class` images for each of the first 10 classes and save them as a PNG."""
    classes = min(10, model.num_classes)
    labels = torch.arange(classes).repeat(per_class)
    from dataclasses import replace
    engine = build_engine(replace(cfg, rollout=replace(cfg.rollout, decoding="sample")))
    device = next(model.parameters()).device
    result = engine.generate(model, labels.to(device), None, model.block_size,
                             cfg_scale=cfg.rollout.cfg_scale, seed=seed)
    images = tokens_to_images(result.tokens, cfg, vq)
    if images is None:
        return None
    upscale = max(1, 64 // images.shape[-1])
    return save_grid(images, path, nrow=classes, upscale=upscale)


def start_pictures(cfg: RunConfig, run_dir: Path) -> None:
    """samples/teacher.png and samples/student_step_000000.png before a run starts (the Ray
    pipeline's student grids over training are follow-up work; the reference loop draws them
    at every checkpoint)."""
    from opd.pretrain import load_role_model
    for role in ("teacher", "student"):
        name = "teacher.png" if role == "teacher" else "student_step_000000.png"
        sample_grid(load_role_model(cfg, role), cfg, Path(run_dir) / "samples" / name)


def plot_training(rows: list[dict], path: Path) -> Path | None:
    """Loss and rollout tokens/s over steps (two panels)."""
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.array([r["step"] for r in rows])
    loss = np.array([r.get("loss") or np.nan for r in rows], dtype=float)
    speed = np.array([r.get("rollout_tokens_per_s") or np.nan for r in rows], dtype=float)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.plot(steps, loss, lw=1)
    a.set(xlabel="step", ylabel="loss", title="distillation loss")
    b.plot(steps, speed, lw=1, color="tab:green")
    b.set(xlabel="step", ylabel="generated tokens / s", title="rollout speed")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
