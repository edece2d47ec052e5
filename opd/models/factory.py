"""The teacher and student a run starts from (`load_role_model`), and their supervised
next-token pretraining.

`opd pretrain` trains the embedded default's teacher and student on the digits data; results are
cached under `$OPD_CACHE` (default `~/.cache/opd`) by a hash of everything that determines them
(preset, model shape, data file, pretraining settings), so `opd train` reuses them.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from rollout.calibrate import cache_root
from opd.config.schema import RunConfig, TeacherConfig
from opd.config.files import config_hash
from opd.data import PrefixBatcher, TokenDataset, dataset_stats
from opd.data.splits import data_paths, open_dataset
from opd.models import (GPT, CheckpointError, create_model, load_llamagen_checkpoint,
                        load_state_dict_safely)
from opd.models.safe_load import load_into

ROLES = ("teacher", "student")


def model_overrides(cfg: RunConfig) -> dict:
    m = cfg.model
    return dict(vocab_size=m.vocab_size, num_classes=m.num_classes, grid_size=m.grid_size)


def train_supervised(model: GPT, dataset: TokenDataset, *, steps: int, batch_size: int,
                     lr: float, seed: int, weight_decay: float = 0.05, grad_clip: float = 1.0,
                     desc: str = "pretrain", progress: bool = True) -> list[float]:
    """Cross-entropy next-token training with class dropout (the model's class_dropout_prob)
    and AdamW (LlamaGen's betas).  Returns the per-step losses."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay,
                            betas=(0.9, 0.95), fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, steps // 20)) * (0.1 + 0.9 * (1 - s / steps)))
    batches = PrefixBatcher(dataset, min(batch_size, dataset.num_rows), seed)
    model.train()
    losses = []
    bar = tqdm(range(steps), desc=desc, disable=not progress, dynamic_ncols=True)
    for _ in bar:
        b = next(batches)
        logits = model(b.labels, b.tokens[:, :-1])                    # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), b.tokens.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return losses


@torch.no_grad()
def heldout_nll(model: GPT, dataset: TokenDataset, batch_size: int = 256) -> float:
    """Mean conditional negative log-likelihood per image token (nats), eval mode."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, dataset.num_rows, batch_size):
        labels = torch.from_numpy(dataset.labels[start:start + batch_size])
        tokens = torch.from_numpy(dataset.tokens[start:start + batch_size])
        logits = model(labels, tokens[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), tokens.flatten(), reduction="sum").item()
        count += tokens.numel()
    model.train(was_training)
    return total / count


def role_preset(cfg: RunConfig, role: str, teacher: TeacherConfig | None = None) -> str:
    """The model preset of the student, or of teacher `teacher` (an entry of cfg.teachers;
    its `model`, unset or None: model.teacher)."""
    if role != "teacher":
        return cfg.model.student
    return (teacher.model if teacher else None) or cfg.model.teacher


def pretrain_key(cfg: RunConfig, role: str, train_file: Path,
                 teacher: TeacherConfig | None = None) -> dict:
    """Everything that determines a pretrained model (`teacher`: as `load_role_model`)."""
    p = cfg.pretrain
    steps = p.teacher_steps if role == "teacher" else p.student_steps
    key = {"role": role, "preset": role_preset(cfg, role, teacher), "model": model_overrides(cfg),
           "data": file_sha256(train_file), "steps": steps, "batch_size": p.batch_size,
           "lr": p.lr, "class_dropout": p.class_dropout, "seed": p.seed, "version": 2}
    classes = specialist_classes(cfg, role, teacher)
    if classes is not None:
        key["classes"] = list(classes)
    return key


def specialist_classes(cfg: RunConfig, role: str,
                       teacher: TeacherConfig | None = None) -> tuple[int, ...] | None:
    """The classes a specialist teacher is pretrained on (a teacher that owns some classes),
    None for every class."""
    classes = teacher.classes if role == "teacher" and teacher else ()
    if not classes or set(classes) >= set(range(cfg.model.num_classes)):
        return None
    return tuple(sorted(classes))


def dataset_digest(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}"


def file_sha256(path: Path) -> str:
    """SHA-256 of the file's bytes: the key of a model trained on it, the same from any checkout
    or directory (`opd prepare digits` writes byte-identical files)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pretrained_model(cfg: RunConfig, role: str, *, teacher: TeacherConfig | None = None,
                     progress: bool = True, force: bool = False) -> tuple[GPT, dict]:
    """The cached pretrained teacher (`teacher`: as `load_role_model`) or student for this
    config (trained on first use).  Returns (model in eval mode, report with held-out NLL and
    timing)."""
    train_file, _ = data_paths(cfg)
    key = pretrain_key(cfg, role, train_file, teacher)
    path = cache_root() / "pretrained" / f"{role}-{key['preset']}-{config_hash(key)}.pt"
    preset = key["preset"]
    seed = cfg.pretrain.seed + (role == "student")
    torch.manual_seed(seed)       # the initialization too: the same key, the same model
    model = create_model(preset, class_dropout_prob=cfg.pretrain.class_dropout,
                         **model_overrides(cfg))
    report_path = path.with_suffix(".json")
    if path.is_file() and report_path.is_file() and not force:
        load_into(model, load_state_dict_safely(path), str(path))
        return model.eval(), json.loads(report_path.read_text())
    train = open_dataset(cfg, "train")
    heldout = open_dataset(cfg, "heldout")
    if (classes := specialist_classes(cfg, role, teacher)) is not None:
        train, heldout = train.of_classes(classes), heldout.of_classes(classes)
    start = time.time()
    losses = train_supervised(model, train, steps=key["steps"], batch_size=key["batch_size"],
                              lr=key["lr"], seed=seed,
                              desc=f"pretrain {role} ({preset})", progress=progress)
    report = {"role": role, "preset": preset, "path": str(path), "steps": key["steps"],
              "params": sum(p.numel() for p in model.parameters()),
              "seconds": round(time.time() - start, 1),
              "final_train_loss": float(np.mean(losses[-20:])) if losses else None,
              "heldout_nll": heldout_nll(model, heldout),
              "unigram_nll": dataset_stats(train)["unigram_entropy_nats"],
              "positional_nll": dataset_stats(train)["positional_entropy_nats"], "key": key}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict()}, tmp)
    os.replace(tmp, path)
    report_path.write_text(json.dumps(report, indent=2))
    return model.eval(), report


def load_role_model(cfg: RunConfig, role: str, *, teacher: TeacherConfig | None = None,
                    progress: bool = True) -> GPT:
    """A teacher or the starting student of a run: from the configured checkpoint, else the
    cached pretrained model.  Eval mode, no label dropout.  `teacher`: the entry of
    cfg.teachers to load (its `model` and `ckpt`, unset: model.teacher and model.teacher_ckpt;
    pretrained on its `classes`); None: model.teacher, on every class."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if role == "teacher":
        ckpt = (teacher.ckpt if teacher else None) or cfg.model.teacher_ckpt
    else:
        ckpt = cfg.model.student_ckpt
    preset = role_preset(cfg, role, teacher)
    if ckpt:
        try:
            model = load_llamagen_checkpoint(ckpt, preset, **model_overrides(cfg))
        except CheckpointError as e:          # whose file: a teacher names itself
            if teacher is not None:
                raise CheckpointError(f"teacher {teacher.name!r} (teachers[].ckpt): {e}; "
                                      f"every teacher needs the student's vocabulary and grid "
                                      f"(model.vocab_size={cfg.model.vocab_size}, "
                                      f"model.grid_size={cfg.model.grid_size})") from None
            raise
    else:
        model, _ = pretrained_model(cfg, role, teacher=teacher, progress=progress)
    return model.eval()


__all__ = ["train_supervised", "heldout_nll", "pretrained_model", "load_role_model",
           "model_overrides"]
