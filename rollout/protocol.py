"""The model protocol that rollout engines run against.

Sequence layout (LlamaGen class-conditional): one class token at position 0, image token i
(raster order) at position i + 1.  The logits at position p are the distribution of image
token p.  So after a prefill of P image tokens the last logits row (position P) predicts
image token P, and a cached forward of image token j at position j + 1 predicts token j + 1.

The KV cache has `max_batch` physical rows.  Every call names the physical rows it reads and
writes (`rows`), so an engine can run any subset of images (Compact execution) or all of them
(Full execution).  Writes are per row and per position; a query at position p of row r attends
to the keys of row r at positions <= p only, so stale entries past p (rejected drafts) are
never seen and are overwritten by the next forward that reaches them.

CFG: the engine puts an image's conditional branch and its unconditional branch (null class
label `num_classes`) in two physical rows that it advances together.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class RolloutModel(Protocol):
    """What an engine needs from a class-conditional AR image model."""

    vocab_size: int      # number of image token ids
    num_classes: int     # class labels 0..num_classes-1; label num_classes is the null class (CFG)
    block_size: int      # image tokens per sequence (grid_size ** 2)
    grid_size: int       # image tokens per grid row

    def setup_cache(self, max_batch: int, max_len: int) -> None:
        """Provide a KV cache of at least `max_batch` physical rows and `max_len` slots
        (block_size + 1 positions; more with candidate drafting's scratch slots, see
        `forward_cached`'s tree), on the model's device and dtype; one that is large
        enough may be kept from an earlier call (stale entries are never read, see above)."""
        ...

    def prefill(self, labels: Tensor, prefix: Tensor, rows: Tensor | None) -> Tensor:
        """labels: (B,) int64, prefix: (B, P) int64 image tokens, rows: (B,) int64 cache
        rows, or None for rows 0..B-1 (Full execution: the model slices its cache instead of
        gathering rows).

        Writes positions 0..P of `rows` and returns logits (B, P + 1, vocab_size) float32;
        logits[:, -1] is the distribution of image token P."""
        ...

    def forward_cached(self, tokens: Tensor, positions: Tensor, rows: Tensor | None) -> Tensor:
        """tokens: (B, S) int64 image tokens, positions: (B, S) int64 sequence positions
        (image token j sits at position j + 1), rows: (B,) int64 distinct cache rows, or None
        for rows 0..B-1.

        Writes the keys/values of every (row, position) and returns logits (B, S, vocab_size)
        float32; logits[b, s] is the distribution of image token number positions[b, s], the
        token that follows the input token tokens[b, s].  Positions within a row
        must be increasing; every position < positions[b, 0] of that row must have been
        written before.

        Optional (engines with candidates >= 2 need it): `forward_cached(..., tree)` with
        tree (B, S, S) bool verifies a token tree (column s cached in slot positions[b, 0] + s,
        seeing the slots before positions[b, 0] and the columns tree[b, s]), and
        `move_cached(rows, src, dst)` copies cache slots (B, C) within each row; see
        opd.models.GPT."""
        ...
