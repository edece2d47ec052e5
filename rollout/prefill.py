"""The prefill: an image's class token and prefix (and, for a Jacobi engine's first round, its
first window's drafts: rollout/rounds.py `prefill_round`) in one forward into the KV cache,
CFG's null-class copies R rows after the conditional ones."""
from __future__ import annotations

import torch
from torch import Tensor

from rollout.engine import Request, cfg_rows, choose_token
from rollout.sampling import guide


def prefill_forward(model, req: Request, images: Tensor, tokens: Tensor,
                    rows: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The prefill's forward of images `images` (k,): class token, then `tokens` (k, L), into
    cache rows `rows` (None: 0..k-1) -> logits (k, 1 + L, V) and those rows; with CFG 2k of
    each, the null-class copies R rows later."""
    labels = req.labels[images]
    if req.cfg:
        labels = torch.cat([labels, torch.full_like(labels, model.num_classes)])
        rows = None if rows is None else torch.cat([rows, rows + req.rows])
    return model.prefill(labels, cfg_rows(tokens, req), rows), rows


def prefill_token(model, req: Request, images: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Round 0 of images `images` (default all) at W = 1: prefill them into rows 0..k-1 and
    choose image token P -> token (k,) int64 and its behaviour log-prob (k,) float32."""
    images = torch.arange(req.batch, device=req.labels.device) if images is None else images
    logits = prefill_forward(model, req, images, req.prefix[images], None)[0][:, -1]
    pos = torch.full_like(images, req.prefix_len)
    return choose_token(guide(logits, req.cfg_scale), req, pos, torch.zeros_like(pos),
                        req.keys[images])
