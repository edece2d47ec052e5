"""The run's teachers, one or several, one student: which teacher scores which rows, and the
one target the learner trains on (multi-teacher OPD).

A run's teachers are the entries of `teachers:`, each with a `name` (a `teacher:` section is
the list of its one entry, "default": opd/config/teachers.py).  They are combined by one of two
rules:

- routing: each teacher owns a set of class labels (`classes`; every class owned once), and each
  row of a step is scored by the teacher that owns its class only.  Its target is that
  teacher's distribution, in either transport (full or top-k).
- mixing (entries without `classes`): every teacher scores every row and the target is the
  normalised mixture log sum_i w_i p_i (`weight` w_i, unset 1, over sum_i w_i), computed from
  full-vocabulary log-probs (exact; a top-k mixture would need every teacher's probability at
  the other teachers' ids, so the config refuses mixing several with top-k transport).  The
  learner receives each teacher's scores: n teachers x (N, V) float32 per image (LlamaGen at
  the paper's shape, 256 tokens x 16,384 ids: 16 MiB per teacher and image).  One teacher is
  a mixture of one: one share of every row, whose scores are the target as they are.

Each teacher scores its share of a piece (`share_rows`) and sends it on as a share: the rows'
positions in the piece and their scores (`score_share`).  Shares are merged where the target is
needed (`merge_shares`: by the learner ranks, each its rows of the piece; by the reference loop,
the whole piece), so a Ray run and the reference loop compute the same target (invariant 5).

Per teacher a share also measures the on-policy KL to that teacher on its rows: the mean over
the student's sampled suffix tokens of log p_student(x) - log p_teacher(x) (the behaviour
log-probs of the rollout against the teacher's log-prob of the token; the one-sample estimate
of KL(student || teacher) on the states the student visited), with its rows, tokens and seconds.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from opd.config.schema import RunConfig, TeacherConfig
from opd.distill.batch import TrajectoryBatch
from opd.distill.pieces import merge_batches

ROUTE, MIX = "route", "mix"


@dataclass(frozen=True)
class Teachers:
    """The run's teachers (`entries`, in config order) and their rule: "route" or "mix"."""
    entries: tuple[TeacherConfig, ...]
    rule: str

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.entries]

    def pool(self, i: int) -> str:
        """Teacher i's worker pool: "teacher/<name>"."""
        return f"teacher/{self.entries[i].name}"

    def weights(self) -> list[float]:
        """The mixing weights (unset: 1), normalised to sum 1."""
        w = [1.0 if t.weight is None else t.weight for t in self.entries]
        return [x / sum(w) for x in w]

    def owners(self, labels: Tensor) -> Tensor:
        """(B,) the index of the teacher that owns each row's class (routing; 0 otherwise)."""
        owner = torch.zeros(int(labels.max()) + 1 if labels.numel() else 1, dtype=torch.int64)
        if self.rule == ROUTE:
            for i, t in enumerate(self.entries):
                for c in t.classes:
                    if c < owner.numel():
                        owner[c] = i
        return owner[labels]

    def owners_of_classes(self, num_classes: int) -> list[int]:
        """The teacher that scores each class 0..num_classes-1 (routing; 0 otherwise)."""
        return self.owners(torch.arange(num_classes)).tolist()

    def share_rows(self, i: int, labels: Tensor) -> Tensor | None:
        """The rows (indices into `labels`) teacher i scores: None for every row (mixing), else
        the rows whose class it owns (possibly none)."""
        if self.rule != ROUTE:
            return None
        return torch.nonzero(self.owners(labels) == i).flatten()

    def scorers(self, labels: Tensor) -> list[int]:
        """The teachers with rows to score among `labels`, in teacher order."""
        if self.rule != ROUTE:
            return list(range(len(self.entries)))
        return sorted(set(self.owners(labels).tolist()))

    def piece_scorers(self, labels: list[Tensor], layout) -> list[tuple[int, ...]]:
        """For each piece of a step (`layout`, opd/distill/pieces.py; `labels` its parts'
        rows' classes), the teachers that score its rows (`scorers`)."""
        out = []
        for c, part in enumerate(labels):
            start = 0
            for p, size in zip(layout.parts[c], layout.part_sizes(c)):
                out.append((p, tuple(self.scorers(part[start:start + size]))))
                start += size
        return [s for _, s in sorted(out)]


def run_teachers(cfg: RunConfig) -> Teachers:
    """The teachers of a run config."""
    ts = tuple(cfg.teachers)
    return Teachers(ts, ROUTE if ts[0].classes else MIX)


def take_index(batch: TrajectoryBatch, rows: Tensor) -> TrajectoryBatch:
    """The rows `rows` (indices) of a batch, as a new batch."""
    def pick(t):
        return None if t is None else t[rows]
    return TrajectoryBatch(batch.batch_id, pick(batch.labels), batch.prefix_len,
                           pick(batch.tokens), batch.policy_version, batch.source,
                           batch.rollout_stats.copy(), pick(batch.teacher_logprobs),
                           pick(batch.teacher_topk_values), pick(batch.teacher_topk_indices),
                           pick(batch.behaviour_logprobs))


@dataclass(frozen=True)
class ShareMeasure:
    """What scoring one share measured: its teacher, rows, seconds and on-policy KL sum over
    `kl_tokens` sampled tokens (module docstring)."""
    teacher: int
    rows: int
    seconds: float
    kl_sum: float
    kl_tokens: int


@dataclass
class Share:
    """Teacher `teacher`'s scores of some rows of a piece: `rows` their positions in it (None:
    every row, in order), `batch` those rows with the scores; its measures (module docstring)."""
    teacher: int
    rows: Tensor | None
    batch: TrajectoryBatch
    seconds: float = 0.0
    kl_sum: float = 0.0            # sum over sampled suffix tokens of log p_s - log p_t
    kl_tokens: int = 0

    def measure(self) -> ShareMeasure:
        return ShareMeasure(self.teacher, self.batch.batch_size, self.seconds, self.kl_sum,
                            self.kl_tokens)


def onpolicy_kl_sum(batch: TrajectoryBatch, logp: Tensor) -> tuple[float, int]:
    """(sum of log p_student(x) - log p_teacher(x), tokens) over the student's sampled suffix
    tokens x (the rollout's behaviour log-probs; none for other sources); `logp` (B, N, V) the
    teacher's suffix log-probs."""
    if batch.behaviour_logprobs is None or batch.source != "student":
        return 0.0, 0
    x = batch.tokens[:, batch.prefix_len:].to(logp.device)
    lt = logp.gather(-1, x.unsqueeze(-1)).squeeze(-1).double().cpu()
    return float((batch.behaviour_logprobs.double() - lt).sum()), int(x.numel())


def score_share(model, batch: TrajectoryBatch, cfg: RunConfig, teacher: int,
                rows: Tensor | None, score) -> Share:
    """Teacher `teacher` (its `model`, its entry `cfg.teachers[teacher]`) scores `rows` of a
    piece (None: all) with `score` (opd.distill.steps.score, which calls back with the suffix
    log-probs)."""
    start = time.perf_counter()
    part = batch if rows is None else take_index(batch, rows)
    measured = {}

    def measure(logp: Tensor) -> None:
        measured["kl"] = onpolicy_kl_sum(part, logp)

    out = score(model, part, cfg.teachers[teacher], cfg.rollout.cfg_scale, measure)
    kl, tokens = measured.get("kl", (0.0, 0))
    return Share(teacher, rows, out, time.perf_counter() - start, kl, tokens)


def mixture(logps: list[Tensor], weights: list[float]) -> Tensor:
    """log sum_i w_i p_i from log-probs log p_i (same shape), weights summing to 1; float32."""
    stacked = torch.stack([lp.double() + torch.log(torch.tensor(w, dtype=torch.float64))
                           for lp, w in zip(logps, weights)])
    return torch.logsumexp(stacked, 0).float()


def merge_shares(teachers: Teachers, shares: list[Share]) -> TrajectoryBatch:
    """One scored batch from the shares of a piece (or of a rank's rows of it): routed shares
    put back in row order, mixed shares' full log-probs mixed; one share of every row (one
    teacher) is the batch itself."""
    if len(shares) == 1 and shares[0].rows is None:
        return shares[0].batch
    if teachers.rule == MIX:
        shares = sorted(shares, key=lambda s: s.teacher)
        w = teachers.weights()
        base = shares[0].batch
        return base.with_teacher(logprobs=mixture([s.batch.teacher_logprobs for s in shares],
                                                  [w[s.teacher] for s in shares]))
    shares = [s for s in shares if s.batch.batch_size]
    merged = merge_batches([s.batch for s in shares])
    return take_index(merged, torch.argsort(torch.cat([s.rows for s in shares])))


def cut_share(share: Share, start: int, stop: int) -> Share:
    """The part of a share that falls in rows [start, stop) of its piece, positions relative to
    `start` (a learner rank's cut)."""
    if share.rows is None:
        idx = torch.arange(start, stop)
        return Share(share.teacher, None, take_index(share.batch, idx), share.seconds)
    keep = torch.nonzero((share.rows >= start) & (share.rows < stop)).flatten()
    return Share(share.teacher, share.rows[keep] - start, take_index(share.batch, keep),
                 share.seconds)


def share_to_numpy(share: Share) -> dict:
    """A share as one object-store payload: its batch's numpy dict plus its teacher and rows."""
    d = share.batch.to_numpy_dict()
    d["share_teacher"] = share.teacher
    d["share_rows"] = None if share.rows is None else share.rows.numpy()
    return d


def share_from_numpy(d: dict) -> Share:
    """The inverse of `share_to_numpy`; an unscored piece's plain batch dict
    (actors/transport/delivery.py) is one share of every row."""
    d = dict(d)
    teacher = int(d.pop("share_teacher", 0))
    rows = d.pop("share_rows", None)
    return Share(teacher, None if rows is None else torch.from_numpy(rows),
                 TrajectoryBatch.from_numpy_dict(d))


def score_piece(models: list, cfg: RunConfig, teachers: Teachers,
                batch: TrajectoryBatch, score) -> tuple[TrajectoryBatch, list[Share]]:
    """A piece scored by every teacher it needs (teacher i: `models[i]`), its shares merged
    into one target (the reference loop; a Ray run scores the shares on the teachers' pools
    and its learner ranks merge them)."""
    shares = [score_share(models[i], batch, cfg, i, teachers.share_rows(i, batch.labels),
                          score) for i in teachers.scorers(batch.labels)]
    return merge_shares(teachers, shares), shares


def teacher_metrics(teachers: Teachers, measures: list[ShareMeasure]) -> dict:
    """Per teacher: its busy seconds, rows scored and on-policy KL (`teacher_busy_s/<name>`,
    `teacher_rows/<name>`, `teacher_kl/<name>`; NaN without sampled tokens) over the measures
    of a step's shares."""
    out = {}
    for i, name in enumerate(teachers.names):
        mine = [s for s in measures if s.teacher == i]
        tokens = sum(s.kl_tokens for s in mine)
        out[f"teacher_busy_s/{name}"] = sum(s.seconds for s in mine)
        out[f"teacher_rows/{name}"] = sum(s.rows for s in mine)
        out[f"teacher_kl/{name}"] = (sum(s.kl_sum for s in mine) / tokens if tokens
                                     else float("nan"))
    return out
