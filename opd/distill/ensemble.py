"""`TeacherEnsemble`: several teachers as one model of the rollout protocol (rollout/protocol.py)
and of the GPT's `forward(labels, tokens)`, so what measures "the teacher" (evaluation's KL
measures and the teacher's quality row, opd/eval/tracking.py) measures the target a run with
several teachers distils towards (opd/distill/teachers.py).

Its logits give each row its distribution (up to a constant per row, which softmax ignores):

- routing: a row's are the logits of the teacher that owns its class.  A row of the null class
  (the unconditional branch of CFG) has no owner: it takes the mixture of the teachers weighted
  by the fraction of the classes each owns (the routed model's class-averaged unconditional
  distribution), the same for every image.
- mixing: log sum_i w_i p_i, as the learner's target, written as the first teacher's logits
  plus log sum_i w_i p_i / p_1 (float64 inside).

So one teacher is an ensemble of one: its weight is 1, log p_1 / p_1 is 0 exactly, and its
logits come out as the teacher's own, bit for bit, under either rule.

Every teacher runs every row (an evaluation costs a forward per teacher); the rows' labels are
kept per cache row from the prefill, which is where a cached forward learns them.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from opd.distill.teachers import ROUTE, Teachers


class TeacherEnsemble(nn.Module):
    def __init__(self, teachers: Teachers, models: list[nn.Module]):
        super().__init__()
        self.teachers, self.members = teachers, nn.ModuleList(models)
        first = models[0]
        self.vocab_size, self.num_classes = first.vocab_size, first.num_classes
        self.block_size, self.grid_size = first.block_size, first.grid_size
        self.row_labels = torch.zeros(0, dtype=torch.int64)
        n = len(models)
        if teachers.rule == ROUTE:
            owned = [len(t.classes) for t in teachers.entries]
            self.null_weights = [k / sum(owned) for k in owned]
        else:
            self.null_weights = teachers.weights()
        self.owner = torch.tensor(teachers.owners_of_classes(self.num_classes) + [n])

    def _combine(self, logits: list[Tensor], labels: Tensor) -> Tensor:
        """(B, S, V) float32 logits of rows with class `labels` from each member's logits."""
        xs = [x.double() for x in logits]
        logps = [torch.log_softmax(x, -1) for x in xs]
        ratios = torch.stack([lp - logps[0] + math.log(w)             # log w_i p_i / p_1
                              for lp, w in zip(logps, self.null_weights)])
        out = (xs[0] + torch.logsumexp(ratios, 0)).float()
        if self.teachers.rule != ROUTE:
            return out
        owner = self.owner.to(labels.device)[labels]                  # n: the null class
        for i, x in enumerate(logits):
            pick = owner == i
            out[pick] = x[pick].float()
        return out

    def forward(self, labels: Tensor, tokens: Tensor) -> Tensor:
        return self._combine([m(labels, tokens) for m in self.members], labels)

    # -- the rollout protocol --------------------------------------------------------------------

    def setup_cache(self, max_batch: int, max_len: int) -> None:
        for m in self.members:
            m.setup_cache(max_batch, max_len)
        if self.row_labels.numel() < max_batch:
            self.row_labels = torch.zeros(max_batch, dtype=torch.int64)

    def _labels(self, rows: Tensor | None, batch: int) -> Tensor:
        return self.row_labels[:batch] if rows is None else self.row_labels[rows.cpu()]

    def prefill(self, labels: Tensor, prefix: Tensor, rows: Tensor | None) -> Tensor:
        if rows is None:
            self.row_labels[:labels.shape[0]] = labels.cpu()
        else:
            self.row_labels[rows.cpu()] = labels.cpu()
        return self._combine([m.prefill(labels, prefix, rows) for m in self.members], labels)

    def forward_cached(self, tokens: Tensor, positions: Tensor, rows: Tensor | None,
                       *tree) -> Tensor:
        labels = self._labels(rows, tokens.shape[0]).to(tokens.device)
        return self._combine([m.forward_cached(tokens, positions, rows, *tree)
                              for m in self.members], labels)

    def move_cached(self, rows: Tensor, src: Tensor, dst: Tensor) -> None:
        for m in self.members:
            m.move_cached(rows, src, dst)

    def static_cache(self, on: bool) -> None:
        """Each member's (rollout option compile)."""
        for m in self.members:
            m.static_cache(on)


def load_teachers(cfg, *, progress: bool = True, device=None) -> list[nn.Module]:
    """Each teacher of the run (cfg.teachers, in order) loaded, or pretrained, as its pool's
    workers load it, in its precision."""
    from opd.models import precision
    from opd.models.factory import load_role_model
    return [precision.to_role(load_role_model(cfg, "teacher", teacher=t, progress=progress),
                              cfg, "teacher", device) for t in cfg.teachers]


def load_teacher(cfg, *, progress: bool = True, device=None) -> TeacherEnsemble:
    """The run's teachers in their precision, as the one model the run distils towards (their
    `TeacherEnsemble`; one teacher's is that teacher)."""
    from opd.distill.teachers import run_teachers
    models = load_teachers(cfg, progress=progress, device=device)
    return TeacherEnsemble(run_teachers(cfg), models).eval()
