"""A teacher that scores a rollout call span by span while the student writes it.

A rollout call streamed by position span (rollout/spans.py) hands out every row's tokens
[a, b) once every row has committed past b.  The teacher's log-prob of token t depends only on
the class and the tokens before t, so a teacher that keeps a KV cache per row scores span
[a, b) with the tokens [0, a) already cached: its forward feeds tokens a-1..b-2 at positions
a..b-1 and gets the distributions of tokens a..b-1 (the first span prefills the class token,
the real prefix and the span's own tokens).  At the call's end only the last span is left.

    scoring = PartScoring(models, cfg, teachers, job)     # one rollout call ("part")
    for item in PartStream(...):                           # Span, Piece, Span, ...
        if isinstance(item, Span): scoring.score(item)     # every teacher, its rows
    batch, shares = scoring.piece(piece.rows, piece.batch) # once the call is complete

The per-position scores are those `opd.distill.steps.score` computes from one full forward
(CFG-guided when the teacher entry says so: the conditional and the null-class rows share the
cache, conditional first), up to float summation order (tests/opd/test_span_scoring.py: 1e-5
in float32, allclose in float64); both run modes score the same spans with this code, so they
agree bit for bit.  Each scorer owns its KV caches (`GPT.swap_cache`), so a teacher may score
several calls' spans interleaved.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor

from opd.config.schema import RunConfig, TeacherConfig
from opd.distill.batch import TrajectoryBatch, index_dtype
from opd.distill.steps import RolloutJob
from opd.distill.teachers import Share, Teachers, merge_shares, take_index
from rollout.spans import Span


class SpanScorer:
    """Teacher `entry`'s (its `model`) scores of n rows of one rollout call, span by span:
    `labels` (n,) their classes, `prefix` (n, P) their real prefix, `total` T = P + N."""

    def __init__(self, model, entry: TeacherConfig, cfg_scale: float, labels: Tensor,
                 prefix: Tensor, total: int):
        device = next(model.parameters()).device
        self.model, self.entry, self.total = model, entry, total
        self.scale = cfg_scale if entry.guided and cfg_scale != 1.0 else None
        self.labels = labels.to(device)
        if self.scale is not None:                # the null-class rows after the conditional
            null = torch.full_like(self.labels, model.num_classes)
            self.labels = torch.cat([self.labels, null])
        self.prefix = prefix.to(device)
        self.cache: list | None = None            # the model's KV caches of these rows
        self.last: Tensor | None = None           # (n, 1) the last token scored
        self.stop = prefix.shape[1]               # where the next span starts
        self.scores: list[tuple[Tensor, ...]] = []  # per span: (logp,) or (values, indices)
        self.kl = torch.zeros(labels.shape[0], dtype=torch.float64)  # per row, sampled tokens
        self.seconds = 0.0

    @property
    def rows(self) -> int:
        return int(self.prefix.shape[0])

    def _rows(self, x: Tensor) -> Tensor:
        return torch.cat([x, x]) if self.scale is not None else x

    @torch.no_grad()
    def _logits(self, x: Tensor, start: int) -> Tensor:
        """(n, s, V) float32 logits of tokens start..start+s-1 from span tokens x (n, s)."""
        model, P = self.model, self.prefix.shape[1]
        old = model.swap_cache(self.cache)
        try:
            if self.cache is None:                # the class token, the prefix, the span
                model.setup_cache(self.labels.shape[0], self.total)
                inputs = torch.cat([self.prefix, x[:, :-1]], 1)
                logits = model.prefill(self.labels, self._rows(inputs), None)[:, P:]
            else:                                 # tokens start-1.. at positions start..
                inputs = torch.cat([self.last, x[:, :-1]], 1)
                positions = torch.arange(start, start + x.shape[1], device=x.device)
                logits = model.forward_cached(self._rows(inputs),
                                              positions.expand(self.labels.shape[0], -1), None)
        finally:
            self.cache = model.swap_cache(old)
        if self.scale is not None:
            cond, uncond = logits.chunk(2)
            logits = uncond + (cond - uncond) * self.scale
        return logits.float()

    def score(self, tokens: Tensor, start: int, behaviour: Tensor | None = None) -> None:
        """Score the span of `tokens` (n, s) int64 at positions start..start+s-1, the next one
        (ValueError otherwise); `behaviour` (n, s) the student's log-probs of them (a student
        rollout: the on-policy KL to this teacher is summed per row)."""
        if start != self.stop or start + tokens.shape[1] > self.total:
            raise ValueError(f"span [{start}, {start + tokens.shape[1]}) does not follow the "
                             f"scored tokens [0, {self.stop}) of a call of {self.total}")
        t0 = time.perf_counter()
        x = tokens.to(self.prefix.device)
        logp = F.log_softmax(self._logits(x, start), -1).cpu()                 # (n, s, V)
        if behaviour is not None:
            lt = logp.gather(-1, tokens.cpu().unsqueeze(-1)).squeeze(-1).double()
            self.kl += (behaviour.cpu().double() - lt).sum(1)
        if self.entry.transport == "full":
            self.scores.append((logp,))
        else:
            values, indices = logp.topk(self.entry.topk, dim=-1)
            self.scores.append((values, indices.to(index_dtype(logp.shape[-1]))))
        self.last, self.stop = x[:, -1:], start + tokens.shape[1]
        self.seconds += time.perf_counter() - t0

    @property
    def complete(self) -> bool:
        return self.stop == self.total

    def attach(self, batch: TrajectoryBatch, rows: Tensor) -> TrajectoryBatch:
        """`batch` (its rows are this scorer's `rows`, indices) with their scores of every
        suffix position attached, as `opd.distill.steps.score` attaches them."""
        if not self.complete:
            raise ValueError(f"the call is scored up to token {self.stop} of {self.total}")
        whole = [torch.cat(parts, 1)[rows].contiguous() for parts in zip(*self.scores)]
        if self.entry.transport == "full":
            out = batch.with_teacher(logprobs=whole[0])
        else:
            out = batch.with_teacher(topk_values=whole[0], topk_indices=whole[1])
        out.rollout_stats.teacher_seconds = self.seconds * len(rows) / self.rows
        return out


class PartScoring:
    """Every teacher's `SpanScorer` of one rollout call `job` (a part: its rows, real prefix
    and source), each over the rows it scores (opd/distill/teachers.py: routing, its classes'
    rows; mixing, every row).  `models` maps a teacher's index to its model: all of them in the
    reference loop, its own in a Ray teacher worker (`only`: the teachers scored here, default
    every one the call's rows need)."""

    def __init__(self, models, cfg: RunConfig, teachers: Teachers, job: RolloutJob,
                 only: list[int] | None = None):
        P, T = job.prefix_len, int(job.tokens.shape[1])
        self.teachers, self.student = teachers, job.source == "student"
        self.rows: dict[int, Tensor | None] = {}
        self.scorers: dict[int, SpanScorer] = {}
        for i in teachers.scorers(job.labels) if only is None else only:
            rows = teachers.share_rows(i, job.labels)
            pick = (lambda t: t) if rows is None else (lambda t, r=rows: t[r])
            self.rows[i] = rows
            self.scorers[i] = SpanScorer(models[i], cfg.teachers[i], cfg.rollout.cfg_scale,
                                         pick(job.labels), pick(job.tokens[:, :P]), T)

    @property
    def stop(self) -> int:
        """Where the next span starts (every scorer has scored the tokens before it)."""
        return min(s.stop for s in self.scorers.values())

    def score(self, span: Span) -> None:
        """Every teacher scores its rows of `span` (the call's next one)."""
        for i, scorer in self.scorers.items():
            rows = self.rows[i]
            tokens, logp = ((span.tokens, span.logprobs) if rows is None
                            else (span.tokens[rows], span.logprobs[rows]))
            scorer.score(tokens, span.start, logp if self.student else None)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.scorers.values())

    def share(self, i: int, rows: Tensor, batch: TrajectoryBatch) -> Share:
        """Teacher i's share of the piece of the call's `rows` (n,) (its trajectory `batch`),
        once every span is scored, as `opd.distill.teachers.score_share` makes it."""
        mine = self.teachers.share_rows(i, batch.labels)          # rows of the piece, or None
        called = rows if mine is None else rows[mine]             # rows of the call
        have = self.rows[i]
        at = called if have is None else torch.searchsorted(have, called)
        scorer = self.scorers[i]
        part = batch if mine is None else take_index(batch, mine)
        kl, tokens = 0.0, 0                       # on-policy KL: sampled student tokens only
        if self.student:
            N = scorer.total - scorer.prefix.shape[1]
            kl, tokens = float(scorer.kl[at].sum()), int(at.numel()) * N
        return Share(i, mine, scorer.attach(part, at),
                     scorer.seconds * int(at.numel()) / scorer.rows, kl, tokens)

    def piece(self, rows: Tensor, batch: TrajectoryBatch) -> tuple[TrajectoryBatch, list[Share]]:
        """The scored piece of the call's `rows` (n,) (its trajectory `batch`), once every span
        is scored, and each teacher's share of it, as `opd.distill.teachers.score_piece`."""
        shares = [self.share(i, rows, batch) for i in self.teachers.scorers(batch.labels)]
        return merge_shares(self.teachers, shares), shares
