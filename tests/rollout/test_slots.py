"""Continuous batching (`generate(..., slots=S)`): B images through R = min(S, B) physical rows.

Every image's tokens equal those of the same call without slots, in every engine whose images
are independent (keyed random numbers make an image's tokens independent of its row); counts
are exact: every image commits its N tokens, admissions never exceed the waiting images, and
Cached AR runs ceil(B / S) batches of N rounds.
"""
import math

import pytest
import torch

from opd.models import create_model
from rollout import make_engine

ENGINES = [  # name, options
    ("cached_ar", {}),
    ("sjd_independent", dict(window=4)),
    ("hbsjd", dict(window=5, execution="full")),
    ("hbsjd", dict(window=3, execution="compact")),
    ("hbsjd", dict(window=4, execution="hybrid", gamma=3)),
    ("hbsjd", dict(window=4, execution="hybrid", gamma=3, refresh="resample")),
]


@pytest.mark.parametrize("name,opts", ENGINES)
@pytest.mark.parametrize("decoding", ["greedy", "sample", "speculative"])
@pytest.mark.parametrize("B,S,P,cfg", [(11, 4, 0, None), (9, 2, 3, 2.0), (6, 1, 2, None),
                                       (5, 5, 0, 1.5), (3, 8, 1, None)])
def test_slots_give_every_image_the_tokens_of_a_full_batch(tiny, batch, name, opts, decoding,
                                                           B, S, P, cfg):
    model = tiny(0, vocab_size=5, grid_size=4)
    labels, prefix = batch(model, B, P, seed=B + S)
    N = 16 - P
    engine = make_engine(name, decoding=decoding, **opts)
    ref = engine.generate(model, labels, prefix, N, cfg_scale=cfg, seed=3)
    res = engine.generate(model, labels, prefix, N, cfg_scale=cfg, seed=3, slots=S)
    assert torch.equal(res.tokens, ref.tokens)
    assert res.committed.sum(0).tolist() == [N] * B
    assert torch.equal(res.accepted, ref.accepted) and torch.equal(res.rejected, ref.rejected)
    R = min(S, B)
    assert max(res.active) <= R
    if name == "cached_ar":
        assert res.rounds == math.ceil(B / R) * N
    else:
        assert res.prefills <= B - R
        assert torch.equal(res.image_rounds, ref.image_rounds)   # same rounds per image


def test_sync_sjd_with_slots_stays_greedy_exact(tiny, batch):
    """Batch-Synchronous SJD commits the minimum over the rows it holds; greedy tokens are
    still Cached AR's."""
    model = tiny(1, vocab_size=5, grid_size=4)
    labels, prefix = batch(model, 7, 2, seed=1)
    ar = make_engine("cached_ar").generate(model, labels, prefix, 14)
    res = make_engine("sjd_sync", window=4).generate(model, labels, prefix, 14, slots=3)
    assert torch.equal(res.tokens, ar.tokens)


def test_slots_must_be_a_positive_int(tiny):
    model = tiny(0, vocab_size=5, grid_size=4)
    with pytest.raises(ValueError, match="slots must be None or an int >= 1"):
        make_engine("hbsjd").generate(model, torch.zeros(2, dtype=torch.long), None, 4, slots=0)


def test_the_kv_cache_is_allocated_once_and_reused(tiny, batch):
    """Calls that fit the cache reuse its storage (slots make a smaller one suffice); tokens
    equal those of a freshly zeroed cache."""
    model = tiny(3, vocab_size=5, grid_size=4)
    labels, prefix = batch(model, 6, 2, seed=9)
    engine = make_engine("hbsjd", window=4, decoding="sample")
    first = engine.generate(model, labels, prefix, 14, cfg_scale=2.0, seed=1)
    storage = model.layers[0].attention.k_cache.data_ptr()
    again = engine.generate(model, labels[:4], prefix[:4], 14, cfg_scale=2.0, seed=1)
    slotted = engine.generate(model, labels, prefix, 14, cfg_scale=2.0, seed=1, slots=2)
    assert model.layers[0].attention.k_cache.data_ptr() == storage
    clean = create_model("GPT-tiny", vocab_size=5, grid_size=4).double().eval()
    clean.load_state_dict(model.state_dict())            # the same weights, no cache yet
    fresh = engine.generate(clean, labels, prefix, 14, cfg_scale=2.0, seed=1)
    assert torch.equal(first.tokens, fresh.tokens) and torch.equal(slotted.tokens, fresh.tokens)
    assert torch.equal(again.tokens, fresh.tokens[:4])
