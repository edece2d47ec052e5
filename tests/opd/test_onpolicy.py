"""On-policy, proven every step (opd/distill/onpolicy.py): the learner's teacher-forced log-probs of a
rollout's tokens against the behaviour log-probs the rollout recorded.  Strict: below
STRICT_BOUND every step; stale weights on purpose: the gap is the weights' own log-prob change
and far above the bound; batches without student tokens: NaN, never 0."""
import copy
import math

import pytest
import torch

from opd.config.schema import load_config
from opd.models import create_model
from opd.distill.onpolicy import STRICT_BOUND, combine_gaps, logprob_gap, recompute_logprobs
from opd.run.reference import run_reference
from opd.distill.steps import (RolloutJob, build_engine, build_objective, learn, make_optimizer, generate,
                       score)

SAMPLED = ["rollout.decoding=sample", "rollout.cfg_scale=2.0", "rollout.temperature=0.9",
           "rollout.gamma=2"]


def random_model(std=0.3):
    """GPT-digits-S on a 4x4 grid (16 tokens: quick), float32, every weight random (the preset
    zero-inits the head: uniform distributions would make every gap 0)."""
    m = create_model("GPT-digits-S", grid_size=4).eval()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=std)
    return m


def models_and_job(B=6, P=5, seed=0):
    torch.manual_seed(seed)
    student, teacher = random_model(), random_model()
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 10, (B,), generator=g)
    tokens = torch.randint(0, 17, (B, 16), generator=g)
    return student, teacher, RolloutJob(3, labels, tokens, prefix_len=P, source="student", seed=7)


@pytest.mark.parametrize("extra", [SAMPLED, SAMPLED + ["rollout.top_k=6", "rollout.top_p=0.9"],
                                   ["rollout.decoding=greedy", "rollout.cfg_scale=1.5",
                                    "rollout.temperature=1.3", "rollout.gamma=2"],
                                   SAMPLED + ["rollout.engine=cached_ar"],
                                   SAMPLED + ["rollout.slots=4", "rollout.execution=compact"]])
def test_same_weights_give_a_gap_below_the_bound(extra):
    cfg = load_config("tiny", extra)
    student, _, job = models_and_job()
    traj = generate(student, build_engine(cfg), job, cfg, policy_version=0)
    gap = logprob_gap(student, traj, cfg)
    assert gap["onpolicy_tokens"] == 6 * (16 - 5)
    assert gap["onpolicy_logprob_delta_max"] < STRICT_BOUND
    assert 0 <= gap["onpolicy_logprob_delta_mean"] <= gap["onpolicy_logprob_delta_max"]
    assert traj.behaviour_logprobs.std() > 0.1          # peaked, varied distributions


@pytest.mark.parametrize("extra", [SAMPLED, ["rollout.decoding=greedy", "rollout.gamma=2"]])
def test_the_check_on_the_loss_forward_equals_a_forward_of_its_own(extra):
    """student_loss(check=cfg) reuses its eval-mode forward's logits (no conditional forward of
    its own): bit for bit the figures of a separate forward; with dropout on it runs its own."""
    from opd.distill.steps import student_loss
    cfg = load_config("tiny", extra)                  # on-policy GKD
    student, teacher, job = models_and_job()
    traj = score(teacher, generate(student, build_engine(cfg), job, cfg, policy_version=0),
                 cfg.teachers[0], cfg.rollout.cfg_scale)
    alone = logprob_gap(student, traj, cfg)
    for dropout in (False, True):
        _, metrics = student_loss(student, traj, build_objective(cfg), dropout=dropout, check=cfg)
        got = {k: metrics[k] for k in alone if k != "onpolicy_s"}
        assert got == {k: v for k, v in alone.items() if k != "onpolicy_s"}


def test_stale_weights_give_the_weights_own_logprob_change():
    """Roll out with version k−1, check with version k (one learner step later): the gap is
    |log p_k − log p_{k−1}| of the rollout's tokens, computed directly, and far above the
    strict bound."""
    cfg = load_config("tiny", SAMPLED + ["learner.lr=0.01", "learner.warmup_steps=0"])
    old, teacher, job = models_and_job()
    traj = generate(old, build_engine(cfg), job, cfg, policy_version=0)
    new = copy.deepcopy(old)
    learn(new, make_optimizer(new, cfg), score(teacher, traj, cfg.teachers[0], cfg.rollout.cfg_scale), build_objective(cfg),
          grad_clip=1.0, dropout=False)
    gap = logprob_gap(new, traj, cfg)
    direct = (recompute_logprobs(new, traj, cfg).double()
              - recompute_logprobs(old, traj, cfg).double()).abs()
    assert gap["onpolicy_tokens"] == direct.numel()
    assert gap["onpolicy_logprob_delta_mean"] == pytest.approx(direct.mean().item(),
                                                               abs=STRICT_BOUND)
    assert gap["onpolicy_logprob_delta_max"] == pytest.approx(direct.max().item(),
                                                              abs=STRICT_BOUND)
    assert gap["onpolicy_logprob_delta_mean"] > 100 * STRICT_BOUND
    assert logprob_gap(old, traj, cfg)["onpolicy_logprob_delta_max"] < STRICT_BOUND


@pytest.mark.parametrize("source", ["data", "teacher"])
def test_batches_without_student_tokens_report_nan(source):
    cfg = load_config("tiny", SAMPLED)
    student, teacher, job = models_and_job()
    job = RolloutJob(job.batch_id, job.labels, job.tokens, job.prefix_len, source, job.seed)
    traj = generate(teacher, build_engine(cfg), job, cfg, policy_version=0)
    assert traj.behaviour_logprobs is None
    gap = logprob_gap(student, traj, cfg)
    assert gap["onpolicy_tokens"] == 0
    assert math.isnan(gap["onpolicy_logprob_delta_mean"])
    assert math.isnan(gap["onpolicy_logprob_delta_max"])


def test_ranks_combine_by_tokens_and_max():
    ranks = [{"onpolicy_logprob_delta_mean": 1e-6, "onpolicy_logprob_delta_max": 3e-6,
              "onpolicy_tokens": 30, "onpolicy_s": 0.5},
             {"onpolicy_logprob_delta_mean": 4e-6, "onpolicy_logprob_delta_max": 5e-6,
              "onpolicy_tokens": 10, "onpolicy_s": 0.25}]
    out = combine_gaps(ranks)
    assert out == {"onpolicy_logprob_delta_mean": pytest.approx((30e-6 + 40e-6) / 40),
                   "onpolicy_logprob_delta_max": 5e-6, "onpolicy_tokens": 40, "onpolicy_s": 0.5}
    none = combine_gaps([{**r, "onpolicy_tokens": 0, "onpolicy_logprob_delta_mean": math.nan,
                          "onpolicy_logprob_delta_max": math.nan} for r in ranks])
    assert none["onpolicy_tokens"] == 0 and math.isnan(none["onpolicy_logprob_delta_max"])


def test_strict_reference_run_is_on_policy_every_step(tiny_overrides, tmp_path):
    """GKD at λ 1 (every step a student rollout), sampled HB-SJD with CFG: every row of
    metrics.parquet shows a gap below the bound over all of its generated tokens."""
    cfg = load_config("tiny", [*tiny_overrides, "distill.steps=3", *SAMPLED])
    rows = run_reference(cfg, tmp_path, progress=False)
    assert [r["source"] for r in rows] == ["student"] * 3
    for r in rows:
        assert r["onpolicy_tokens"] == r["generated_tokens"] == 4 * (64 - r["prefix_len"])
        assert r["onpolicy_logprob_delta_max"] < STRICT_BOUND
        assert r["onpolicy_logprob_delta_mean"] <= r["onpolicy_logprob_delta_max"]
