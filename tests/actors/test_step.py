"""A step's life (actors/driver/step.py) on made-up events: no Ray.

Every path a step's parts and pieces can take through generation, scoring, faults and training,
with the commands the step answers with; parts (rollout calls) and pieces (streaming units) are
different indices here: 2 parts of 2 pieces each."""
import pytest
import torch

from actors.driver.commands import Generate, HandOut, Replan, Score, Seal, Trainable, Trained
from actors.driver.step import Step
from actors.transport.delivery import PartReport, PieceReport
from opd.distill.pieces import Layout
from opd.distill.results import LearnerResult, PieceAnswer
from opd.distill.rollout_stats import RolloutStats
from opd.distill.steps import RolloutJob

LAYOUT = Layout(sizes=(2, 2, 2, 2), parts=((0, 1), (2, 3)), world_size=2)


def step_of(*, source="student", scored=True, version=3) -> Step:
    job = RolloutJob(7, torch.arange(4), torch.zeros(4, 6, dtype=torch.int64), 3, source, 0)
    return Step(3, 7, source, version, [job, job], LAYOUT, gen=0, scored=scored, schedule="p")


def piece(p: int, payload="ref") -> PieceReport:
    return PieceReport(p, 2, 6, nbytes=10 + p, payload=payload)


def merged(p: int) -> PieceReport:
    """Piece p's delivery once its one share is scored (`piece(p)`'s): the shares' report merged,
    which holds no payload."""
    return PieceReport(p, 2, 6, nbytes=10 + p)


def part(seconds=0.0) -> PartReport:
    return PartReport(4, 12, RolloutStats(rounds=3, generated_tokens=12), seconds)


def answer(rank, p, **kw) -> PieceAnswer:
    return PieceAnswer(rank, p, **kw)


def result(rank) -> LearnerResult:
    return LearnerResult(rank, {"loss": 1.0, "tokens": 2.0}, 1.0)


def test_a_rollout_call_streams_its_pieces_to_scoring_and_delivery():
    s = step_of()
    assert s.start() == [Generate(0, 1), Generate(1, 1)]
    assert s.piece_made(1, 1, piece(2)) == [Score(2, 1)]        # part 1 hands out piece 2 first
    assert s.piece_made(1, 1, piece(2)) == []                    # being scored: once
    assert s.piece_made(0, 1, piece(0)) == [Score(0, 1)]
    s.piece_scored(2, piece(2), busy=0.5)
    assert [p.delivered for p in s.pieces] == [None, None, merged(2), None]
    s.part_made(1, 1, part(seconds=2.0), busy=9.0)
    assert s.times.busy["rollout"] == 2.0 and 1 in s.ended and 1 not in s.generating
    assert s.piece_made(1, 1, piece(3)) == [Score(3, 1)]
    for p in (0, 3):
        s.piece_scored(p, piece(p), busy=0.25)
    assert s.piece_made(0, 1, piece(1)) == [Score(1, 1)]
    s.piece_scored(1, piece(1), busy=0.25)
    s.part_made(0, 1, part(), busy=1.0)
    assert s.complete and s.sealable and s.times.busy["teacher"] == 1.25
    assert "rollout" in s.times.ended and "teacher" in s.times.ended


def test_an_unscored_call_delivers_its_pieces_itself():
    s = step_of(source="teacher", scored=False)
    s.start()
    made = [s.piece_made(c, 1, piece(p, payload=None)) for p, c in ((0, 0), (1, 0), (2, 1), (3, 1))]
    assert made == [[Trainable()], [], [], [Seal()]]             # delivered: no Score
    assert s.complete and "teacher" not in s.times.began


def test_a_failed_call_goes_again_alone_and_its_earlier_answers_are_dropped():
    s = step_of()
    s.start()
    s.piece_made(1, 1, piece(2))
    s.piece_scored(2, piece(2), busy=0.1)
    assert s.part_failed(1, 1, published=3) == [Generate(1, 2)]
    assert s.part_failed(1, 1, published=3) == []                # the same failure, twice
    assert s.piece_made(1, 1, piece(3)) == []                    # the dead call's: dropped
    assert s.piece_made(1, 2, piece(2)) == []                    # delivered already
    assert s.piece_made(1, 2, piece(3)) == [Score(3, 2)]


def test_a_failed_call_of_an_older_version_replans_the_step():
    """Rollout workers hold only the published version: a student call at an older one cannot
    be made again, the whole step is re-planned (as a new generation, from scratch)."""
    s = step_of(version=2)
    s.start()
    s.piece_made(0, 1, piece(0))
    assert s.part_failed(0, 1, published=3) == [Replan()]
    assert s.replanned(3, gen=5) == [Generate(0, 2), Generate(1, 2)]
    assert (s.version, s.gen, s.sealed) == (3, 5, False)
    assert all(p.made is None and p.delivered is None for p in s.pieces)


def test_a_step_on_data_runs_no_rollout_call_and_scores_every_piece_at_once():
    """Its suffixes are the data's: no Generate, its parts end at the start, and each piece is
    scored (built from its job by the teacher worker) at once; a failed scoring or a piece the
    learner lost is scored again, never made by a call."""
    data = step_of(source="data", version=2)
    assert data.start() == [Score(p, 0) for p in range(4)]
    assert sorted(data.ended) == [0, 1] and not data.generating
    assert [data.ended[c].generated_tokens for c in (0, 1)] == [4 * 3] * 2
    assert [(p.made.rows, p.made.generated_tokens) for p in data.pieces] == [(2, 6)] * 4
    assert "rollout" not in data.times.began
    assert data.score_failed(1) == [Score(1, 0)]
    for p in range(4):
        data.piece_scored(p, piece(p), busy=0.1)
    data.seal()
    assert data.begin_training(published=5) is not None               # its own version: streams
    data.hand_out()
    assert data.piece_trained(2, 1, 0, answer(0, 2, lost=True), ranks=1) == [Score(2, 0)]
    assert data.score_lost(2, 0) == [Score(2, 0)]                      # no call to make again


def test_a_scoring_that_failed_goes_again_from_the_same_payload():
    s = step_of()
    s.start()
    s.piece_made(0, 1, piece(0))
    assert s.score_failed(0) == [Score(0, 1)]


def test_a_scoring_whose_payload_died_makes_the_call_again_once():
    """The rollout worker died: its call fails and the scorings of its pieces find their input
    lost, in any order; the call goes again once and its new pieces are scored."""
    s = step_of()
    s.start()
    s.piece_made(0, 1, piece(0))
    s.piece_made(0, 1, piece(1))
    assert s.score_lost(0, 1) == [Generate(0, 2)]
    assert s.score_lost(1, 1) == []                              # the call is being made again
    assert s.part_failed(0, 1, published=3) == []                # its failure: issued since
    assert s.piece_made(0, 2, piece(0, "new")) == [Score(0, 2)]
    assert s.piece_made(0, 2, piece(1, "new")) == [Score(1, 2)]
    # a lost input that arrives after the new call already handed the piece out: score it now
    t = step_of()
    t.start()
    t.piece_made(0, 1, piece(0))
    t.part_failed(0, 1, published=3)
    assert t.piece_made(0, 2, piece(0, "new")) == []             # scoring the old payload
    assert t.score_lost(0, 1) == [Score(0, 2)]


def test_a_scoring_that_waited_for_a_worker_scores_the_latest_payload_or_the_new_call_does():
    """A teacher worker holds at most two scorings (the others wait in the pipeline's backlog);
    when a waiting one is due, its piece may have a newer payload, be delivered, or have lost
    its payload to a call issued again (then the new call's piece is scored when made, not
    dropped: before score_due, it waited for a scoring that never ran)."""
    s = step_of()
    s.start()
    assert s.piece_made(0, 1, piece(0)) == [Score(0, 1)]
    assert s.score_due(0, 1) == [Score(0, 1)]                    # due: score it
    assert s.score_due(0, 0) == []                               # not the one pending
    assert s.part_failed(0, 1, published=3) == [Generate(0, 2)]  # payload of issue 1 gone
    assert s.score_due(0, 1) == []                               # nothing to score yet
    assert s.piece_made(0, 2, piece(0, "new")) == [Score(0, 2)]  # the new call's piece is
    s.piece_scored(0, piece(0, "new"), busy=0.1)
    assert s.score_due(0, 2) == []                               # delivered meanwhile
    assert s.pieces[0].delivered == merged(0)


def delivered_step(**kw) -> Step:
    s = step_of(**kw)
    s.start()
    for p, c in ((0, 0), (1, 0), (2, 1), (3, 1)):
        s.piece_made(c, 1, piece(p))
        s.piece_scored(p, piece(p), busy=0.1)
    for c in (0, 1):
        s.part_made(c, 1, part(), busy=1.0)
    return s


def test_pieces_are_handed_out_in_order_and_the_last_once_sealed():
    """Each delivery returns what it lets happen: Trainable with piece 0, then (training) the
    hand-outs in piece order, Seal with the last piece, and its hand-out once sealed."""
    s = step_of()
    s.start()
    assert s.begin_training(published=3) is None                 # nothing delivered yet
    s.piece_made(1, 1, piece(2))
    assert s.piece_scored(2, piece(2), busy=0.1) == []
    assert s.begin_training(published=3) is None                 # piece 0 is not there
    s.piece_made(0, 1, piece(0))
    assert s.piece_scored(0, piece(0), busy=0.1) == [Trainable()]
    t = s.begin_training(published=3)
    assert t is not None and not t.prefetch
    assert s.hand_out() == [HandOut(0, 1, False)]
    s.piece_made(0, 1, piece(1))
    assert s.piece_scored(1, piece(1), busy=0.1) == [HandOut(1, 1, False), HandOut(2, 1, False)]
    s.piece_made(1, 1, piece(3))
    assert s.piece_scored(3, piece(3), busy=0.1) == [Seal()]    # the last waits for the seal
    assert s.seal() == [HandOut(3, 1, False)]
    for c in (0, 1):                                             # the calls' reports are in
        assert s.part_made(c, 1, part(), busy=1.0) == []
    assert s.piece_trained(3, 1, 0, answer(0, 3, result=result(0)), ranks=2) == []
    done = s.piece_trained(3, 1, 1, answer(1, 3, result=result(1)), ranks=2)
    assert done == [Trained([result(0), result(1)])]


@pytest.mark.parametrize("lost", range(4))
def test_a_piece_lost_at_the_learner_is_scored_again_and_handed_again(lost):
    """The teacher worker that delivered piece `lost` died: every rank reports it lost, it is
    scored again from its rollout payload, the pieces after it come back skipped and are
    handed again in order."""
    s = delivered_step()
    assert s.seal() == [Trainable()]
    s.begin_training(published=3)
    assert [h.piece for h in s.hand_out()] == [0, 1, 2, 3]
    for p in range(lost):
        for r in (0, 1):
            s.piece_trained(p, 1, r, answer(r, p), ranks=2)
    assert s.piece_trained(lost, 1, 0, answer(0, lost, lost=True), ranks=2) == []
    assert s.piece_trained(lost, 1, 1, answer(1, lost, lost=True), ranks=2) == [Score(lost, 1)]
    for p in range(lost + 1, 4):                                 # handed after it: skipped
        for r in (0, 1):
            assert s.piece_trained(p, 1, r, answer(r, p, skipped=True), ranks=2) == []
    assert s.hand_out() == []                                    # waits for the new delivery
    assert s.piece_scored(lost, piece(lost), busy=0.1) == [     # sealed already: no Seal
        HandOut(lost, 2, False)] + [HandOut(p, 2, False) for p in range(lost + 1, 4)]
    assert s.piece_trained(lost, 1, 0, answer(0, lost), ranks=2) == []   # an old hand-out's


def test_an_unscored_piece_lost_at_the_learner_makes_its_call_again():
    s = step_of(source="teacher", scored=False)
    s.start()
    for p, c in ((0, 0), (1, 0), (2, 1), (3, 1)):
        s.piece_made(c, 1, piece(p, payload=None))
    for c in (0, 1):
        s.part_made(c, 1, part(), busy=1.0)
    s.seal()
    s.begin_training(published=3)
    s.hand_out()
    for p in (0, 1):
        for r in (0, 1):
            s.piece_trained(p, 1, r, answer(r, p), ranks=2)
    s.piece_trained(2, 1, 0, answer(0, 2, lost=True), ranks=2)
    assert s.piece_trained(2, 1, 1, answer(1, 2, lost=True), ranks=2) == [Generate(1, 2)]
    assert [p.delivered for p in s.pieces] == [piece(0, None), piece(1, None), None, None]
    assert s.piece_made(1, 2, piece(2, None)) == [HandOut(2, 2, False)]
    assert s.pieces[2].delivered == piece(2, None) and s.pieces[3].delivered is None


def test_a_stale_step_trains_once_sealed_prefetching_and_a_lost_piece_replans_it():
    s = delivered_step(version=2)
    assert s.begin_training(published=3) is None                 # not sealed
    s.seal()
    t = s.begin_training(published=3)
    assert t.prefetch and [h.prefetch for h in s.hand_out()] == [True] * 4
    s.piece_trained(0, 1, 0, answer(0, 0, lost=True), ranks=2)
    assert s.piece_trained(0, 1, 1, answer(1, 0, lost=True), ranks=2) == [Replan()]
    assert s.training is None


def routed_step() -> Step:
    """Two teachers routing by class: rows of classes 0-4 to teacher 0, 5-9 to teacher 1; piece
    0 holds classes (0, 1), piece 1 (2, 7), piece 2 (8, 9), piece 3 (3, 6)."""
    from opd.config.schema import load_config
    from opd.distill.teachers import run_teachers
    teachers = run_teachers(load_config(None, [
        "teachers=[{name: a, classes: [0,1,2,3,4]}, {name: b, classes: [5,6,7,8,9]}]"]))
    jobs = [RolloutJob(7, torch.tensor(labels), torch.zeros(4, 6, dtype=torch.int64), 3,
                       "student", 0) for labels in ([0, 1, 2, 7], [8, 9, 3, 6])]
    return Step(3, 7, "student", 3, jobs, LAYOUT, gen=0, scored=True, schedule="p",
                teachers=teachers)


def test_a_piece_is_scored_by_each_teacher_its_rows_need_and_delivered_with_the_last_share():
    s = routed_step()
    assert [p.scorers for p in s.pieces] == [(0,), (0, 1), (1,), (0, 1)]
    s.start()
    assert s.piece_made(0, 1, piece(1)) == [Score(1, 1, 0), Score(1, 1, 1)]
    assert s.piece_made(1, 1, piece(2)) == [Score(2, 1, 1)]
    s.piece_scored(1, piece(1), busy=0.5, teacher=1)
    assert s.pieces[1].delivered is None                         # teacher 0's share missing
    assert s.score_failed(1, teacher=0) == [Score(1, 1, 0)]     # only that pool's share again
    assert s.score_failed(1, teacher=1) == []                    # delivered already: stands
    s.piece_scored(1, piece(1), busy=0.25, teacher=0)
    d = s.pieces[1].delivered
    assert (d.rows, d.generated_tokens, d.nbytes) == (2, 6, 22)  # both shares' bytes
    assert s.times.busy["teacher"] == 0.75


def test_a_lost_share_is_scored_again_alone():
    s = routed_step()
    s.start()
    for c, ps in ((0, (0, 1)), (1, (2, 3))):
        for p in ps:
            for cmd in s.piece_made(c, 1, piece(p)):
                s.piece_scored(cmd.piece, piece(cmd.piece), busy=0.1, teacher=cmd.teacher)
    s.seal()
    t = s.begin_training(published=3)
    assert t.prefetch is False and [h.piece for h in s.hand_out()] == [0, 1, 2, 3]
    for r in (0, 1):
        s.piece_trained(0, 1, r, answer(r, 0), ranks=2)
    lost = [s.piece_trained(1, 1, r, answer(r, 1, lost=True, lost_at=(1,) if r else ()),
                            ranks=2) for r in (0, 1)]
    assert lost == [[], [Score(1, 1, 1)]]                        # share of teacher 1 only
    assert 0 in s.pieces[1].scored and 1 not in s.pieces[1].scored


def test_a_share_scored_from_a_payload_whose_part_was_issued_again_still_delivers_the_piece():
    """A part issued again (its worker held other weights) drops its pieces' payloads; a share
    already being scored from the old payload (the same rows) completes the piece: its rows and
    tokens come from the layout, not from the dropped payload (found by `opd train --config
    digits_two_teachers`)."""
    s = routed_step()
    s.start()
    assert s.piece_made(0, 1, piece(1)) == [Score(1, 1, 0), Score(1, 1, 1)]
    s.piece_scored(1, piece(1), busy=0.1, teacher=1)
    assert s.part_failed(0, 1, published=3) == [Generate(0, 2)]
    assert s.pieces[1].made is None and 0 in s.pieces[1].scoring
    s.piece_scored(1, piece(1), busy=0.1, teacher=0)            # from the old payload
    d = s.pieces[1].delivered
    assert (d.rows, d.generated_tokens) == (2, 6)               # 2 rows of 6 - 3 tokens
    assert s.piece_made(0, 2, piece(1)) == []                    # delivered: nothing again

