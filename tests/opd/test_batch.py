"""TrajectoryBatch: validation, masks and exact (de)serialization round trips."""
from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest
import torch

from opd.distill.batch import TrajectoryBatch
from opd.distill.rollout_stats import RolloutStats

B, L, P, V, K = 3, 7, 3, 11, 4


def make(transport: str | None = "full", source: str = "student") -> TrajectoryBatch:
    g = torch.Generator().manual_seed(0)
    batch = TrajectoryBatch(
        batch_id=42, labels=torch.tensor([5, 0, 999]), prefix_len=P,
        tokens=torch.randint(0, V, (B, L), generator=g), policy_version=3, source=source,
        rollout_stats=RolloutStats(rounds=17, commit_hist=[3, 0, 5], mean_committed=2.951,
                                   rollout_seconds=0.1 + 0.2, engine="hb_sjd"),
        behaviour_logprobs=(-torch.rand(B, L - P, generator=g)) if source == "student" else None,
    )
    logp = torch.log_softmax(torch.randn(B, L, V, generator=g), -1)
    if transport == "full":
        return batch.with_teacher(logprobs=logp)
    if transport == "topk":
        vals, idx = logp.topk(K, -1)
        return batch.with_teacher(topk_values=vals, topk_indices=idx)
    return batch


def assert_same(a: TrajectoryBatch, b: TrajectoryBatch) -> None:
    for name in ("batch_id", "prefix_len", "policy_version", "source"):
        assert getattr(a, name) == getattr(b, name) and type(getattr(a, name)) is type(getattr(b, name))
    assert a.rollout_stats == b.rollout_stats
    assert ([type(v) for v in a.rollout_stats.to_dict().values()]
            == [type(v) for v in b.rollout_stats.to_dict().values()])
    for name in ("labels", "tokens", "teacher_logprobs", "teacher_topk_values", "teacher_topk_indices",
                 "behaviour_logprobs"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name


def test_masks_and_counts():
    batch = make()
    mask = batch.loss_mask
    assert mask.shape == (B, L) and mask.dtype == torch.bool
    assert not mask[:, :P].any() and mask[:, P:].all()
    assert batch.num_generated_tokens == B * (L - P) == int(mask.sum())
    assert (batch.batch_size, batch.seq_len) == (B, L)
    assert make(None).teacher_transport is None
    assert make("full").teacher_transport == "full" and make("topk").teacher_transport == "topk"


@pytest.mark.parametrize("transport", [None, "full", "topk"])
def test_numpy_dict_round_trip_exact(transport):
    batch = make(transport)
    d = batch.to_numpy_dict()
    assert all(isinstance(v, (np.ndarray, int, float, str, bool, list)) for v in d.values())
    assert d["rollout_stats/engine"] == "hb_sjd" and d["batch_id"] == 42
    assert_same(TrajectoryBatch.from_numpy_dict(d), batch)
    # through pickle protocol 5 (what Ray's object store uses), with numpy scalars as Ray may return
    d2 = pickle.loads(pickle.dumps({**d, "rollout_stats/rounds": np.int64(17)}, protocol=5))
    assert_same(TrajectoryBatch.from_numpy_dict(d2), batch)


def test_numpy_dict_is_zero_copy():
    batch = make("full")
    d = batch.to_numpy_dict()
    assert np.shares_memory(d["teacher_logprobs"], batch.teacher_logprobs.numpy())
    # read-only buffers (object store) are shared, without a warning
    for v in d.values():
        if isinstance(v, np.ndarray):
            v.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = TrajectoryBatch.from_numpy_dict(d)
    assert back.teacher_logprobs.data_ptr() == batch.teacher_logprobs.data_ptr()
    owned = TrajectoryBatch.from_numpy_dict(d, copy=True)
    assert owned.teacher_logprobs.data_ptr() != batch.teacher_logprobs.data_ptr()
    assert_same(owned, batch)


def test_with_teacher_and_to_copy():
    batch = make(None)
    scored = batch.with_teacher(logprobs=torch.zeros(B, L, V))
    assert batch.teacher_logprobs is None and scored.teacher_logprobs is not None
    assert scored.tokens is batch.tokens
    scored.rollout_stats.rounds = 99
    scored.rollout_stats.commit_hist[0] = 99
    assert batch.rollout_stats.rounds == 17 and batch.rollout_stats.commit_hist == [3, 0, 5]
    moved = make("topk").to("cpu")
    assert_same(moved, make("topk"))


def test_validation_names_the_field():
    batch = make(None)
    kw = dict(batch_id=0, labels=batch.labels, prefix_len=P, tokens=batch.tokens)
    with pytest.raises(ValueError, match="source must be one of"):
        TrajectoryBatch(**kw, source="rollout")
    with pytest.raises(ValueError, match="prefix_len must lie in"):
        TrajectoryBatch(**{**kw, "prefix_len": L + 1})
    with pytest.raises(ValueError, match="tokens must be"):
        TrajectoryBatch(**{**kw, "tokens": batch.tokens.int()})
    with pytest.raises(ValueError, match="labels must be"):
        TrajectoryBatch(**{**kw, "labels": batch.labels[:2]})
    with pytest.raises(ValueError, match="teacher_logprobs must be"):
        TrajectoryBatch(**kw, teacher_logprobs=torch.zeros(B, L - 1, V))
    with pytest.raises(ValueError, match="both or neither"):
        TrajectoryBatch(**kw, teacher_topk_values=torch.zeros(B, L, K))
    with pytest.raises(ValueError, match="not both"):
        TrajectoryBatch(**kw, teacher_logprobs=torch.zeros(B, L, V), teacher_topk_values=torch.zeros(B, L, K),
                        teacher_topk_indices=torch.zeros(B, L, K, dtype=torch.int64))
    with pytest.raises(ValueError, match="behaviour_logprobs must be"):
        TrajectoryBatch(**kw, behaviour_logprobs=torch.zeros(B, L))      # suffix only
    with pytest.raises(ValueError, match="behaviour_logprobs must be"):
        TrajectoryBatch(**kw, behaviour_logprobs=torch.zeros(B, L - P, dtype=torch.float64))
    with pytest.raises(ValueError, match="rollout_stats"):
        TrajectoryBatch(**kw, rollout_stats={"rounds": 3})          # a dict, not the record
    with pytest.raises(ValueError, match="bfloat16"):
        TrajectoryBatch(**kw, teacher_logprobs=torch.zeros(B, L, V, dtype=torch.bfloat16)).to_numpy_dict()


def test_behaviour_logprobs_cost_four_bytes_per_suffix_token():
    d = make(None).to_numpy_dict()
    assert d["behaviour_logprobs"].dtype == np.float32 and d["behaviour_logprobs"].nbytes == 4 * B * (L - P)
    assert "behaviour_logprobs" not in make(None, source="data").to_numpy_dict()
