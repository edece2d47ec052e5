"""A teacher scoring a rollout call span by span (opd/distill/span_scoring.py) gives the
scores of one full forward (`score_piece`, `score_share`): 1e-5 in float32, allclose in float64,
guided or not, any span length, with and without a real prefix, one teacher or several."""
import pytest
import torch

from opd.config.schema import load_config
from opd.distill.batch import TrajectoryBatch
from opd.distill.pieces import take_rows
from opd.distill.span_scoring import PartScoring, SpanScorer
from opd.distill.steps import RolloutJob, score
from opd.distill.teachers import run_teachers, score_piece
from opd.models import create_model
from rollout.spans import Span, span_cuts

B, T = 6, 16                       # GPT-digits-S at grid 4: 16 tokens


def teacher(seed: int, dtype: torch.dtype):
    torch.manual_seed(seed)
    m = create_model("GPT-digits-S", grid_size=4).to(dtype).eval()
    for p in m.parameters():                       # the preset zero-inits the head
        torch.nn.init.normal_(p, std=0.3)
    return m


def call(P: int, seed: int = 0) -> tuple[RolloutJob, TrajectoryBatch]:
    """A rollout call's job and its whole trajectory (tokens and behaviour log-probs drawn)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (B,), generator=g)
    tokens = torch.randint(0, 17, (B, T), generator=g)
    behaviour = -torch.rand(B, T - P, generator=g)
    job = RolloutJob(3, labels, tokens, P, "student", seed=1)
    return job, TrajectoryBatch(3, labels, P, tokens, 0, "student", behaviour_logprobs=behaviour)


def spans(whole: TrajectoryBatch, S: int) -> list[Span]:
    P = whole.prefix_len
    return [Span(a, b, whole.tokens[:, a:b], whole.behaviour_logprobs[:, a - P:b - P])
            for a, b in span_cuts(P, T, S, P, T)]


def by_spans(models, cfg, job, whole, S, pieces=((0, 2), (2, 6))):
    scoring = PartScoring(models, cfg, run_teachers(cfg), job)
    for span in spans(whole, S):
        scoring.score(span)
    return [scoring.piece(torch.arange(a, b), take_rows(whole, a, b)) for a, b in pieces]


def full(models, cfg, whole, pieces=((0, 2), (2, 6))):
    return [score_piece(models, cfg, run_teachers(cfg), take_rows(whole, a, b), score)
            for a, b in pieces]


@pytest.mark.parametrize("guided", [False, True])
@pytest.mark.parametrize("S", [1, 3, 5, 16])
@pytest.mark.parametrize("P", [0, 4])
def test_span_scores_equal_one_full_forward(guided, S, P):
    cfg = load_config("tiny", ["rollout.cfg_scale=2.5", f"teacher.guided={guided}"])
    job, whole = call(P)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-10)):
        models = [teacher(0, dtype)]
        got, want = by_spans(models, cfg, job, whole, S), full(models, cfg, whole)
        for (g, gs), (w, ws) in zip(got, want):
            assert g.teacher_logprobs.shape == w.teacher_logprobs.shape == (g.batch_size, T - P, 17)
            assert (g.teacher_logprobs - w.teacher_logprobs).abs().max() <= tol
            assert torch.equal(g.tokens, w.tokens)
            assert gs[0].kl_tokens == ws[0].kl_tokens
            assert abs(gs[0].kl_sum - ws[0].kl_sum) <= 100 * tol


def test_guidance_changes_the_scores():
    """The guided test above is not the unguided one twice."""
    job, whole = call(4)
    models = [teacher(0, torch.float64)]
    plain = by_spans(models, load_config("tiny", ["rollout.cfg_scale=2.5"]), job, whole, 3)
    guided = by_spans(models, load_config("tiny", ["rollout.cfg_scale=2.5", "teacher.guided=true"]),
                      job, whole, 3)
    assert (plain[0][0].teacher_logprobs - guided[0][0].teacher_logprobs).abs().max() > 1e-2


def test_topk_transport():
    cfg = load_config("tiny", ["teacher.transport=topk", "teacher.topk=5"])
    job, whole = call(4)
    models = [teacher(0, torch.float64)]
    for (g, _), (w, _) in zip(by_spans(models, cfg, job, whole, 3), full(models, cfg, whole)):
        assert torch.equal(g.teacher_topk_indices, w.teacher_topk_indices)
        assert g.teacher_topk_indices.dtype == w.teacher_topk_indices.dtype
        assert torch.allclose(g.teacher_topk_values, w.teacher_topk_values, atol=1e-10)
        assert g.teacher_logprobs is None


@pytest.mark.parametrize("teachers", [
    "teachers=[{name: low, classes: [0,1,2,3,4]}, {name: high, classes: [5,6,7,8,9]}]",
    "teachers=[{name: a, weight: 1.0}, {name: b, weight: 3.0}]"])
def test_several_teachers_route_and_mix_as_the_full_forward(teachers):
    cfg = load_config("tiny", [teachers])
    job, whole = call(4, seed=2)
    models = [teacher(0, torch.float64), teacher(1, torch.float64)]
    for (g, gs), (w, ws) in zip(by_spans(models, cfg, job, whole, 5), full(models, cfg, whole)):
        assert torch.allclose(g.teacher_logprobs, w.teacher_logprobs, atol=1e-10)
        assert [s.teacher for s in gs] == [s.teacher for s in ws]
        assert [None if s.rows is None else s.rows.tolist() for s in gs] == \
               [None if s.rows is None else s.rows.tolist() for s in ws]
        for a, b in zip(gs, ws):
            assert (a.kl_tokens, round(a.kl_sum, 6)) == (b.kl_tokens, round(b.kl_sum, 6))


def test_calls_scored_interleaved_keep_their_own_caches():
    """A teacher worker may score spans of several calls in turn: each scorer owns its KV
    caches, so interleaving changes nothing, bit for bit."""
    cfg = load_config("tiny", ["rollout.cfg_scale=2.0", "teacher.guided=true"])
    models = [teacher(0, torch.float32)]
    (job1, whole1), (job2, whole2) = call(4, seed=1), call(0, seed=2)
    alone = [by_spans(models, cfg, job1, whole1, 3), by_spans(models, cfg, job2, whole2, 3)]
    one, two = (PartScoring(models, cfg, run_teachers(cfg), j) for j in (job1, job2))
    s1, s2 = spans(whole1, 3), spans(whole2, 3)
    for k in range(max(len(s1), len(s2))):
        for scoring, ss in ((one, s1), (two, s2)):
            if k < len(ss):
                scoring.score(ss[k])
    for scoring, whole, want in ((one, whole1, alone[0]), (two, whole2, alone[1])):
        got = scoring.piece(torch.arange(0, 2), take_rows(whole, 0, 2))[0]
        assert torch.equal(got.teacher_logprobs, want[0][0].teacher_logprobs)


def test_spans_out_of_order_or_an_incomplete_call_are_refused():
    cfg = load_config("tiny", [])
    model = teacher(0, torch.float32)
    job, whole = call(4)
    scorer = SpanScorer(model, cfg.teachers[0], 1.0, job.labels, job.tokens[:, :4], T)
    with pytest.raises(ValueError, match="does not follow"):
        scorer.score(whole.tokens[:, 6:8], 6)
    scorer.score(whole.tokens[:, 4:8], 4)
    with pytest.raises(ValueError, match="scored up to token 8 of 16"):
        scorer.attach(whole, torch.arange(B))
