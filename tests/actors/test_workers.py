"""Rollout and teacher workers (as plain objects: the Ray wrapper adds nothing to their logic)
and the weight wire format."""
import numpy as np
import pytest
import torch

from actors.transport.weights import (load_numpy_weights, make_buckets, state_dict_to_numpy,
                                      tag_weights, weights_nbytes)
from actors.workers.rollout import RolloutWorker, StaleWeightsError
from actors.workers.teacher import TeacherWorker
from opd.distill.batch import TrajectoryBatch
from opd.config.schema import load_config
from opd.data import PrefixBatcher
from opd.models.factory import load_role_model
from opd.data.splits import open_dataset
from opd.distill.steps import RolloutJob, build_engine, prefix_len_for, generate, score


@pytest.fixture(scope="module")
def setup(ray_session, tiny_overrides):
    cfg = load_config("tiny", [*tiny_overrides, "rollout.gamma=2", "teacher.transport=topk",
                               "teacher.topk=4"])
    train = open_dataset(cfg, "train")
    pb = next(PrefixBatcher(train, 4, 0))
    job = RolloutJob(pb.batch_id, pb.labels, pb.tokens, prefix_len_for(0.5, train.seq_len),
                     "student", 0)
    return cfg, job, load_role_model(cfg, "student", progress=False)


def test_rollout_worker_generates_only_the_version_it_holds(setup, ray_session):
    """It streams a part's pieces as their rows complete, each put whole for a teacher, then
    the part's report; only at the version it holds."""
    from actors.transport.delivery import PartReport, PieceTag
    from opd.distill.stream import PartStream
    ray_get = ray_session.get
    cfg, job, student = setup
    worker = RolloutWorker(cfg, 0)
    tags = [PieceTag(0, 0, p, ((0, 2),), 3) for p in (5, 6)]         # pieces 5, 6 of a step
    with pytest.raises(StaleWeightsError, match="holds policy version None"):
        next(worker.generate(job, 0, tags, None, True))
    weights = state_dict_to_numpy(student)
    with pytest.raises(ValueError, match="tagged version 5"):
        worker.load_weights(4, tag_weights(weights, 5))
    worker.load_weights(3, tag_weights(weights, 3))
    *pieces, end = worker.generate(job, 3, tags, None, True)
    want = list(PartStream(student, build_engine(cfg), job, cfg, 3, [2, 2]))
    assert [p.piece for p in pieces] == [tags[w.index].piece for w in want]   # the same order
    for got, w in zip(pieces, want):
        batch = TrajectoryBatch.from_numpy_dict(ray_get(got.payload))
        assert torch.equal(batch.tokens, w.batch.tokens) and batch.policy_version == 3
        assert torch.equal(batch.behaviour_logprobs, w.batch.behaviour_logprobs)
        assert (got.rows, got.generated_tokens) == (2, w.batch.num_generated_tokens)
    whole = generate(student, build_engine(cfg), job, cfg, policy_version=3)
    assert isinstance(end, PartReport) and (end.rows, end.generated_tokens) == (
        4, whole.num_generated_tokens)
    assert end.stats.rounds == whole.rollout_stats.rounds
    with pytest.raises(StaleWeightsError, match="holds policy version 3"):
        next(worker.generate(job, 4, tags, None, True))


def test_a_rollout_worker_holds_what_its_last_calls_put(setup):
    """The payloads a call yields stay referenced by the worker that put them for its next
    KEPT_CALLS - 1 calls (Ray can free an object yielded inside a streaming generator's item
    before the driver has registered as its borrower: actors/transport/delivery.py)."""
    from actors.transport.delivery import KEPT_CALLS, PieceTag
    cfg, job, student = setup
    worker = RolloutWorker(cfg, 0)
    worker.load_weights(3, tag_weights(state_dict_to_numpy(student), 3))
    tags = [PieceTag(0, 0, p, ((0, 2),), 3) for p in (0, 1)]
    calls = []
    for _ in range(KEPT_CALLS + 1):
        *pieces, _end = worker.generate(job, 3, tags, None, True)
        calls.append([p.payload for p in pieces])
    assert [len(c) for c in calls] == [2] * (KEPT_CALLS + 1)
    assert list(worker.kept) == calls[1:]                      # the oldest call's let go


def test_teacher_worker_delivers_each_rank_only_its_rows(setup, ray_session):
    """A piece of 4 rows over 2 learner ranks: scored and cut, rank 0 gets its rows 0-1, rank 1
    rows 2-3, each exactly what opd.distill.steps.score gives for those rows, and the report's
    byte count is the ranks' bytes."""
    from actors.transport.delivery import PieceTag, payload_nbytes
    from opd.distill.pieces import rank_cuts
    from actors.workers.queue import QueueItem, TrajectoryQueue
    from opd.distill.pieces import take_rows
    from opd.distill.teachers import share_from_numpy
    cfg, job, student = setup
    traj = generate(student, build_engine(cfg), job, cfg, policy_version=0)
    queue = ray_session.remote(TrajectoryQueue).remote(0, 2)
    cuts = rank_cuts(4, 2)
    assert cuts == ((0, 2), (2, 4))
    report = TeacherWorker(cfg, 0).score(traj.to_numpy_dict(), PieceTag(0, 0, 0, cuts, 0), queue)
    want = score(load_role_model(cfg, "teacher", progress=False), traj, cfg.teachers[0],
                 cfg.rollout.cfg_scale)
    ray_session.get(queue.seal.remote(QueueItem(0, job.batch_id, 0, samples=4), 0, 1))
    nbytes = 0
    for rank, (a, b) in enumerate(cuts):
        taken = ray_session.get(queue.take.remote(0, 0, rank))
        ((ref,),) = taken["refs"]                  # its one piece: one share (one teacher)
        payload = ray_session.get(ref)
        nbytes += payload_nbytes(payload)
        got = share_from_numpy(payload)
        assert (got.teacher, got.rows) == (0, None)   # the one teacher's share: every row
        got, rows = got.batch, take_rows(want, a, b)
        assert torch.equal(got.teacher_topk_indices, rows.teacher_topk_indices)
        assert torch.equal(got.teacher_topk_values, rows.teacher_topk_values)
        assert torch.equal(got.tokens, rows.tokens) and got.batch_size == 2
    assert report.nbytes == nbytes and report.rows == 4 and report.payload is None
    ray_session.kill(queue)


def test_numpy_weights_round_trip_exactly(setup):
    _, _, student = setup
    weights = state_dict_to_numpy(student)
    assert all(a.dtype == np.float32 and a.flags.c_contiguous for a in weights.values())
    assert weights_nbytes(weights) == sum(p.numel() * 4 for p in student.state_dict().values())
    other = load_role_model(setup[0], "teacher", progress=False)     # another shape: refused
    with pytest.raises((KeyError, ValueError)):
        load_numpy_weights(other, weights)
    copy = type(student)(student.args)          # fresh initialisation
    assert not torch.equal(copy.output.weight, student.output.weight)
    frozen = {k: v.copy() for k, v in weights.items()}
    for a in frozen.values():
        a.setflags(write=False)                  # like object-store buffers
    load_numpy_weights(copy, frozen)
    for k, v in copy.state_dict().items():
        assert torch.equal(v, student.state_dict()[k]), k


def test_buckets_cover_every_parameter_once_in_sorted_order():
    shapes = {"b": (10, 10), "a": (5,), "c": (1000,), "d": (3, 3)}
    buckets = make_buckets(shapes, bucket_bytes=4 * 120)
    names = [n for b in buckets for n in b.names]
    assert names == sorted(shapes)
    assert [b.names for b in buckets] == [("a", "b"), ("c",), ("d",)]
    assert all(b.numel == sum(int(np.prod(s)) for s in b.shapes) for b in buckets)


def test_a_worker_s_torch_threads_follow_its_ray_cpu_share(setup, tiny_overrides):
    """Overlapping stages must not oversubscribe the cores: each actor runs as many torch
    threads as whole CPUs its role asks Ray for, at least one."""
    from actors.workers.base import cpu_threads
    assert [cpu_threads(c) for c in (0.0, 0.25, 0.5, 1.0, 2.5, 4)] == [1, 1, 1, 1, 2, 4]
    cfg = load_config("tiny", [*tiny_overrides, "teacher.num_cpus=2", "rollout.num_cpus=0.5"])
    before = torch.get_num_threads()
    try:
        assert TeacherWorker(cfg, 0).info()["threads"] == 2
        assert RolloutWorker(cfg, 0).info()["threads"] == 1
    finally:
        torch.set_num_threads(before)
