"""The Jacobi round's bookkeeping on synthetic logits: window clipping, draft initialisation
from history, reuse of predictions, commit counts (greedy losslessness alone would not notice
bad drafts, only slower decoding)."""
import torch

from rollout.baselines.sjd_sync import batch_minimum
from rollout.engine import make_request
from rollout.jacobi import (JacobiState, commit_count, fill_history, init_state, jacobi_update,
                            make_plan, window_inputs)
from rollout.sampling import image_key


class Shape:
    vocab_size, num_classes, block_size, grid_size = 7, 2, 16, 4


def request(B, P, decoding="greedy"):
    prefix = torch.arange(B * P).reshape(B, P) % 7
    return make_request(Shape, torch.zeros(B, dtype=torch.long), prefix, 16 - P, cfg_scale=None,
                        temperature=1.0, top_k=None, top_p=None, seed=0, image_ids=None,
                        decoding=decoding)


def test_fill_history_follows_the_offset_chain():
    plan = make_plan(16, 7, 4, torch.device("cpu"))              # F = 6 tokens
    seq = torch.arange(100, 124)[None].repeat(3, 1)
    filled = fill_history(seq.unsqueeze(2), torch.tensor([10, 12, 2]).view(3, 1, 1), plan)
    assert seq[0, 10:16].tolist() == [106, 107, 108, 109, 106, 107]    # j - 4, j - 8, ...
    assert seq[1, 12:18].tolist() == [108, 109, 110, 111, 108, 109]
    assert seq[2, 2:8].tolist() == [101, 101, 100, 101, 101, 101]      # j-4 < 0: left nbr
    assert seq[:, 18:].tolist() == [list(range(118, 124))] * 3         # nothing else
    assert filled[..., 0].tolist() == [seq[0, 10:16].tolist(), seq[1, 12:18].tolist(),
                                       seq[2, 2:8].tolist()]
    plan1 = make_plan(16, 7, 1, torch.device("cpu"))
    seq = torch.arange(100, 124)[None].clone()
    fill_history(seq.unsqueeze(2), torch.tensor([5]).view(1, 1, 1), plan1)
    assert seq[0, 4:12].tolist() == [104] * 7 + [111]                  # H = 1: left neighbour


def test_init_state_drafts_come_from_history():
    req = request(2, 9)
    plan = make_plan(16, 5, 4, torch.device("cpu"))
    st = init_state(req, torch.arange(2), plan, 7)
    assert st.cur.tolist() == [9, 9] and st.rounds.tolist() == [0, 0]  # before the first round
    assert torch.equal(st.seq[:, :9], req.prefix)
    assert torch.equal(st.seq[:, 9:13], st.seq[:, 5:9])                # H = 4 rows above
    assert (st.seq[:, 13:] == 0).all()                                 # nothing else
    assert torch.equal(st.key, image_key(req.seeds, req.ids)) and st.q is None
    sampled = init_state(request(2, 9, "speculative"), torch.arange(2), plan, 7)
    assert sampled.q.shape == (2, 5, 7)                                # one per window column
    assert torch.equal(sampled.q.argmax(-1), sampled.seq[:, 9:14])
    assert (sampled.q.sum(-1) == 1).all()
    short = init_state(request(2, 2), torch.arange(2), plan, 7)        # P < H: left neighbour
    assert short.seq[:, 2:6].tolist() == [[1, 1, 0, 1], [3, 3, 2, 3]]
    empty = init_state(request(2, 0), torch.arange(2), plan, 7)        # no prefix: token 0
    assert empty.cur.tolist() == [0, 0] and (empty.seq == 0).all()


def test_window_is_clipped_at_the_end():
    plan = make_plan(16, 4, 4, torch.device("cpu"))
    seq = torch.arange(20)[None].repeat(3, 1)
    st = JacobiState(seq, torch.tensor([3, 15, 16]), torch.zeros(3, dtype=torch.long),
                     torch.zeros(3, dtype=torch.long), None)
    tokens, positions, offset = window_inputs(st, plan)
    assert positions.tolist() == [[3, 4, 5, 6], [12, 13, 14, 15], [12, 13, 14, 15]]
    assert tokens.tolist() == [[2, 3, 4, 5], [11, 12, 13, 14], [11, 12, 13, 14]]
    assert offset.tolist() == [0, 3, 4]


def test_commit_count():
    W = 4              # a: the first column neither committed before nor accepted (verify.py)
    a = torch.tensor([2, 0, 3, 4, 2, 3]).view(6, 1, 1)
    offset = torch.tensor([0, 0, 0, 4, 2, 2]).view(6, 1, 1)       # 4: finished, 2: clipped
    assert commit_count(a, offset, W).view(6).tolist() == [3, 1, 4, 0, 1, 2]
    assert batch_minimum(commit_count(a, offset, W)).view(6).tolist() == [1, 1, 1, 0, 1, 1]


def logits_for(pred, V=7):
    """(B, W) target argmax -> (B, W, V) logits."""
    return torch.nn.functional.one_hot(pred, V).double() * 5.0


def test_greedy_round_commits_accepted_drafts_and_reuses_predictions():
    req = request(2, 5)
    plan = make_plan(16, 4, 4, torch.device("cpu"))
    st = init_state(req, torch.arange(2), plan, 7)
    st.seq[0, 5:8] = torch.tensor([1, 2, 3])                      # drafts for tokens 5..7
    st.seq[1, 5:8] = torch.tensor([1, 0, 3])
    pred = torch.tensor([[1, 2, 5, 4], [1, 2, 3, 4]])             # predictions of tokens 5..8
    tokens, positions, offset = window_inputs(st, plan)
    assert tokens[:, 1:].tolist() == [[1, 2, 3], [1, 0, 3]]
    (m, took, rejected), _ = jacobi_update(st, logits_for(pred), positions, offset, req, plan)
    assert took.tolist() == [2, 1] and m.tolist() == [3, 2] and rejected.tolist() == [1, 1]
    assert st.cur.tolist() == [8, 7] and st.rounds.tolist() == [1, 1]
    assert st.seq[0, 5:8].tolist() == [1, 2, 5]                   # argmax replaced draft 7
    assert st.seq[1, 5:7].tolist() == [1, 2]
    # next drafts: reused predictions (token 8 = 4; image 1: tokens 7, 8 = 3, 4) ...
    assert st.seq[0, 8].tolist() == 4 and st.seq[1, 7:9].tolist() == [3, 4]
    # ... then history: token j gets token j - 4
    assert st.seq[0, 9:11].tolist() == st.seq[0, 5:7].tolist()
    assert st.seq[1, 9].tolist() == st.seq[1, 5].tolist()


def test_speculative_round_records_proposals():
    req = request(1, 5, "speculative")
    plan = make_plan(16, 4, 4, torch.device("cpu"))
    st = init_state(req, torch.arange(1), plan, 7)
    probs = torch.tensor([[0.7, 0.1, 0.1, 0.05, 0.05, 0.0, 0.0]]).repeat(4, 1)
    _, positions, offset = window_inputs(st, plan)
    (m, took, _), _ = jacobi_update(st, probs.log()[None].double(), positions, offset, req,
                                    plan)
    k = int(m)
    assert st.cur.tolist() == [5 + k]
    width = 4
    for i in range(3):                                            # drafts cur' + i
        if k + i < width:                                         # from this round's p
            assert torch.allclose(st.q[0, i].double(), probs[0].double(), atol=1e-6)
            assert probs[0, st.seq[0, 5 + k + i]] > 0
        else:                                                     # filled: one-hot
            assert st.q[0, i].max() == 1 and st.q[0, i].argmax() == st.seq[0, 5 + k + i]
