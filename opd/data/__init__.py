"""Token datasets: the Parquet format, validated reading, deterministic batches, converters.

Modules: format (schema, TokenDataset), batches (PrefixBatcher), digits (the embedded default),
llamagen (converter of LlamaGen's extracted codes).

Format (one row per image, or per (image, augmentation)):

    label   int32/int64                       class index in [0, num_classes)
    tokens  fixed_size_list<int> or list<int>  grid_size**2 token ids in [0, vocab_size), raster order
    id      int64, optional                   source image id (default: row index)
    aug     int, optional                     augmentation index (default: 0)

The Parquet schema metadata key ``b"opd"`` holds JSON
``{"format": 1, "vocab_size", "num_classes", "grid_size", "tokenizer"}``.

Embedded default dataset (``prepare_digits``): scikit-learn's bundled UCI digits (1797 images,
8x8, grey levels 0..16, 10 classes), in one of two tokenizations:

``digits8-v1`` (grid_size 8, the default): token = the grey level of each of the 64 pixels,
    raster order -> 64 tokens, vocab_size 17. Decoded images are upsampled to 16x16 levels
    exactly as digits16-v1 tokenizes, so a data image decodes to the same pixels in both.
``digits16-v1`` (grid_size 16): each image is upsampled to 16x16 by separable bilinear interpolation with corner pixels
    aligned (``F.interpolate(mode="bilinear", align_corners=True)``; source coordinate of output
    index i is i*7/15), i.e. ``up = A @ img @ A.T`` with A the (16, 8) linear-interpolation
    matrix. Every value of ``up`` is k/225 for an integer k, so it is never exactly half-way
    between two integers and rounding to the nearest of the 17 grey levels 0..16 is unambiguous.
    Token = grey level, raster order -> 256 tokens, vocab_size 17, num_classes 10, grid_size 16.
    Inverse (``digits_tokens_to_images``): pixel = floor(level * 255 / 16 + 1/2), uint8.
    Split: per class, a permutation seeded with (0, class) puts its first 20 images in
    ``heldout`` (200 rows) and the rest in ``train`` (1597 rows); rows keep sklearn's order
    and ``id`` is the sklearn index.

LlamaGen layout (``prepare_llamagen_codes``): ``extract_codes_c2i.py`` writes
``imagenet{size}_codes/{i}.npy`` of shape (1, aug, T) or (aug, T) and
``imagenet{size}_labels/{i}.npy`` of shape (1,); one row per (i, aug) is written.
"""
from __future__ import annotations

from opd.data.batches import PrefixBatch, PrefixBatcher, iterate_batches
from opd.data.digits import (DIGITS_CLASSES, DIGITS_GRID, DIGITS_HELDOUT_PER_CLASS, DIGITS_SIDE,
                             DIGITS_SPLIT_SEED, DIGITS_TOKENIZERS, DIGITS_VOCAB, bilinear_matrix,
                             digits_images_to_tokens, digits_split, digits_tokens_to_images, digits_upsample, prepare_digits)
from opd.data.format import (FORMAT_VERSION, LLAMAGEN_TOKENIZER, METADATA_KEY,
                             REQUIRED_COLUMNS, DataError, DatasetMeta, TokenDataset, dataset_stats,
                             write_token_parquet)
from opd.data.llamagen import prepare_llamagen_codes

__all__ = [
    "DIGITS_CLASSES", "DIGITS_GRID", "DIGITS_HELDOUT_PER_CLASS", "DIGITS_SIDE", "DIGITS_SPLIT_SEED",
    "DIGITS_TOKENIZERS", "DIGITS_VOCAB",
    "FORMAT_VERSION", "LLAMAGEN_TOKENIZER", "METADATA_KEY", "REQUIRED_COLUMNS",
    "DataError", "DatasetMeta", "PrefixBatch", "PrefixBatcher", "TokenDataset", "bilinear_matrix",
    "dataset_stats", "digits_images_to_tokens", "digits_split", "digits_tokens_to_images",
    "digits_upsample", "iterate_batches", "prepare_digits", "prepare_llamagen_codes",
    "write_token_parquet",
]
