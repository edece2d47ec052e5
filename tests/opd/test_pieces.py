"""A step's pieces (opd/distill/pieces.py, opd/distill/stream.py): split rollouts with their
image ids equal the whole batch's rollout, also when sampling (the engines key random numbers by
(seed, image id, position)); a streamed rollout call cuts its pieces in the order its rows
complete; merge puts the rows back together."""
import copy

import pytest
import torch

from opd.distill.pieces import (auto_pieces, merge_batches, piece_sizes, rank_cuts, row_ranges,
                                split_job, step_layout, step_parts, step_pieces, take_rows)
from opd.distill.stream import PartStream
from opd.distill.results import combine_metrics
from opd.config.schema import load_config
from opd.models import create_model
from opd.distill.steps import (RolloutJob, backward_piece, build_engine, build_objective, engine_call,
                               generate, score)


def _ranges(batch: int, parts: int) -> list[torch.Tensor]:
    return [torch.arange(a, b) for a, b in row_ranges(batch, parts)]


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


@pytest.mark.parametrize("parts", [2, 3, 5])
def test_split_sampled_rollout_equals_the_whole_batch(setup, parts):
    cfg, student, job = setup
    engine = build_engine(cfg)
    whole = generate(student, engine, job, cfg, policy_version=2)
    subs = [generate(student, engine, j, cfg, policy_version=2) for j in split_job(job, _ranges(5, parts))]
    merged = merge_batches(subs)
    assert torch.equal(merged.tokens, whole.tokens)
    assert torch.equal(merged.labels, whole.labels)
    assert torch.equal(merged.behaviour_logprobs, whole.behaviour_logprobs)
    shard = take_rows(merged, 1, 3)
    assert torch.equal(shard.behaviour_logprobs, whole.behaviour_logprobs[1:3])
    assert merged.rollout_stats.generated_tokens == whole.rollout_stats.generated_tokens
    # without the image ids every sub-batch would reuse ids 0.. and draw other samples
    plain = [generate(student, engine, j.__class__(**{**j.__dict__, "image_ids": None}), cfg, 2)
             for j in split_job(job, _ranges(5, parts))]
    assert not torch.equal(merge_batches(plain).tokens, whole.tokens)


def test_scored_parts_merge_to_the_scores_of_the_whole(setup):
    cfg, student, job = setup
    engine = build_engine(cfg)
    whole = score(student, generate(student, engine, job, cfg, 0), cfg.teachers[0],
                  cfg.rollout.cfg_scale)
    parts = [score(student, take_rows(whole, a, b), cfg.teachers[0],
                  cfg.rollout.cfg_scale) for a, b in row_ranges(5, 2)]
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
    assert piece_sizes(8, 2, 2) == [4, 4] and piece_sizes(5, 1, 2) == [3, 2]
    assert rank_cuts(4, 2) == ((0, 2), (2, 4)) and rank_cuts(5, 2) == ((0, 3), (3, 5))
    with pytest.raises(ValueError, match="leave a rank without rows"):
        piece_sizes(8, 2, 5)
    with pytest.raises(ValueError, match="without rows"):
        rank_cuts(1, 2)


def test_auto_pieces_are_about_eight_rows_a_rank_and_one_per_worker_at_least():
    assert auto_pieces(32, 1, 1) == 4
    assert auto_pieces(32, 2, 1) == 2
    assert auto_pieces(4, 1, 1) == 1
    assert auto_pieces(4, 1, 3) == 3                   # a piece per worker
    assert auto_pieces(4, 2, 3) == 2                   # but a row per rank at least
    cfg = load_config("tiny", ["data.batch_size=32", "rollout.num_workers=2..6"])
    assert step_pieces(cfg) == 6 and step_pieces(load_config("tiny", ["distill.pieces=3"])) == 3


def test_every_teachers_pool_counts_in_the_pieces_and_calls():
    """Auto pieces give every worker of the largest pool work: a teacher's pool of several
    (`teachers[i].num_workers`) as well as the one teacher's."""
    one = load_config("tiny", ["data.batch_size=32", "teacher.num_workers=6"])
    two = load_config("tiny", ["data.batch_size=32", "teachers=[{name: a, weight: 1.0}, "
                               "{name: b, weight: 1.0, num_workers: 6}]"])
    for cfg in (one, two):
        assert (step_pieces(cfg), step_parts(cfg)) == (6, 6)
    assert step_pieces(load_config("tiny", ["data.batch_size=32"])) == 4


@pytest.mark.parametrize("pieces", [2, 3])
def test_gradients_accumulated_over_pieces_equal_the_whole_batch_gradient(setup, pieces):
    """The weights n_p / N make the pieces' accumulated gradient the gradient of the batch's
    token mean (float32 round-off apart), and the pieces' combined loss its loss."""
    cfg, student, job = setup
    torch.manual_seed(5)
    teacher = create_model("GPT-digits-S", grid_size=4).eval()
    objective = build_objective(load_config("tiny", ["distill.objective=gkd", "distill.beta=0.3"]))
    traj = score(teacher, generate(student, build_engine(cfg), job, cfg, 0), cfg.teachers[0],
                  cfg.rollout.cfg_scale)

    def grads(batches):
        model = copy.deepcopy(student)
        total = sum(b.num_generated_tokens for b in batches)
        results = [backward_piece(model, b, objective, weight=b.num_generated_tokens / total,
                                  dropout=False) for b in batches]
        return [p.grad.clone() for p in model.parameters()], combine_metrics(results)

    whole, m_whole = grads([traj])
    split, m_split = grads([take_rows(traj, a, b) for a, b in row_ranges(5, pieces)])
    for a, b in zip(split, whole):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    assert m_split["loss"] == pytest.approx(m_whole["loss"], rel=1e-6)
    assert m_split["tokens"] == m_whole["tokens"] == 5 * 12


def test_a_step_on_data_is_one_piece_and_rollout_calls_are_runs_of_pieces():
    cfg = load_config("tiny", ["data.batch_size=32", "rollout.num_workers=2"])
    student, data = step_layout(cfg, "student"), step_layout(cfg, "data")
    assert student.parts == ((0, 1), (2, 3)) and student.sizes == (8, 8, 8, 8)
    assert [student.part_range(c) for c in range(2)] == [(0, 16), (16, 32)]
    assert [student.part_of(p) for p in range(4)] == [0, 0, 1, 1]
    assert student.part_sizes(1) == [8, 8] and student.cuts(3) == ((0, 8),)
    assert data.parts == ((0,),) and data.sizes == (32,)
    uneven = step_layout(load_config("tiny", ["data.batch_size=10", "distill.pieces=3",
                                              "rollout.num_workers=2"]), "student")
    assert uneven.sizes == (4, 3, 3) and uneven.parts == ((0, 1), (2,))
    assert [r.tolist() for r in uneven.call_rows] == [list(range(7)), [7, 8, 9]]


@pytest.mark.parametrize("engine_name", ["hbsjd", "cached_ar"])
def test_a_streamed_call_hands_out_each_piece_once_its_rows_are_complete(setup, engine_name):
    """Piece k holds the part's k-th contiguous run of sizes[k] rows, with exactly the whole
    call's tokens and behaviour log-probs, and comes out after the round in which its last row
    completed, before any piece whose rows complete later; the call's stats are the whole
    call's."""
    cfg, student, job = setup
    engine = build_engine(cfg, engine_name)
    whole = generate(student, engine, job, cfg, policy_version=2)
    stream = PartStream(student, engine, job, cfg, 2, [2, 2, 1])
    pieces = list(stream)
    assert sorted(p.index for p in pieces) == [0, 1, 2]
    by_index = {p.index: p for p in pieces}
    assert [by_index[k].rows.tolist() for k in range(3)] == [[0, 1], [2, 3], [4]]
    for p in pieces:
        assert torch.equal(p.batch.tokens, whole.tokens[p.rows])
        assert torch.equal(p.batch.labels, whole.labels[p.rows])
        assert torch.equal(p.batch.behaviour_logprobs, whole.behaviour_logprobs[p.rows])
    # the order: by the round each piece's last row completed, ties in piece order
    args, kwargs = engine_call(student, job, cfg)
    result = engine.generate(*args, **kwargs)
    last = torch.where(result.committed > 0,
                       torch.arange(result.committed.shape[0])[:, None], -1).max(0).values
    done = {k: int(last[by_index[k].rows].max()) for k in range(3)}
    assert [p.index for p in pieces] == sorted(range(3), key=lambda k: (done[k], k))
    assert stream.stats.generated_tokens == whole.rollout_stats.generated_tokens
    assert stream.stats.rounds == whole.rollout_stats.rounds
    with pytest.raises(ValueError, match="do not cut"):
        PartStream(student, engine, job, cfg, 2, [2, 2])
