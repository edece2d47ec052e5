"""A step's phase (actors/driver/progress.py `StepPhase`, kept by actors/driver/step.py): one
field along every path a step takes (streamed, sealed first, reused, on data, re-planned, a piece
lost), each transition checked against the table of legal ones; no Ray.  The events are
tests/actors/test_step.py's, 2 parts of 2 pieces each, trained by 2 ranks."""
import pytest

from actors.driver.commands import Generate, HandOut, Replan, Trainable, Trained
from actors.driver.progress import IllegalTransition, StepPhase
from actors.driver.step import Step
from actors.transport.delivery import PartReport
from opd.distill.rollout_stats import RolloutStats
from tests.actors.test_step import (LAYOUT, answer, delivered_step, part, piece, result,
                                     step_of)


def train_all(s: Step) -> list:
    """Every rank (2) answers every piece handed out; the commands of the last answer."""
    out = []
    s.hand_out()
    for p in range(LAYOUT.pieces):
        for r in (0, 1):
            out = s.piece_trained(p, 1, r, answer(r, p, result=result(r)), ranks=2)
    return out


def test_a_streamed_step_trains_while_its_pieces_come_then_sealed_until_done():
    s = step_of()
    assert s.phase is StepPhase.PLANNED
    s.start()
    assert s.phase is StepPhase.GENERATING and not s.trains
    s.piece_made(0, 1, piece(0))
    s.piece_scored(0, piece(0), busy=0.1)
    s.begin_training(published=3)
    assert s.phase is StepPhase.STREAMING and s.trains and not s.sealed
    for p, c in ((1, 0), (2, 1), (3, 1)):
        s.piece_made(c, 1, piece(p))
        s.piece_scored(p, piece(p), busy=0.1)
    assert s.phase is StepPhase.STREAMING and s.sealable     # Seal returned, not carried out
    s.seal()
    assert s.phase is StepPhase.TRAINING and s.sealed and s.trains
    for c in (0, 1):
        s.part_made(c, 1, part(), busy=1.0)
    assert train_all(s) == [Trained([result(0), result(1)])]
    assert s.phase is StepPhase.DONE and not s.trains


def test_a_step_that_cannot_stream_is_sealed_before_it_trains():
    s = delivered_step(version=2)                              # older than the published 3
    assert s.phase is StepPhase.GENERATING and s.begin_training(published=3) is None
    s.seal()
    assert s.phase is StepPhase.SEALED and not s.trains
    assert s.begin_training(published=3).prefetch and s.phase is StepPhase.TRAINING
    assert train_all(s) == [Trained([result(0), result(1)])] and s.phase is StepPhase.DONE


def test_a_step_on_a_reused_rollout_is_born_sealed():
    origin = delivered_step()
    origin.seal()
    s = Step.reusing(origin, 4, gen=1, schedule="p")
    assert s.phase is StepPhase.SEALED and s.start() == [Trainable()]
    assert s.phase is StepPhase.SEALED
    s.begin_training(published=4)
    assert s.phase is StepPhase.TRAINING
    assert train_all(s) == [Trained([result(0), result(1)])] and s.phase is StepPhase.DONE


def test_a_step_on_data_is_generating_while_its_pieces_are_scored():
    s = step_of(source="data", version=3)
    s.start()
    assert s.phase is StepPhase.GENERATING
    for p in range(4):
        s.piece_scored(p, piece(p), busy=0.1)
        if p == 0:
            s.begin_training(published=5)                      # its own version: streams
            assert s.phase is StepPhase.STREAMING
    assert s.seal() == [HandOut(3, 1, False)] and s.phase is StepPhase.TRAINING
    assert train_all(s) == [Trained([result(0), result(1)])] and s.phase is StepPhase.DONE


def test_a_replanned_step_is_generating_again_and_no_longer_trains():
    s = step_of(version=2)
    s.start()
    assert s.part_failed(0, 1, published=3) == [Replan()]
    s.replanned(3, gen=1)
    assert s.phase is StepPhase.GENERATING and s.training is None
    stale = delivered_step(version=2)                          # trained while prefetching
    stale.seal()
    stale.begin_training(published=3)
    stale.hand_out()
    for r in (0, 1):
        out = stale.piece_trained(1, 1, r, answer(r, 1, lost=True), ranks=2)
    assert out == [Replan()]
    assert stale.replanned(3, gen=1) == [Generate(0, 2), Generate(1, 2)]
    assert stale.phase is StepPhase.GENERATING and not stale.trains and not stale.sealed


def test_a_piece_lost_while_training_keeps_the_step_training():
    s = delivered_step()
    s.seal()
    s.begin_training(published=3)
    s.hand_out()
    for r in (0, 1):
        s.piece_trained(0, 1, r, answer(r, 0), ranks=2)
        s.piece_trained(1, 1, r, answer(r, 1, lost=True), ranks=2)
    assert s.phase is StepPhase.TRAINING and s.pieces[1].delivered is None
    assert s.piece_scored(1, piece(1), busy=0.1) == [HandOut(p, 2, False) for p in (1, 2, 3)]
    for p in (1, 2, 3):
        for r in (0, 1):
            out = s.piece_trained(p, 2, r, answer(r, p, result=result(r)), ranks=2)
    assert out == [Trained([result(0), result(1)])] and s.phase is StepPhase.DONE


def test_an_illegal_transition_raises():
    s = step_of()
    s.start()
    s.piece_made(0, 1, piece(0))
    s.piece_scored(0, piece(0), busy=0.1)
    s.begin_training(published=3)                              # streaming: it can be made again,
    with pytest.raises(IllegalTransition, match="step 3 cannot go from STREAMING to GENERATING"):
        s.replanned(3, gen=1)                                  # so it is never re-planned
    s.seal()
    with pytest.raises(IllegalTransition, match="from TRAINING to SEALED"):
        s.seal()
    sealed = delivered_step()
    sealed.seal()
    with pytest.raises(IllegalTransition, match="from SEALED to SEALED"):
        sealed.seal()                                          # sealed twice
    done = delivered_step()
    done.seal()
    done.begin_training(published=3)
    train_all(done)
    with pytest.raises(IllegalTransition, match="from DONE to GENERATING"):
        done.replanned(3, gen=1)


def sealed_and_training():
    """A step of two calls whose four pieces are made, scored and sealed, training, before
    either call's report."""
    s = step_of()
    s.start()
    for p, c in ((0, 0), (1, 0), (2, 1), (3, 1)):
        s.piece_made(c, 1, piece(p))
        s.piece_scored(p, piece(p), busy=0.1)
    s.seal()
    s.begin_training(published=3)
    s.hand_out()
    return s


def test_the_step_is_done_only_with_every_call_s_report():
    """A call's report travels after its last piece, which may be scored, sealed and trained
    first: the step holds its Trained until the report is in (its row reads every call's), and
    a call that fails then ends without its statistics (its pieces are trained)."""
    s = sealed_and_training()
    assert s.part_made(1, 1, part(), busy=1.0) == []
    assert train_all(s) == [] and s.phase is StepPhase.TRAINING   # part 0's report is missing
    assert s.part_made(0, 1, part(), busy=1.0) == [Trained([result(0), result(1)])]
    assert s.phase is StepPhase.DONE and sorted(s.ended) == [0, 1]
    t = sealed_and_training()
    t.part_made(0, 1, part(), busy=1.0)
    assert train_all(t) == []
    assert t.part_failed(1, 1, published=3) == [Trained([result(0), result(1)])]
    assert t.ended[1] == PartReport(4, 12, RolloutStats()) and t.phase is StepPhase.DONE
