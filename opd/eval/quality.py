"""Quality measures that need no feature extractor, on held-out data.

- `student_nll`: the student's NLL per token of held-out sequences (nats).
- `kl_data`: KL(teacher ‖ student) per token on held-out sequences, all positions.
- `kl_samples`: KL(teacher ‖ student) per token on the positions the student generated itself
  after held-out prefixes of `eval.prefix_ratio` (completions; whole images from the class
  token are measured by the sample metrics of `opd.eval`).
- `teacher_nll_samples`: the teacher's NLL of those student-generated tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from opd.config.schema import RunConfig
from opd.data import TokenDataset
from opd.distill.steps import RolloutJob, build_engine, prefix_len_for, generate

KL_BATCH = 50
"""Held-out rows per rollout of `quality_report` (a batch size γ calibration must cover)."""


@torch.no_grad()
def _log_probs(model, labels, tokens):
    device = next(model.parameters()).device
    labels, tokens = labels.to(device), tokens.to(device)
    return F.log_softmax(model(labels, tokens[:, :-1]).double(), -1).cpu()  # (B, T, V)


@torch.no_grad()
def quality_report(student, teacher, heldout: TokenDataset, cfg: RunConfig, *,
                   num_rows: int | None = None, batch_size: int = KL_BATCH, seed: int = 1234) -> dict:
    """The four held-out measures above, token means in nats."""
    was = student.training
    student.eval()
    engine = build_engine(cfg)
    n = heldout.num_rows if num_rows is None else min(num_rows, heldout.num_rows)
    P = prefix_len_for(cfg.eval.prefix_ratio, heldout.seq_len)
    sums = dict(student_nll=0.0, kl_data=0.0, kl_samples=0.0, teacher_nll_samples=0.0)
    data_tokens = gen_tokens = 0
    for start in range(0, n, batch_size):
        end = min(start + batch_size, n)
        labels = torch.from_numpy(heldout.labels[start:end])
        tokens = torch.from_numpy(heldout.tokens[start:end])
        s, t = _log_probs(student, labels, tokens), _log_probs(teacher, labels, tokens)
        sums["student_nll"] -= s.gather(-1, tokens[..., None]).sum().item()          # CPU
        sums["kl_data"] += (t.exp() * (t - s)).sum().item()
        data_tokens += tokens.numel()
        job = RolloutJob(10**9 + start, labels, tokens, P, "student", seed)
        traj = generate(student, engine, job, cfg, policy_version=-1)
        gen = traj.tokens
        s, t = _log_probs(student, labels, gen)[:, P:], _log_probs(teacher, labels, gen)[:, P:]
        sums["kl_samples"] += (t.exp() * (t - s)).sum().item()
        sums["teacher_nll_samples"] -= t.gather(-1, gen[:, P:, None]).sum().item()
        gen_tokens += gen[:, P:].numel()
    student.train(was)
    return {"student_nll": sums["student_nll"] / data_tokens,
            "kl_data": sums["kl_data"] / data_tokens,
            "kl_samples": sums["kl_samples"] / gen_tokens,
            "teacher_nll_samples": sums["teacher_nll_samples"] / gen_tokens}
