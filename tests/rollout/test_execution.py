"""Invariant 3: execution mode never changes the output, and random numbers are keyed by
(seed, image, position, attempt) — an image's tokens do not depend on its batch.
Also: the per-round statistics are consistent."""
import copy

import pytest
import torch

from rollout import make_engine

T = 16


def run(model, labels, prefix, name="hbsjd", cfg=2.0, seed=3, ids=None, **opts):
    return make_engine(name, **opts).generate(model, labels, prefix, T - prefix.shape[1],
                                              cfg_scale=cfg, seed=seed, image_ids=ids,
                                              temperature=0.9, top_k=8)


@pytest.mark.parametrize("decoding", ["greedy", "sample", "speculative"])
@pytest.mark.parametrize("W", [2, 5, 16])
def test_full_compact_and_hybrid_at_every_gamma_give_identical_tokens(tiny, batch, decoding, W):
    model = tiny(1)
    B = 6
    labels, prefix = batch(model, B, 2, 1)
    full = run(model, labels, prefix, window=W, decoding=decoding, execution="full")
    assert set(full.modes) == {"full"}
    independent = run(model, labels, prefix, "sjd_independent", window=W, decoding=decoding)
    assert torch.equal(independent.tokens, full.tokens)
    compact = run(model, labels, prefix, window=W, decoding=decoding, execution="compact")
    assert set(compact.modes[1:]) == {"compact"}
    assert torch.equal(compact.tokens, full.tokens)
    assert torch.equal(compact.committed, full.committed)
    switched = False
    for gamma in range(B + 2):
        hybrid = run(model, labels, prefix, window=W, decoding=decoding, execution="hybrid",
                     gamma=gamma)
        assert torch.equal(hybrid.tokens, full.tokens), gamma
        assert torch.equal(hybrid.accepted, full.accepted)
        for active, mode in zip(hybrid.active[1:], hybrid.modes[1:]):
            assert mode == ("compact" if active < gamma else "full")
        switched |= {"full", "compact"} <= set(hybrid.modes[1:])
    assert switched, "no hybrid run switched modes: the comparison is vacuous"


def test_images_finish_at_different_rounds_and_hybrid_switches(tiny, batch):
    model = tiny(2)
    labels, prefix = batch(model, 8, 0, 0)
    res = run(model, labels, prefix, window=8, decoding="greedy", execution="hybrid", gamma=4)
    rounds = res.image_rounds
    assert rounds.min() < rounds.max(), "all images took the same rounds: no switching to test"
    assert "compact" in res.modes and "full" in res.modes
    assert res.rounds == int(rounds.max())
    # active count per round = images with a committed token in that round
    assert res.active == (res.committed > 0).sum(1).tolist()
    assert res.active == sorted(res.active, reverse=True)
    assert res.progress[-1].tolist() == [T] * 8
    assert (res.progress[1:] >= res.progress[:-1]).all()
    # committed = accepted drafts + one replacement / bonus token per active round
    assert torch.equal(res.committed.sum(0), res.accepted + rounds)
    assert (res.rejected <= rounds - 1).all()
    assert len(res.round_times) == res.rounds and res.wall_time > 0


@pytest.mark.parametrize("name,opts", [("cached_ar", {}), ("sjd_independent", dict(window=4)),
                                       ("hbsjd", dict(window=6, execution="hybrid", gamma=3))])
def test_sampled_tokens_do_not_depend_on_batch_composition(tiny, batch, name, opts):
    model = tiny(0)
    labels, prefix = batch(model, 8, 3, 5)
    ids = torch.arange(100, 108)
    whole = run(model, labels, prefix, name, decoding="sample", ids=ids, **opts)
    for subset in ([5], [6, 1], [7, 0, 3, 2]):
        s = torch.tensor(subset)
        part = run(model, labels[s], prefix[s], name, decoding="sample", ids=ids[s], **opts)
        assert torch.equal(part.tokens, whole.tokens[s]), subset
    other_seed = run(model, labels, prefix, name, decoding="sample", ids=ids, seed=4, **opts)
    assert not torch.equal(other_seed.tokens, whole.tokens)
    other_ids = run(model, labels, prefix, name, decoding="sample", ids=ids + 1, **opts)
    assert not torch.equal(other_ids.tokens, whole.tokens)


def test_per_image_seeds(tiny, batch):
    model = tiny(0)
    labels, prefix = batch(model, 4, 3, 5)
    seeds = torch.tensor([9, 8, 7, 6])
    whole = run(model, labels, prefix, decoding="sample", seed=seeds, window=4)
    alone = run(model, labels[2:3], prefix[2:3], decoding="sample", seed=7, window=4,
                ids=torch.tensor([2]))
    assert torch.equal(alone.tokens, whole.tokens[2:3])


def test_sampling_is_reproducible_and_differs_from_greedy(tiny, batch):
    model = tiny(0, std=0.3)
    labels, prefix = batch(model, 4, 0)
    a = run(model, labels, prefix, decoding="sample", window=4)
    b = run(model, labels, prefix, decoding="sample", window=4)
    g = run(model, labels, prefix, decoding="greedy", window=4)
    assert torch.equal(a.tokens, b.tokens)
    assert not torch.equal(a.tokens, g.tokens)


def test_first_sampled_token_is_shared_by_cached_ar_and_hbsjd(tiny, batch):
    """Both draw token P in round 0 with the same key (seed, image, P, attempt 0)."""
    model = tiny(0, std=0.3)
    labels, prefix = batch(model, 8, 4)
    ar = run(model, labels, prefix, "cached_ar", decoding="sample")
    hb = run(model, labels, prefix, decoding="sample", window=4)
    assert torch.equal(ar.tokens[:, 4], hb.tokens[:, 4])


def test_cached_ar_statistics(tiny, batch):
    model = tiny(0)
    labels, prefix = batch(model, 3, 6)
    res = run(model, labels, prefix, "cached_ar", decoding="greedy")
    assert res.rounds == T - 6 and res.mean_committed == 1.0
    assert res.active == [3] * (T - 6) and int(res.accepted.sum()) == 0
    assert res.summary()["new_tokens"] == T - 6


def test_sync_sjd_advances_the_batch_together(tiny, batch):
    model = tiny(2)
    labels, prefix = batch(model, 8, 0, 0)
    res = run(model, labels, prefix, "sjd_sync", window=8, decoding="greedy")
    assert (res.committed == res.committed[:, :1]).all()      # one shared cursor
    ind = run(model, labels, prefix, "sjd_independent", window=8, decoding="greedy")
    assert res.rounds >= ind.rounds
    assert torch.equal(res.tokens, ind.tokens)


def test_results_are_ordinary_tensors_usable_for_training(tiny, batch):
    """Rollout tokens feed the learner: they must not be inference-mode tensors."""
    model = tiny(0)
    labels, prefix = batch(model, 2, 3)
    res = run(model, labels, prefix, decoding="greedy", window=4)
    assert not res.tokens.is_inference() and not res.tokens.requires_grad
    res.tokens[:, -1] = 0                                     # in-place edits are allowed
    loss = model(labels, res.tokens[:, :-1]).logsumexp(-1).mean()
    loss.backward()                                           # and autograd may save them
    assert model.tok_embeddings.weight.grad is not None
    model.zero_grad(set_to_none=True)


def test_rounds_run_in_inference_mode_and_what_leaves_is_normal(tiny, batch):
    """The engine's rounds run in inference mode (no autograd bookkeeping per operator,
    docs/ROLLOUTS.md "Inference mode"); the spans, pieces and result it hands out, and the
    model's KV cache and rope table it made there, are normal tensors: a later no_grad cached
    pass writes the cache in place, and training saves the rope table for backward."""
    model = tiny(0, std=0.45)                    # a model of its own: its caches made here
    reference = copy.deepcopy(model)             # never run in inference mode
    labels, prefix = batch(model, 3, 2)
    modes, forward = [], model.forward_cached

    def spy(*args, **kwargs):
        modes.append(torch.is_inference_mode_enabled())
        return forward(*args, **kwargs)
    model.forward_cached = spy
    try:
        stream = make_engine("hbsjd", window=4, decoding="sample").stream(
            model, labels, prefix, T - 2, seed=3, span=4)
        items = list(stream)
    finally:
        del model.forward_cached
    assert len(modes) >= 2 and all(modes)
    handed = [v for item in [*items, stream.result] for v in vars(item).values()
              if isinstance(v, torch.Tensor)]
    assert len(handed) > 2 * len(items) and not any(t.is_inference() for t in handed)
    caches = [c for layer in model.layers for c in (layer.attention.k_cache,
                                                    layer.attention.v_cache)]
    assert caches and not any(c.is_inference() for c in caches)
    at = torch.zeros_like(prefix[:, :1])         # slot 0: what it attends to is written here
    with torch.no_grad():
        reference.setup_cache(caches[0].shape[0], caches[0].shape[2])
        assert torch.equal(model.forward_cached(prefix[:, :1], at, None),
                           reference.forward_cached(prefix[:, :1], at, None))
    for m in (model, reference):
        m(labels, stream.result.tokens[:, :-1]).logsumexp(-1).mean().backward()
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters())]
    assert all(g is not None and torch.equal(g, h) for g, h in grads)
    model.zero_grad(set_to_none=True)
