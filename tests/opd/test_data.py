"""Token datasets: digits16-v1 tokenization, Parquet validation, resumable batches, LlamaGen codes."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from sklearn.datasets import load_digits

from opd.data import (
    METADATA_KEY,
    DataError,
    PrefixBatcher,
    TokenDataset,
    dataset_stats,
    digits_images_to_tokens,
    digits_split,
    digits_tokens_to_images,
    digits_upsample,
    iterate_batches,
    prepare_digits,
    prepare_llamagen_codes,
    write_token_parquet,
)


@pytest.fixture(scope="module")
def digits_paths(tmp_path_factory):
    return prepare_digits(tmp_path_factory.mktemp("digits"))


@pytest.fixture(scope="module")
def digits_train(digits_paths):
    return TokenDataset(digits_paths["train"], vocab_size=17, num_classes=10, grid_size=8)


def _small(tmp_path, n=10, grid=2, vocab=5, classes=3, name="small.parquet"):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, classes, n)
    tokens = rng.integers(0, vocab, (n, grid * grid))
    path = write_token_parquet(
        tmp_path / name, labels, tokens, vocab_size=vocab, num_classes=classes, grid_size=grid, tokenizer="toy"
    )
    return path, labels, tokens


def _raw_parquet(path, columns: dict, meta: dict | None = None):
    table = pa.table(columns)
    if meta is not None:
        table = table.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()})
    pq.write_table(table, path)
    return path


TOY_META = {"vocab_size": 5, "num_classes": 3, "grid_size": 2, "tokenizer": "toy"}


# ----------------------------------------------------------------------------- digits8-v1, digits16-v1


def test_upsample_equals_torch_bilinear_align_corners():
    images = load_digits().images[:50]
    ref = torch.nn.functional.interpolate(
        torch.tensor(images[:, None], dtype=torch.float64), size=(16, 16), mode="bilinear", align_corners=True
    )[:, 0]
    np.testing.assert_allclose(digits_upsample(images), ref.numpy(), rtol=0, atol=1e-12)


def test_digits_tokens_shape_range_and_rounding():
    images = load_digits().images
    tokens = digits_images_to_tokens(images, 16)
    assert tokens.shape == (1797, 256) and tokens.dtype == np.int64
    assert tokens.min() == 0 and tokens.max() == 16
    up = digits_upsample(images).reshape(1797, 256)
    assert np.abs(tokens - up).max() <= 0.5
    # values are k/225, so never a rounding tie: the nearest level is at least 1/450 closer
    assert np.abs(np.abs(up - np.floor(up)) - 0.5).min() > 1 / 451
    # corners are copied exactly (aligned corners)
    np.testing.assert_array_equal(tokens.reshape(-1, 16, 16)[:, 0, 0], images[:, 0, 0])
    np.testing.assert_array_equal(tokens.reshape(-1, 16, 16)[:, 15, 15], images[:, 7, 7])


def test_digits8_tokens_are_the_pixels_and_decode_like_digits16():
    images = load_digits().images
    tokens = digits_images_to_tokens(images)
    assert tokens.shape == (1797, 64) and tokens.dtype == np.int64
    np.testing.assert_array_equal(tokens, images.reshape(1797, 64).astype(np.int64))
    # one data image, two tokenizations, the same 16x16 pixels
    np.testing.assert_array_equal(digits_tokens_to_images(tokens[:300]),
                                  digits_tokens_to_images(digits_images_to_tokens(images[:300], 16)))
    with pytest.raises(DataError, match="grid_size=12"):
        digits_images_to_tokens(images[:2], 12)


def test_digits_inverse_within_a_grey_level():
    images = load_digits().images[:200]
    tokens = digits_images_to_tokens(images, 16)
    pixels = digits_tokens_to_images(torch.from_numpy(tokens))
    assert pixels.shape == (200, 16, 16) and pixels.dtype == np.uint8
    levels = pixels.astype(np.float64) * 16 / 255
    assert np.abs(levels - digits_upsample(images)).max() <= 0.5 + 16 / 510 + 1e-9
    levels = np.arange(17)
    all_levels = digits_tokens_to_images(np.resize(levels, (1, 256)))[0].reshape(-1)[:17]
    np.testing.assert_array_equal(all_levels, np.floor(levels * 255 / 16 + 0.5))
    assert all_levels[[0, 8, 16]].tolist() == [0, 128, 255]
    with pytest.raises(DataError, match="digits16-v1"):
        digits_tokens_to_images(np.full((1, 256), 17))
    with pytest.raises(DataError, match=r"\(N, 64\) or \(N, 256\)"):
        digits_tokens_to_images(np.zeros((1, 100), dtype=np.int64))


def test_prepare_digits_split_and_files(digits_paths, digits_train):
    labels = load_digits().target
    train_rows, held_rows = digits_split(labels)
    assert len(train_rows) == 1597 and len(held_rows) == 200
    assert np.bincount(labels[held_rows]).tolist() == [20] * 10
    assert np.intersect1d(train_rows, held_rows).size == 0
    held = TokenDataset(digits_paths["heldout"])
    assert digits_train.num_rows == 1597 and held.num_rows == 200
    np.testing.assert_array_equal(np.sort(np.concatenate([digits_train.ids, held.ids])), np.arange(1797))
    np.testing.assert_array_equal(held.ids, held_rows)
    np.testing.assert_array_equal(held.labels, labels[held_rows])
    np.testing.assert_array_equal(held.tokens, digits_images_to_tokens(load_digits().images[held_rows]))
    assert held.meta.tokenizer == "digits8-v1" and (held.vocab_size, held.num_classes, held.grid_size) == (17, 10, 8)
    manifest = json.loads(digits_paths["manifest"].read_text())
    assert manifest["splits"]["train"]["rows"] == 1597 and manifest["tokenizer"] == "digits8-v1"
    # a fixed split: the first held-out sklearn indices never change
    assert digits_split(labels)[1][:5].tolist() == held_rows[:5].tolist()


def test_prepare_digits_is_idempotent_and_repairs(tmp_path):
    first = prepare_digits(tmp_path)
    stamps = {k: p.stat().st_mtime_ns for k, p in first.items()}
    again = prepare_digits(tmp_path)
    assert again == first and {k: p.stat().st_mtime_ns for k, p in again.items()} == stamps
    first["heldout"].write_bytes(b"corrupted")
    prepare_digits(tmp_path)
    assert TokenDataset(first["heldout"]).num_rows == 200
    prepare_digits(tmp_path, 16)        # another tokenization: rewritten, not reused
    held = TokenDataset(first["heldout"])
    assert (held.meta.tokenizer, held.grid_size, held.tokens.shape) == ("digits16-v1", 16, (200, 256))


# ----------------------------------------------------------------------------- format + validation


def test_write_read_round_trip(tmp_path):
    labels, tokens = np.array([2, 0, 1]), np.array([[0, 1, 2, 3], [4, 4, 0, 0], [1, 1, 1, 1]])
    path = write_token_parquet(
        tmp_path / "rt.parquet", labels, tokens, ids=[7, 7, 9], augs=[0, 1, 0],
        vocab_size=5, num_classes=3, grid_size=2, tokenizer="toy",
    )  # fmt: skip
    ds = TokenDataset(path, vocab_size=5, num_classes=3, grid_size=2)
    assert ds.num_rows == 3 and ds.tokens.dtype == np.int64 and ds.labels.dtype == np.int64
    np.testing.assert_array_equal(ds.tokens, tokens)
    np.testing.assert_array_equal(ds.labels, labels)
    assert ds.ids.tolist() == [7, 7, 9] and ds.augs.tolist() == [0, 1, 0]
    assert json.loads(pq.read_schema(path).metadata[METADATA_KEY]) == {"format": 1, **TOY_META}


def test_plain_list_column_without_optional_columns(tmp_path):
    path = _raw_parquet(
        tmp_path / "l.parquet",
        {"label": pa.array([1, 2], pa.int32()), "tokens": pa.array([[0, 1, 2, 3], [4, 3, 2, 1]], pa.list_(pa.int16()))},
        TOY_META,
    )
    ds = TokenDataset(path)
    assert ds.tokens.tolist() == [[0, 1, 2, 3], [4, 3, 2, 1]]
    assert ds.ids.tolist() == [0, 1] and ds.augs.tolist() == [0, 0]


def test_bad_token_names_file_row_and_value(tmp_path):
    tokens = [[0, 1, 2, 3]] * 3 + [[0, 1, 9, 3]]
    path = _raw_parquet(tmp_path / "bad_tok.parquet", {"label": [0, 1, 2, 0], "tokens": tokens}, TOY_META)
    with pytest.raises(DataError, match=r"bad_tok\.parquet: row 3 \(position 2\) has token id 9, outside \[0, 5\)"):
        TokenDataset(path)
    neg = _raw_parquet(tmp_path / "neg.parquet", {"label": [0], "tokens": [[0, -1, 0, 0]]}, TOY_META)
    with pytest.raises(DataError, match=r"neg\.parquet: row 0 \(position 1\) has token id -1"):
        TokenDataset(neg)
    with pytest.raises(DataError, match=r"being written\): row 1 \(position 0\) has token id 5"):
        write_token_parquet(tmp_path / "w.parquet", [0, 0], [[0] * 4, [5, 0, 0, 0]], tokenizer="toy",
                            vocab_size=5, num_classes=3, grid_size=2)  # fmt: skip
    assert not (tmp_path / "w.parquet").exists()


def test_bad_label_names_file_row_and_value(tmp_path):
    path = _raw_parquet(tmp_path / "bad_label.parquet", {"label": [0, 1, 3], "tokens": [[0] * 4] * 3}, TOY_META)
    with pytest.raises(DataError, match=r"bad_label\.parquet: row 2 has label 3, outside \[0, 3\)"):
        TokenDataset(path)
    nul = _raw_parquet(tmp_path / "null.parquet", {"label": [0, None], "tokens": [[0] * 4] * 2}, TOY_META)
    with pytest.raises(DataError, match=r"null\.parquet: row 1 has a null 'label'"):
        TokenDataset(nul)


def test_wrong_sequence_length(tmp_path):
    path = _raw_parquet(tmp_path / "len.parquet", {"label": [0, 1], "tokens": [[0] * 4, [0] * 3]}, TOY_META)
    with pytest.raises(DataError, match=r"len\.parquet: row 1 has 3 tokens, expected 4 \(grid_size 2 squared\)"):
        TokenDataset(path)
    with pytest.raises(DataError, match=r"tokens have shape \(2, 3\), expected \(2, 4\)"):
        write_token_parquet(tmp_path / "w.parquet", [0, 1], np.zeros((2, 3), int), tokenizer="toy",
                            vocab_size=5, num_classes=3, grid_size=2)  # fmt: skip


def test_missing_column_file_and_metadata(tmp_path):
    path = _raw_parquet(tmp_path / "nolabel.parquet", {"tokens": [[0] * 4]}, TOY_META)
    with pytest.raises(DataError, match=r"nolabel\.parquet: missing column 'label'"):
        TokenDataset(path)
    with pytest.raises(DataError, match=r"nothere\.parquet: no such dataset file"):
        TokenDataset(tmp_path / "nothere.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"junk\.parquet: not a readable Parquet file"):
        TokenDataset(tmp_path / "junk.parquet")
    bare = _raw_parquet(tmp_path / "bare.parquet", {"label": [0], "tokens": [[1, 2, 3, 4]]})
    with pytest.raises(DataError, match=r"bare\.parquet: no b'opd' metadata"):
        TokenDataset(bare, vocab_size=5)
    assert TokenDataset(bare, vocab_size=5, num_classes=3, grid_size=2).meta.tokenizer == "unknown"
    with pytest.raises(DataError, match=r"bare\.parquet: row 0 \(position 3\) has token id 4"):
        TokenDataset(bare, vocab_size=4, num_classes=3, grid_size=2)


def test_expected_config_must_match_metadata(tmp_path):
    path, _, _ = _small(tmp_path)
    with pytest.raises(DataError, match=r"small\.parquet: .* tokenized with vocab_size=5 \(toy\) but vocab_size=16384"):
        TokenDataset(path, vocab_size=16384)
    with pytest.raises(DataError, match=r"grid_size=2 \(toy\) but grid_size=16"):
        TokenDataset(path, grid_size=16)


# ----------------------------------------------------------------------------- stats


def test_dataset_stats_entropies(tmp_path):
    path = write_token_parquet(tmp_path / "s.parquet", [0, 1], [[0, 0, 0, 3], [1, 0, 0, 3]], vocab_size=4,
                               num_classes=2, grid_size=2, tokenizer="toy")  # fmt: skip
    stats = dataset_stats(TokenDataset(path))
    p = np.array([5, 1, 0, 2]) / 8
    assert math.isclose(stats["unigram_entropy_nats"], -(p[p > 0] * np.log(p[p > 0])).sum(), rel_tol=1e-12)
    assert math.isclose(stats["positional_entropy_nats"], math.log(2) / 4, rel_tol=1e-12)
    assert stats["vocab_used"] == 3 and stats["num_tokens"] == 8 and stats["class_counts"] == [1, 1]


def test_digits_unigram_baseline(digits_train):
    stats = dataset_stats(digits_train)
    assert 0 < stats["positional_entropy_nats"] < stats["unigram_entropy_nats"] < math.log(17)
    assert stats["vocab_used"] == 17 and stats["num_tokens"] == 1597 * 64


# ----------------------------------------------------------------------------- batches


def test_batches_deterministic_and_cover_each_epoch(digits_train):
    a = [next(b) for b in [PrefixBatcher(digits_train, 100, seed=7)] for _ in range(32)]
    b = list(iterate_batches(digits_train, 100, seed=7, num_batches=32))
    c = list(iterate_batches(digits_train, 100, seed=8, num_batches=1))
    assert [x.batch_id for x in a] == list(range(32))
    assert all(torch.equal(x.tokens, y.tokens) and torch.equal(x.labels, y.labels) for x, y in zip(a, b))
    assert not torch.equal(a[0].labels, c[0].labels)
    first = a[0]
    assert first.tokens.dtype == torch.int64 and first.tokens.shape == (100, 64) and first.labels.shape == (100,)
    np.testing.assert_array_equal(first.tokens.numpy(), digits_train.tokens[first.rows])
    np.testing.assert_array_equal(first.ids.numpy(), digits_train.ids[first.rows])
    # 15 batches per epoch (97 rows dropped); no row twice within an epoch; epochs differ in order
    epoch0 = np.concatenate([x.rows for x in a[:15]])
    assert len(np.unique(epoch0)) == 1500 and a[15].epoch == 1 and a[14].epoch == 0
    assert not np.array_equal(a[0].rows, a[15].rows)
    np.testing.assert_array_equal(epoch0, np.random.default_rng([7, 0]).permutation(1597)[:1500])


def test_resume_from_saved_cursor_is_exact(digits_train):
    full = list(iterate_batches(digits_train, 64, seed=3, num_batches=40))  # crosses epoch 24 -> 1
    batcher = PrefixBatcher(digits_train, 64, seed=3)
    for _ in range(23):
        next(batcher)
    state = json.loads(json.dumps(batcher.state_dict()))
    assert state["epoch"] == 0 and state["position"] == 23 * 64
    resumed = PrefixBatcher(digits_train, 64, seed=3)
    resumed.load_state_dict(state)
    tail = [next(resumed) for _ in range(17)]
    assert [x.batch_id for x in tail] == list(range(23, 40))
    assert all(torch.equal(x.tokens, y.tokens) and np.array_equal(x.rows, y.rows) for x, y in zip(tail, full[23:]))
    via_fn = list(iterate_batches(digits_train, 64, seed=3, num_batches=2, state=state))
    assert np.array_equal(via_fn[1].rows, full[24].rows)
    assert np.array_equal(batcher.batch_at(31).rows, full[31].rows)


def test_cursor_mismatch_and_bad_settings(digits_train, tmp_path):
    state = PrefixBatcher(digits_train, 64, seed=3).state_dict()
    with pytest.raises(DataError, match=r"saved data cursor has seed=3 but this run has seed=4"):
        PrefixBatcher(digits_train, 64, seed=4).load_state_dict(state)
    with pytest.raises(DataError, match=r"not a batch boundary"):
        PrefixBatcher(digits_train, 64, seed=3).load_state_dict({**state, "position": 10})
    path, _, _ = _small(tmp_path, n=10)
    with pytest.raises(DataError, match=r"batch_size 11 is larger than the 10 rows"):
        PrefixBatcher(TokenDataset(path), 11, seed=0)
    keep = list(iterate_batches(TokenDataset(path), 4, seed=0, num_batches=4, drop_last=False))
    assert [len(x.rows) for x in keep] == [4, 4, 2, 4] and [x.batch_id for x in keep] == [0, 1, 2, 3]


# ----------------------------------------------------------------------------- LlamaGen codes


def _llamagen_dirs(tmp_path, n_aug=3, grid=3, indices=(0, 1, 2, 10), squeeze=False):
    codes_dir, labels_dir = tmp_path / "imagenet48_codes", tmp_path / "imagenet48_labels"
    codes_dir.mkdir()
    labels_dir.mkdir()
    rng = np.random.default_rng(1)
    truth = {}
    for i in indices:
        codes = rng.integers(0, 50, (1, n_aug, grid * grid))
        label = np.array([rng.integers(0, 7)])
        np.save(codes_dir / f"{i}.npy", codes[0] if squeeze else codes)
        np.save(labels_dir / f"{i}.npy", label)
        truth[i] = (codes[0], int(label[0]))
    return codes_dir, labels_dir, truth


@pytest.mark.parametrize("squeeze", [False, True])
def test_llamagen_codes_round_trip(tmp_path, squeeze):
    codes_dir, labels_dir, truth = _llamagen_dirs(tmp_path, squeeze=squeeze)
    out = prepare_llamagen_codes(codes_dir, labels_dir, tmp_path / "codes.parquet", vocab_size=50, num_classes=7,
                                 rows_per_group=5)  # fmt: skip
    ds = TokenDataset(out, vocab_size=50, num_classes=7, grid_size=3)
    assert ds.num_rows == 12 and ds.meta.tokenizer == "llamagen-vq-ds16"
    assert ds.ids.tolist() == [0] * 3 + [1] * 3 + [2] * 3 + [10] * 3 and ds.augs.tolist() == [0, 1, 2] * 4
    for row in range(ds.num_rows):
        codes, label = truth[int(ds.ids[row])]
        np.testing.assert_array_equal(ds.tokens[row], codes[ds.augs[row]])
        assert ds.labels[row] == label
    assert pq.ParquetFile(out).num_row_groups == 2


def test_llamagen_codes_errors_name_the_file(tmp_path):
    codes_dir, labels_dir, _ = _llamagen_dirs(tmp_path, indices=(0, 1))
    out = tmp_path / "o.parquet"
    np.save(codes_dir / "1.npy", np.array([[[0, 1, 2, 3, 4, 5, 6, 7, 99]]]))
    with pytest.raises(DataError, match=r"1\.npy: augmentation 0 \(position 8\) has token id 99, outside \[0, 50\)"):
        prepare_llamagen_codes(codes_dir, labels_dir, out, vocab_size=50, num_classes=7)
    assert not out.exists() and not list(tmp_path.glob(".o.parquet*"))
    np.save(codes_dir / "1.npy", np.zeros((1, 2, 4), np.int64))
    with pytest.raises(DataError, match=r"1\.npy: 4 tokens per image, but earlier files have 9"):
        prepare_llamagen_codes(codes_dir, labels_dir, out, vocab_size=50, num_classes=7)
    np.save(codes_dir / "0.npy", np.zeros((1, 2, 8), np.int64))
    with pytest.raises(DataError, match=r"0\.npy: 8 tokens per image is not a square grid"):
        prepare_llamagen_codes(codes_dir, labels_dir, out, vocab_size=50, num_classes=7)
    np.save(codes_dir / "0.npy", np.zeros((1, 2, 4), np.int64))
    (labels_dir / "1.npy").unlink()
    with pytest.raises(DataError, match=r"imagenet48_labels/1\.npy: missing label file"):
        prepare_llamagen_codes(codes_dir, labels_dir, out, vocab_size=50, num_classes=7)
    np.save(labels_dir / "1.npy", np.array([7]))
    with pytest.raises(DataError, match=r"imagenet48_labels/1\.npy: the file has label 7, outside \[0, 7\)"):
        prepare_llamagen_codes(codes_dir, labels_dir, out, vocab_size=50, num_classes=7)
    with pytest.raises(DataError, match=r"empty_codes: no \.npy code files"):
        (tmp_path / "empty_codes").mkdir()
        prepare_llamagen_codes(tmp_path / "empty_codes", labels_dir, out)
