"""A step's pieces (opd/distill/pieces.py): split rollouts with their image ids equal the whole batch's rollout, also when
sampling (the engines key random numbers by (seed, image id, position)); merge and learner
shards put the rows back in order."""
import copy

import pytest
import torch

from opd.distill.pieces import (auto_pieces, merge_batches, piece_cuts, step_layout,
                        piece_rows, row_ranges, shard_rows, split_job, step_pieces, take_rows)
from opd.distill.results import combine_metrics
from opd.config.schema import load_config
from opd.models import create_model
from opd.distill.steps import RolloutJob, backward_piece, build_engine, build_objective, generate, score


@pytest.fixture(scope="module")
def setup():
    cfg = load_config("tiny", ["rollout.decoding=sample", "rollout.temperature=1.5",
                               "rollout.gamma=2", "rollout.cfg_scale=2.0", "teacher.transport=topk",
                               "teacher.topk=5"])
    torch.manual_seed(0)
    student = create_model("GPT-digits-S", grid_size=4).eval()   # 16 tokens: quick
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 10, (5,), generator=g)
    tokens = torch.randint(0, 17, (5, 16), generator=g)
    job = RolloutJob(7, labels, tokens, prefix_len=4, source="student", seed=3)
    return cfg, student, job


def test_row_ranges_cover_the_batch_in_order():
    assert row_ranges(5, 2) == [(0, 3), (3, 5)]
    assert row_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert row_ranges(2, 3) == [(0, 1), (1, 2)]            # never an empty part
    assert shard_rows(8, 2) == [(0, 4), (4, 8)]
    with pytest.raises(ValueError, match="does not split evenly"):
        shard_rows(5, 2)


@pytest.mark.parametrize("parts", [2, 3, 5])
def test_split_sampled_rollout_equals_the_whole_batch(setup, parts):
    cfg, student, job = setup
    engine = build_engine(cfg)
    whole = generate(student, engine, job, cfg, policy_version=2)
    subs = [generate(student, engine, j, cfg, policy_version=2) for j in split_job(job, piece_rows(5, 1, parts))]
    merged = merge_batches(subs)
    assert torch.equal(merged.tokens, whole.tokens)
    assert torch.equal(merged.labels, whole.labels)
    assert torch.equal(merged.behaviour_logprobs, whole.behaviour_logprobs)
    shard = take_rows(merged, 1, 3)
    assert torch.equal(shard.behaviour_logprobs, whole.behaviour_logprobs[1:3])
    assert merged.rollout_stats.generated_tokens == whole.rollout_stats.generated_tokens
    # without the image ids every sub-batch would reuse ids 0.. and draw other samples
    plain = [generate(student, engine, j.__class__(**{**j.__dict__, "image_ids": None}), cfg, 2)
             for j in split_job(job, piece_rows(5, 1, parts))]
    assert not torch.equal(merge_batches(plain).tokens, whole.tokens)


def test_scored_parts_merge_to_the_scores_of_the_whole(setup):
    cfg, student, job = setup
    engine = build_engine(cfg)
    whole = score(student, generate(student, engine, job, cfg, 0), cfg)
    parts = [score(student, take_rows(whole, a, b), cfg) for a, b in row_ranges(5, 2)]
    merged = merge_batches(parts)
    assert torch.equal(merged.teacher_topk_indices, whole.teacher_topk_indices)
    torch.testing.assert_close(merged.teacher_topk_values, whole.teacher_topk_values,
                               rtol=0, atol=1e-5)


def test_merge_refuses_parts_of_different_batches(setup):
    cfg, student, job = setup
    traj = generate(student, build_engine(cfg), job, cfg, 0)
    other = take_rows(traj, 0, 2)
    other.batch_id = 8
    with pytest.raises(ValueError, match="do not belong together"):
        merge_batches([take_rows(traj, 2, 5), other])


def test_every_rank_has_rows_in_every_piece():
    rows = piece_rows(8, 2, 2)
    assert [r.tolist() for r in rows] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    shards = shard_rows(8, 2)
    assert [piece_cuts(r, shards) for r in rows] == [((0, 2), (2, 4)), ((0, 2), (2, 4))]
    assert [r.tolist() for r in piece_rows(5, 1, 2)] == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="leave a rank without rows"):
        piece_rows(8, 2, 5)


def test_auto_pieces_are_about_eight_rows_a_rank_and_one_per_worker_at_least():
    assert auto_pieces(32, 1, 1) == 4
    assert auto_pieces(32, 2, 1) == 2
    assert auto_pieces(4, 1, 1) == 1
    assert auto_pieces(4, 1, 3) == 3                   # a piece per worker
    assert auto_pieces(4, 2, 3) == 2                   # but a row per rank at least
    cfg = load_config("tiny", ["data.batch_size=32", "rollout.num_workers=2..6"])
    assert step_pieces(cfg) == 6 and step_pieces(load_config("tiny", ["distill.pieces=3"])) == 3


@pytest.mark.parametrize("pieces", [2, 3])
def test_gradients_accumulated_over_pieces_equal_the_whole_batch_gradient(setup, pieces):
    """The weights n_p / N make the pieces' accumulated gradient the gradient of the batch's
    token mean (float32 round-off apart), and the pieces' combined loss its loss."""
    cfg, student, job = setup
    torch.manual_seed(5)
    teacher = create_model("GPT-digits-S", grid_size=4).eval()
    objective = build_objective(load_config("tiny", ["distill.objective=gkd", "distill.beta=0.3"]))
    traj = score(teacher, generate(student, build_engine(cfg), job, cfg, 0), cfg)

    def grads(batches):
        model = copy.deepcopy(student)
        total = sum(b.num_generated_tokens for b in batches)
        results = [backward_piece(model, b, objective, weight=b.num_generated_tokens / total,
                                  dropout=False) for b in batches]
        return [p.grad.clone() for p in model.parameters()], combine_metrics(results)

    whole, m_whole = grads([traj])
    rows = piece_rows(5, 1, pieces)
    split, m_split = grads([take_rows(traj, int(r[0]), int(r[-1]) + 1) for r in rows])
    for a, b in zip(split, whole):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    assert m_split["loss"] == pytest.approx(m_whole["loss"], rel=1e-6)
    assert m_split["tokens"] == m_whole["tokens"] == 5 * 12


def test_a_step_on_data_is_one_piece_and_rollout_calls_are_runs_of_pieces():
    cfg = load_config("tiny", ["data.batch_size=32", "rollout.num_workers=2"])
    student, data = step_layout(cfg, "student"), step_layout(cfg, "data")
    assert student.parts == [[0, 1], [2, 3]] and len(student.rows) == 4
    assert [len(student.part_rows(c)) for c in range(2)] == [16, 16]
    assert [student.within_part(p) for p in range(4)] == [(0, 8), (8, 16), (0, 8), (8, 16)]
    assert data.parts == [[0]] and data.rows[0].tolist() == list(range(32))
