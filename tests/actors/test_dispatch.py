"""The dispatcher's worker pools (actors/driver/dispatch.py, pool.py) on made-up actors: no Ray.

A teacher worker holds two scorings (the one it runs and the next), and the scorings that
wait are handed out lowest (step, piece) first: a step's pieces complete in any order, but its
learner ranks train them in piece order, so piece 0 scored last would hold the whole step
back."""
from types import SimpleNamespace

from actors.driver.dispatch import Dispatcher
from actors.driver.pool import WorkerPool
from actors.driver.commands import Score
from actors.driver.tasks import PieceScoring


def test_a_pool_with_a_depth_gives_a_worker_no_more_tasks_than_that():
    pool = WorkerPool("teacher", ["a", "b"], depth=1)
    pool.busy[0] = 1
    assert pool.pick() == 1
    pool.busy[1] = 1
    assert pool.pick() is None
    deep = WorkerPool("rollout", ["a"])                         # no depth: always a worker
    deep.busy[0] = 5
    assert deep.pick() == 0


def test_work_pinned_to_a_worker_goes_to_it_while_it_is_up_whatever_its_depth():
    """A rollout call's spans and pieces (actors/driver/spans.py) go to one worker."""
    pool = WorkerPool("teacher", ["a", "b", "c"], depth=1)
    pool.busy.update({0: 3, 1: 2, 2: 1})
    assert pool.pick() is None                                  # every worker at its depth
    assert pool.pick(pinned=0) == 0                             # pinned: the depth is no bound
    assert pool.pick(pinned=-1) == 2                            # not placed yet: the least busy
    pool.failed(0)
    assert pool.pick(pinned=0) == 2                             # down: placed again


def scoring(step: int, piece: int) -> tuple[PieceScoring, Score]:
    return PieceScoring(step=step, gen=0, piece=piece, issue=1), Score(piece, 1)


def test_waiting_scorings_go_out_lowest_step_and_piece_first():
    groups = SimpleNamespace(rollout=[], teacher_pools={"teacher/default": ["t0"]})
    d = Dispatcher(groups, max_restarts=1)
    calls = []
    for step, piece in ((4, 2), (4, 0), (4, 3), (3, 1), (4, 1)):   # the order pieces came out
        task, c = scoring(step, piece)
        d.submit(task, c, lambda actor, p=(step, piece): calls.append((actor, p)) or p,
                 "teacher/default")
    assert calls == [("t0", (4, 2)), ("t0", (4, 0))]             # the worker took two
    assert d.waiting({"rollout"}) == []                          # none waits for that pool
    assert [(t.step, t.piece) for t, _ in d.waiting({"teacher/default"})] == [(3, 1), (4, 1),
                                                                              (4, 3)]
    assert d.waiting({"teacher/default"}) == []                  # given back once


def test_what_waits_goes_out_only_once_its_pool_changed():
    """Nothing polls the backlog: the pipeline hands out the commands of the pools that changed
    (a task ended, a worker came up after a probe or a weights load, or died for good)."""
    groups = SimpleNamespace(rollout=["r0"], teacher_pools={"teacher/default": ["t0"]})
    d = Dispatcher(groups, max_restarts=1)
    d.pools["teacher/default"].failed(0)
    task, c = scoring(3, 0)
    assert d.submit(task, c, lambda actor: None, "teacher/default") is None
    assert d.take_changed() == set()                            # nothing happened to the pool
    d.probe_answered("teacher/default", 0)                      # the worker is back
    assert d.take_changed() == {"teacher/default"} and d.take_changed() == set()
    assert [(t.step, t.piece) for t, _ in d.waiting({"teacher/default"})] == [(3, 0)]
    d.pools["rollout"].add("r1")                                # an elastic worker, starting
    d.started(1)
    assert d.take_changed() == {"rollout"} and d.pools["rollout"].up() == [0, 1]
    d.pools["teacher/default"].failed(0)
    for died in (True, True):
        d.probe_failed("teacher/default", 0, died=died)
        assert d.take_changed() == set()                        # restarting: no change yet
    d.probe_failed("teacher/default", 0, died=True)             # dead for good
    assert d.take_changed() == {"teacher/default"}
