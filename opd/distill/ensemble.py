"""`TeacherEnsemble`: several teachers as one model of the rollout protocol (rollout/protocol.py)
and of the GPT's `forward(labels, tokens)`, so what measures "the teacher" (evaluation's KL
measures and the teacher's quality row, opd/eval/tracking.py) measures the target a run with
several teachers distils towards (opd/distill/teachers.py).

Its logits are log-probabilities (softmax leaves them unchanged):

- routing: a row's are those of the teacher that owns its class.  A row of the null class (the
  unconditional branch of CFG) has no owner: it takes the mixture of the teachers weighted by
  the share of the classes each owns (the routed model's class-averaged unconditional
  distribution), the same for every image.
- mixing: log sum_i w_i p_i, as the learner's target.

Every teacher runs every row (an evaluation costs a forward per teacher); the rows' labels are
kept per cache row from the prefill, which is where a cached forward learns them.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from opd.distill.teachers import ROUTE, Teachers, mixture


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
        """(B, S, V) log-probs of rows with class `labels` from each member's logits."""
        logps = [torch.log_softmax(x.float(), -1) for x in logits]
        mixed = mixture(logps, self.null_weights)
        if self.teachers.rule != ROUTE:
            return mixed
        owner = self.owner.to(labels.device)[labels]                  # n: the null class
        out = mixed.clone()
        for i, lp in enumerate(logps):
            pick = owner == i
            out[pick] = lp[pick]
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


def load_teachers(cfg, *, progress: bool = True, device=None) -> list[nn.Module]:
    """Each teacher of the run (cfg.teachers, in order) loaded, or pretrained, as its pool's
    workers load it, in its precision."""
    from opd.models import precision
    from opd.models.factory import load_role_model
    return [precision.to_role(load_role_model(cfg, "teacher", teacher=t, progress=progress),
                              cfg, "teacher", device) for t in cfg.teachers]


def as_one_model(teachers: Teachers, models: list[nn.Module]) -> nn.Module:
    """The teachers as the one model a run distils towards: their `TeacherEnsemble`, or the
    model itself when there is one (nothing to combine)."""
    return models[0] if len(models) == 1 else TeacherEnsemble(teachers, models).eval()


def load_teacher(cfg, *, progress: bool = True, device=None) -> nn.Module:
    """The run's teacher in its precision, as one model (`as_one_model`)."""
    from opd.distill.teachers import run_teachers
    return as_one_model(run_teachers(cfg), load_teachers(cfg, progress=progress, device=device))
