"""Candidate drafting at the correction point (rollout/candidates.py): greedy output stays
Cached AR's (invariant 1) with any K, branch length, engine, execution, prefix, CFG and slots;
the layout is exact; candidates really save rounds where the plain window stalls."""
import pytest
import torch

from rollout import make_engine
from rollout.candidates import candidates, choose_path, make_tree, moves
from tests.rollout.schedules import graded, steer, switching

T = 16  # GPT-tiny: grid 4, vocab 11


def test_tree_layout():
    t = make_tree(4, 3, torch.device("cpu"), L=1)
    assert t.extra == 2 and t.depth.tolist() == [0, 1, 2, 3, 1, 1]
    assert t.base.tolist() == [1, 4, 5] and t.length.tolist() == [3, 1, 1]
    assert t.path.tolist() == [[0, 1, 2, 3], [0, 4, 2, 3], [0, 5, 2, 3]]
    assert t.mask.long().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0],
                                      [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0],
                                      [1, 0, 0, 0, 1, 0], [1, 0, 0, 0, 0, 1]]
    t2 = make_tree(5, 2, torch.device("cpu"), L=2)
    assert t2.depth.tolist() == [0, 1, 2, 3, 4, 1, 2] and t2.path.tolist() == [
        [0, 1, 2, 3, 4], [0, 5, 6, 3, 4]]
    assert make_tree(8, 1, torch.device("cpu")) is None and make_tree(1, 4, torch.device("cpu")) is None


def test_candidates_are_draft_known_then_likeliest():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 2.0, 1.0]] * 3)   # ranking 1, 2, 3, 4, 5, 0
    draft = torch.tensor([1, 1, 1])
    above = torch.tensor([[0], [3], [5]])
    assert candidates(logits, draft, above, 4).tolist() == [[1, 0, 2, 3], [1, 3, 2, 4],
                                                            [1, 5, 2, 3]]
    assert candidates(logits, draft, above, 2).tolist() == [[1, 0], [1, 3], [1, 5]]
    assert candidates(logits[:1], torch.tensor([1]), torch.tensor([[1]]), 2).tolist() == [[1, 2]]
    # sampled: the draft need not be the argmax, two known tokens; every candidate distinct
    known = torch.tensor([[1, 3], [0, 0], [2, 0]])
    assert candidates(logits, torch.tensor([4, 0, 0]), known, 4).tolist() == [
        [4, 1, 3, 2], [0, 1, 2, 3], [0, 2, 1, 3]]
    assert candidates(logits[:1, :3], torch.tensor([0]), torch.tensor([[2, 2]]), 3).tolist() == [
        [0, 2, 1]]                                                      # K = V


def test_choose_path_and_moves():
    t = make_tree(4, 3, torch.device("cpu"), L=1)
    root = torch.tensor([2, 3, 4, 1])                     # token chosen by each root column
    offset = torch.tensor([0, 0, 1, 0])                   # row 2: clipped window, root at 1
    cand = torch.tensor([[2, 0, 1], [1, 3, 3], [0, 1, 4], [0, 1, 2]])
    on = torch.tensor([True, True, True, False])
    branch, path, valid = choose_path(root, offset, cand, on, t)
    assert branch.tolist() == [0, 1, 2, 0]                # first match; row 3 has no tree
    assert path.tolist() == [[0, 1, 2, 3], [0, 4, 2, 3], [1, 5, 3, 3], [0, 1, 2, 3]]
    assert valid.tolist() == [4, 2, 2, 4]
    src, dst = moves(torch.tensor([5, 5, 9, 7]), offset, branch, t)
    assert src.tolist() == [[6], [9], [14], [8]] and dst.tolist() == [[6], [6], [11], [8]]


def engines():
    yield "sjd_independent", {}
    yield "hbsjd", dict(execution="full")
    yield "hbsjd", dict(execution="compact")
    yield "hbsjd", dict(execution="hybrid", gamma=2)


@pytest.mark.parametrize("cfg", [None, 2.0])
@pytest.mark.parametrize("P", [0, 5, T - 2])
@pytest.mark.parametrize("B", [1, 3, 8])
def test_greedy_candidates_return_cached_ar_tokens(tiny, batch, B, P, cfg):
    for seed in (0, 3):
        model = tiny(seed)
        labels, prefix = batch(model, B, P, seed)
        ref = make_engine("cached_ar").generate(model, labels, prefix, T - P, cfg_scale=cfg)
        for W in (2, 4, 16):
            for K, L in ((2, 1), (3, 2), (5, 1), (11, 1), (16, 3)):
                for name, opts in engines():
                    res = make_engine(name, window=W, candidates=K, branch=L, **opts).generate(
                        model, labels, prefix, T - P, cfg_scale=cfg)
                    assert torch.equal(res.tokens, ref.tokens), (seed, name, opts, W, K, L)
                    assert res.committed.sum(0).tolist() == [T - P] * B


@pytest.mark.parametrize("cfg", [None, 1.5])
def test_candidates_with_slots_and_a_larger_grid(tiny, batch, cfg):
    """7 images through 3 rows on a 36-token grid (vocabulary 5): tokens and per-image
    committed counts as without slots."""
    model = tiny(3, grid_size=6, vocab_size=5)
    labels, prefix = batch(model, 7, 7, 3)
    ref = make_engine("cached_ar").generate(model, labels, prefix, 29, cfg_scale=cfg)
    for W in (3, 8):
        for name, opts in engines():
            e = make_engine(name, window=W, candidates=3, **opts)
            full = e.generate(model, labels, prefix, 29, cfg_scale=cfg)
            slotted = e.generate(model, labels, prefix, 29, cfg_scale=cfg, slots=3)
            assert torch.equal(full.tokens, ref.tokens) and torch.equal(slotted.tokens,
                                                                         ref.tokens)
            assert torch.equal(full.committed.sum(0), slotted.committed.sum(0))
            assert slotted.prefills > 0


@pytest.mark.parametrize("cfg", [None, 2.0])
@pytest.mark.parametrize("slots", [None, 3])
def test_candidates_under_the_window_policy_return_cached_ar_tokens(tiny, batch, cfg, slots):
    """W "auto" sizes the state for the largest window (15 here); a tree window of a smaller W
    still clips its branches' positions at token T - 1 (`tree_window` reads plan.T, not the
    state's width): greedy tokens are Cached AR's, with and without slots, while the rounds
    run tree windows narrower than the largest."""
    model = tiny(2)
    labels, prefix = batch(model, 8, 0, 1)
    ref = make_engine("cached_ar").generate(model, labels, prefix, T, cfg_scale=cfg)
    narrower = set()
    for schedule in (switching, graded):
        for K, L in ((3, 2), (5, 3)):
            with steer(schedule):
                res = make_engine("hbsjd", window="auto", candidates=K, branch=L).generate(
                    model, labels, prefix, T, cfg_scale=cfg, slots=slots)
            assert torch.equal(res.tokens, ref.tokens), (K, L)
            assert res.committed.sum(0).tolist() == [T] * 8
            narrower |= {W for W in res.windows[1:] if 2 <= W < T - 1}
    assert len(narrower) >= 2, narrower


def test_candidates_save_rounds_where_the_window_stalls(tiny, batch):
    """Branch 0 is the plain window, so every saved round is a branch j > 0 that won."""
    model = tiny(0)
    labels, prefix = batch(model, 8, 0)
    image_rounds = {}
    for K in (0, 2, 3, 5):
        res = make_engine("hbsjd", window=8, execution="full", candidates=K).generate(
            model, labels, prefix, T)
        image_rounds[K] = int(res.image_rounds.sum())
        assert res.mean_committed >= 16 * 8 / image_rounds[K] - 1e-9
    assert image_rounds[0] > image_rounds[2] >= image_rounds[3] >= image_rounds[5]
    assert image_rounds[0] - image_rounds[5] >= 10


@pytest.mark.parametrize("options,word", [
    (dict(candidates=-1), "option candidates must be an int >= 0"),
    (dict(candidates=2.0), "option candidates must be an int >= 0"),
    (dict(candidates=3, compile="eager"), "cannot be combined with compile"),
    (dict(candidates=3, branch=0), "option branch must be None or an int >= 1"),
])
def test_bad_candidate_options(options, word):
    with pytest.raises(ValueError, match=word):
        make_engine("hbsjd", **options)
    with pytest.raises(ValueError, match="no option 'candidates'"):
        make_engine("sjd_sync", candidates=2)


@pytest.mark.parametrize("decoding", ["sample", "speculative"])
@pytest.mark.parametrize("cfg,warps", [(None, {}), (1.5, dict(temperature=0.8, top_k=4))])
def test_sampled_candidates_never_depend_on_execution_or_slots(tiny, batch, cfg, warps,
                                                               decoding):
    """Invariant 3 with sampled candidate drafting: 7 images on a 36-token grid give the same
    tokens, log-probs and per-image committed counts in Full, Compact and Hybrid execution, in
    sjd_independent, and through 3 slots (keyed random numbers); the tree is really used.
    Decoding "sample" commits the same tokens without candidates too (one token per key);
    decoding "speculative" does not (the tree changes which uniforms decide)."""
    model = tiny(3, grid_size=6, vocab_size=5)
    labels, prefix = batch(model, 7, 7, 3)
    for W, K, L in ((3, 2, 1), (8, 4, 2)):
        ref = None
        for name, opts in engines():
            e = make_engine(name, window=W, candidates=K, branch=L, decoding=decoding, **opts)
            for slots in (None, 3):
                res = e.generate(model, labels, prefix, 29, cfg_scale=cfg, seed=5, slots=slots,
                                 **warps)
                got = (res.tokens, res.logprobs, res.committed.sum(0))
                ref = ref or got
                assert all(torch.equal(a, b) for a, b in zip(got, ref)), (name, opts, W, slots)
        plain = make_engine("hbsjd", window=W, decoding=decoding, execution="full").generate(
            model, labels, prefix, 29, cfg_scale=cfg, seed=5, **warps)
        assert torch.equal(plain.tokens, ref[0]) == (decoding == "sample")
