"""A round of window 1 (`jacobi.ar_round`): Cached AR's step on the Jacobi state.

It must commit what the general round (`forward_window` + `verify_window`) commits at W = 1 --
the same tokens, log-probs, cursors and counts, greedy and sampled, Full and Compact, finished
rows included -- and a fixed window of 1 must give Cached AR's greedy tokens.  Leaving W = 1 for
a wider window fills the new drafts from history (`jacobi.rewindow`); the chi-square test with
a W 1 <-> 3 schedule accepts it and rejects a re-windowing that keeps the stale proposals."""
from dataclasses import replace

import pytest
import torch

from rollout import make_engine
from rollout.engine import make_request
from rollout.rounds import forward_window, prefill_round, verify_window
from rollout.jacobi import ar_round, init_state, one_hot

from tests.rollout.test_distribution import peaked_model
from tests.rollout.test_window import exact_then_mutated


def state_after(model, engine, req, plan, rounds):
    """The Jacobi state of req's images after the prefill and `rounds` W = 1 rounds."""
    model.setup_cache(req.batch * (2 if req.cfg else 1), engine.cache_len(req))
    images = torch.arange(req.batch)
    st = init_state(req, images, plan, model.vocab_size)
    prefill_round(model, st, images, req, plan, None)          # at W = 1: the prefill alone
    for _ in range(rounds):
        ar_round(model, st, req, plan, None)
    return st


@pytest.mark.parametrize("decoding,cfg", [("greedy", None), ("sample", None), ("sample", 2.0),
                                          ("speculative", 2.0)])
@pytest.mark.parametrize("compact", [False, True])
def test_ar_round_commits_what_the_general_round_commits(tiny, batch, decoding, cfg, compact):
    model = tiny(3)
    T, P, B = model.block_size, 2, 5
    labels, prefix = batch(model, B, P, 2)
    engine = make_engine("hbsjd", window=1, decoding=decoding)
    req = make_request(model, labels, prefix, T - P, cfg_scale=cfg, temperature=1.0, top_k=None,
                       top_p=None, seed=4, image_ids=None, decoding=engine.decoding)
    plan = engine.plan(model, req)
    assert plan.W == 1
    with torch.no_grad():
        # rows at different cursors, one finished: rounds of the shorter rows' images only
        st = state_after(model, engine, req, plan, T - P - 3)
        st.cur[1] = T                                      # a finished row
        st.cur[3] -= 2
        ref = st.select(torch.arange(B))
        idx = torch.tensor([0, 1, 3, 4]) if compact else None
        rows = None if idx is None else (torch.cat([idx, idx + B]) if req.cfg else idx)
        for _ in range(2):
            sub = ref.select(idx) if compact else ref
            logits, positions, offset = forward_window(model, sub, req, plan, rows)
            want = verify_window(model, sub, logits, positions, offset, req, plan, rows)
            if compact:
                ref.assign(idx, sub)
            lean = st.select(idx) if compact else st
            got = ar_round(model, lean, req, plan, rows)
            if compact:
                st.assign(idx, lean)
            assert torch.equal(got, want)
            assert torch.equal(st.cur, ref.cur) and torch.equal(st.rounds, ref.rounds)
            for b in range(B):
                c = int(min(st.cur[b], T))
                assert torch.equal(st.seq[b, :c], ref.seq[b, :c])
                assert torch.allclose(st.logp[b, P:c], ref.logp[b, P:c], rtol=0, atol=1e-12)
    assert int(got[0].sum()) == (3 if compact else 4)      # the live rows, one token each


@pytest.mark.parametrize("cfg", [None, 2.0])
def test_a_fixed_window_of_one_gives_cached_ar_tokens(tiny, batch, cfg):
    model = tiny(2)
    labels, prefix = batch(model, 6, 3, 1)
    ref = make_engine("cached_ar").generate(model, labels, prefix, 13, cfg_scale=cfg)
    for execution in ("full", "compact", "hybrid"):
        res = make_engine("hbsjd", window=1, execution=execution).generate(
            model, labels, prefix, 13, cfg_scale=cfg, slots=4)
        assert torch.equal(res.tokens, ref.tokens)
        assert torch.allclose(res.logprobs, ref.logprobs, rtol=0, atol=1e-12)
        assert res.committed.max() == 1 and res.committed.sum(0).tolist() == [13] * 6
        assert res.accepted.sum() == 0 and res.rejected.sum() == 0


def one_three(policy, active):
    """A schedule of the round index only (lossless): W 1, 3, 1, 3, ... in Compact rounds,
    so every window of 3 follows ar_round's rounds."""
    return (1 if policy.round % 2 == 1 else 3), True


def stale_proposals(st, old, new):
    """A wrong re-windowing after W = 1: the drafts left unfilled and the proposals kept by
    column where the old window had one, as if the rounds of W = 1 had kept both up to date
    (they do not: `ar_round` writes neither)."""
    B, V = st.cur.shape[0], st.q.shape[-1]
    start, start_new = st.cur.clamp(max=old.T - old.W), st.cur.clamp(max=new.T - new.W)
    col = (start_new - start)[:, None] + new.ar
    kept = (col >= 0) & (col < old.W)
    tokens = st.seq.gather(1, start_new[:, None] + new.ar)
    moved = st.q.gather(1, col.clamp(0, old.W - 1)[..., None].expand(B, new.W, V))
    return replace(st, q=torch.where(kept[..., None], moved, one_hot(tokens, V, st.q.dtype)))


def test_leaving_w1_is_exact_and_stale_proposals_are_detected(monkeypatch):
    """9-token images (512 of them) under W 1, 3, 1, 3, ...: exact, and `stale_proposals`
    rejected by the same statistics."""
    exact_then_mutated(monkeypatch, peaked_model(3, 2, 3, 0.5), one_three, stale_proposals,
                       {(1, "compact"), (3, "compact")})
