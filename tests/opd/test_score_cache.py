"""The teacher's scores of data images cached across epochs (distill.cache_data_scores,
opd/distill/score_cache.py): the same losses bit for bit, the teacher forwarding each distinct
image once, the suffix cut for any prefix, and the Ray mode refused in one line."""
import numpy as np
import pytest
import torch

import opd.distill.steps as steps_module
from opd.config.loader import ConfigError
from opd.config.schema import load_config
from opd.data.format import TokenDataset, write_token_parquet
from opd.distill.batch import TrajectoryBatch
from opd.distill.score_cache import DataScoreCache
from opd.run.reference import run_reference

IMAGES, BATCH, EPOCHS = 12, 4, 3


@pytest.fixture(scope="module")
def small_train(digits_dir, tmp_path_factory):
    """The first 12 rows of the digits train split: 3 batches of 4 an epoch."""
    d = TokenDataset(digits_dir / "train.parquet")
    path = tmp_path_factory.mktemp("small") / "train.parquet"
    write_token_parquet(path, d.labels[:IMAGES], d.tokens[:IMAGES],
                        vocab_size=17, num_classes=10, grid_size=8, tokenizer="digits")
    return path


def kd_cfg(tiny_overrides, small_train, *extra):
    """KD on data for 3 epochs over prefix ratios 0 and 0.5 (tiny's), no tracking."""
    return load_config("tiny", [*tiny_overrides, f"data.train={small_train}",
                                f"data.batch_size={BATCH}", f"distill.steps={EPOCHS * IMAGES // BATCH}",
                                "distill.objective=kd", "eval.track=false",
                                "run.checkpoint_every=0", "run.mode=reference", *extra])


def counted_run(cfg, run_dir, monkeypatch):
    """(metric rows, rows the teacher forwarded) of a reference run."""
    forwarded = []
    real = steps_module.teacher_logits

    def counting(teacher, batch, **kw):
        forwarded.append(batch.batch_size)
        return real(teacher, batch, **kw)

    monkeypatch.setattr(steps_module, "teacher_logits", counting)
    return run_reference(cfg, run_dir, progress=False), sum(forwarded)


@pytest.mark.parametrize("transport", ["teacher.transport=full",
                                       "teacher.transport=topk teacher.topk=5"])
def test_cached_run_is_bit_identical_and_forwards_each_image_once(
        tiny_overrides, small_train, tmp_path, monkeypatch, transport):
    extra = transport.split()
    plain, plain_rows = counted_run(kd_cfg(tiny_overrides, small_train, *extra),
                                    tmp_path / "plain", monkeypatch)
    cached, cached_rows = counted_run(
        kd_cfg(tiny_overrides, small_train, *extra, "distill.cache_data_scores=true"),
        tmp_path / "cached", monkeypatch)
    assert {r["prefix_len"] for r in plain} == {0, 32}           # both prefix ratios met
    assert [r["loss"] for r in cached] == [r["loss"] for r in plain]
    assert [r["grad_norm"] for r in cached] == [r["grad_norm"] for r in plain]
    assert plain_rows == EPOCHS * IMAGES and cached_rows == IMAGES
    assert sum(r["teacher_rows/default"] for r in cached) == IMAGES
    assert [r["teacher_rows/default"] for r in cached] == [BATCH] * 3 + [0] * 6
    assert cached[-1]["score_cache_images"] == IMAGES
    per_image = 64 * 17 * 4 if "full" in transport else 64 * 5 * (4 + 2)   # int16 ids
    assert cached[-1]["score_cache_bytes"] == IMAGES * per_image
    assert "score_cache_images" not in plain[0]


def fake_batch(rows: list[int], prefix_len: int) -> TrajectoryBatch:
    """A data batch whose tokens are its rows' ids (so a score can be traced to its image)."""
    B, L = len(rows), 6
    tokens = torch.tensor(rows).repeat_interleave(L).view(B, L)
    return TrajectoryBatch(0, torch.zeros(B, dtype=torch.int64), prefix_len, tokens, 0, "data")


def test_cache_scores_only_new_images_and_cuts_each_prefix():
    seen = []

    def score_rows(b):
        seen.append((b.tokens[:, 0].tolist(), b.prefix_len))
        L = b.seq_len
        logp = b.tokens[:, :1, None].float() * 100 + torch.arange(L * 3).view(1, L, 3).float()
        return b.with_teacher(logprobs=logp), ["share"]

    cache = DataScoreCache()
    first, shares = cache.score(np.array([5, 7]), fake_batch([5, 7], 2), score_rows)
    again, more = cache.score(np.array([7, 9]), fake_batch([7, 9], 4), score_rows)
    assert seen == [([5, 7], 0), ([9], 0)] and shares == more == ["share"]
    assert first.teacher_logprobs.shape == (2, 4, 3) and again.teacher_logprobs.shape == (2, 2, 3)
    grid = torch.arange(18).view(6, 3).float()
    assert torch.equal(again.teacher_logprobs[0], 700 + grid[4:])     # image 7 at prefix 4
    assert torch.equal(again.teacher_logprobs[1], 900 + grid[4:])
    assert torch.equal(first.teacher_logprobs[0], 500 + grid[2:])
    _, shares = cache.score(np.array([9, 5]), fake_batch([9, 5], 0), score_rows)
    assert shares == [] and len(seen) == 2 and len(cache) == 3
    assert cache.nbytes == 3 * 6 * 3 * 4


def test_ray_mode_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^distill.cache_data_scores=true needs "
                                          r"run.mode=reference.*set run.mode=reference"):
        load_config(None, ["distill.cache_data_scores=true"])
    assert load_config(None, ["distill.cache_data_scores=true",
                              "run.mode=reference"]).distill.cache_data_scores
