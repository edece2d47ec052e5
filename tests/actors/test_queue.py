"""TrajectoryQueue: strict on-policy hands out only the current version, bounded staleness
records lags <= k, the actor hands each learner rank its refs.  The queue has no bound of its
own: the planner's is tested in tests/actors/test_core.py."""

import pytest

from actors.workers.queue import QueueCore, QueueItem, TrajectoryQueue


def item(step, version, samples=4):
    return QueueItem(step=step, batch_id=100 + step, version=version, samples=samples)


def test_strict_mode_never_hands_out_an_old_version():
    q = QueueCore(staleness=0)
    q.put(item(3, 2))
    q.put(item(4, 3))
    got = q.get(learner_version=3)
    assert (got.step, got.version) == (4, 3)
    # the version-2 item was too old at version 3: never handed out, dropped and counted
    assert q.counts["expired"] == 1 and q.items == []
    assert q.get(learner_version=3) is None
    assert q.lags == {0: 4} and q.counts["handed_out"] == 1


def test_strict_mode_hands_out_the_current_version_by_step():
    q = QueueCore(staleness=0)
    q.put(item(6, 5))
    q.put(item(5, 5))
    assert q.get(5, step=6).step == 6
    assert q.get(5).step == 5
    assert q.get(5) is None


@pytest.mark.parametrize("k", [1, 2])
def test_bounded_staleness_records_lags_up_to_k(k):
    q = QueueCore(staleness=k)
    for v in range(5):                       # items of versions 0..4 at learner version 4
        q.put(item(10 + v, v, samples=2))
    handed = []
    while (got := q.get(learner_version=4)) is not None:
        handed.append(got.version)
    assert sorted(handed) == list(range(4 - k, 5))
    assert q.lags == {lag: 2 for lag in range(k + 1)}            # 2 samples per version
    assert q.counts["expired"] == 4 - k and q.items == []        # versions 0 .. 3 - k
    assert (q.stats()["max_lag"], q.stats()["samples"]) == (k, 2 * (k + 1))


def test_a_future_version_is_not_handed_out():
    q = QueueCore(staleness=3)
    q.put(item(1, 2))
    assert q.get(learner_version=1) is None


def test_pieces_are_sealed_by_generation_and_dropped_once_handed_out():
    from actors.workers.queue import PieceStore
    store = PieceStore(world_size=2)
    assert store.put(5, 0, 0, ["p0r0", "p0r1"]) and store.put(5, 0, 1, ["p1r0", None])
    assert store.put(5, 1, 0, ["new0", "new1"])                  # a re-planned generation
    with pytest.raises(KeyError, match=r"step 5 generation 1: pieces \[1\]"):
        store.seal(5, 1, pieces=2)
    assert store.seal(5, 0, pieces=2) == [[["p0r0"], ["p1r0"]], [["p0r1"], [None]]]
    assert store.pieces == {}                                     # generation 1 dropped too
    # two teachers' shares of a piece: each rank gets both, in teacher order
    assert store.put(6, 0, 0, ["b0", "b1"], teacher=1) and store.put(6, 0, 0, ["a0", "a1"], teacher=0)
    assert store.get(6, 0, 0)[0] == [["a0", "b0"], ["a1", "b1"]]
    assert store.seal(6, 0, pieces=1) == [[["a0", "b0"]], [["a1", "b1"]]]
    store.handed_out_below = 6
    assert not store.put(5, 2, 0, ["late", "late"]) and store.dropped == 1
    assert not store.put(7, 0, 0, ["one rank only"])              # a piece per rank or nothing


def test_queue_actor_hands_each_rank_its_refs(ray_session):
    ray = ray_session
    q = ray.remote(TrajectoryQueue).options(num_cpus=0).remote(0, 2)
    r0, r1 = ray.put({"rank": 0}), ray.put({"rank": 1})
    assert ray.get(q.put_piece.remote(0, 0, 0, [r0, r1]))
    ray.get(q.seal.remote(QueueItem(0, 0, 0, samples=2, generated_tokens=6), 0, 1))
    taken1 = ray.get(q.take.remote(0, 0, 1))
    taken0 = ray.get(q.take.remote(0, 0, 0))                     # the same item for rank 0
    assert (taken0["batch_id"], taken0["generated_tokens"], taken1["samples"]) == (0, 6, 2)
    assert [ray.get(r) for r in taken0["refs"]] == [[{"rank": 0}]]
    assert [ray.get(r) for r in taken1["refs"]] == [[{"rank": 1}]]
    assert ray.get(q.take.remote(0, 0, 0)) is None               # handed out to every rank
    assert not ray.get(q.put_piece.remote(0, 1, 0, [r0, r1]))      # late piece of a trained step
    ray.kill(q)

