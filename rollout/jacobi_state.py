"""The records of a Jacobi rollout call: its constants (`Plan`, with candidate drafting's window
layout `Tree`) and the batch's state (`JacobiState`).  rollout/jacobi.py's round and
rollout/candidates.py's candidate drafting both read and write them; they live here so neither
of the two imports the other's types.  A backticked function without a module is
rollout/jacobi.py's.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from torch import Tensor


@dataclass
class Tree:
    """The window layout with K branches (constants of a generate call); C = W + (K - 1) L
    columns: the root (0), branch 0 (1..W-1, the plain window's drafts), then branches j > 0
    (L columns each, from W + (j - 1) L)."""
    K: int
    L: int               # columns of each branch j > 0
    depth: Tensor        # (C,) position offset of each column: root 0, branch column t: 1 + t
    base: Tensor         # (K,) first column of each branch
    length: Tensor       # (K,) columns of each branch
    path: Tensor         # (K, W) column of aligned index i when branch j wins (padded)
    mask: Tensor         # (C, C) bool, column s sees column t

    @property
    def extra(self) -> int:
        """Columns (and cache slots) beyond the plain window."""
        return (self.K - 1) * self.L


@dataclass
class Plan:
    """Constants of one generate call, built once so a round allocates no index tensors."""
    T: int               # P + N
    W: int               # window (<= N - 1)
    H: int               # history offset
    update: Callable     # the verification step after the forward: `jacobi_update`, rows on
    #                      their own (rollout/baselines/sjd_sync.py: the batch minimum)
    coupled: bool        # speculative drafts refreshed by maximal coupling (else resampled)
    ar: Tensor           # (W,) 0..W-1
    col: Tensor          # (W, 1) 0..W-1: the window's columns
    scratch: Tensor      # (W, 1) T..T+W-1: slots past the sequence, for columns not written
    checked: Tensor      # (W, 1) bool: the columns holding a draft (all but the last)
    fill: Tensor         # (F, 1) 0..F-1 with F = max(W - 1, 1): history-filled tokens,
    #                      counted from the first of them (`fill_history`)
    fill_src: Tensor     # (F, 1) fill % H - H: their sources, counted the same way
    q_cols: Tensor       # (W, 1) 0..W-2, W-2: column c of the next window is column
    #                      shift + q_cols[c] of this one (`next_proposals`; the last, no
    #                      draft, repeats W - 2)
    streams: Tensor      # (4, 1, 1, 1) the streams of a round's uniforms: accept, couple,
    #                      token, draft
    vocab: Tensor | None = None  # (V,) 0..V-1 (one-hot proposals of filled tokens)
    tree: Tree | None = None  # candidate drafting's window layout (rollout/candidates.py)
    known: Tensor | None = None  # (h,) candidate drafting: the committed tokens this far
    #                              before token cur join its candidates, (H,) greedy or
    #                              "sample", (1, H) "speculative" (`candidates.candidates`)
    scratch_len: int = 0  # slots of seq / logp past T (>= W; the largest window with W "auto")
    K: int = 0           # candidates of the call (>= 2: the state carries cand and on_tree,
    #                      also in a window without a tree, W 1 of W "auto", so rows
    #                      refilled then match the rest)


@dataclass
class JacobiState:
    seq: Tensor          # (B, T + scratch_len) int64 committed tokens, then drafts; past T scratch
    cur: Tensor          # (B,) int64 committed length
    rounds: Tensor       # (B,) int64 rounds taken so far (= attempt number of the next round)
    key: Tensor          # (B,) int64 RNG key of each image (sampling.image_key)
    q: Tensor | None     # (B, W, V) proposal of the token of each window column (sample
    #                      mode; the last column's is never used), else None
    logp: Tensor | None = None  # (B, T + scratch_len) float32 behaviour log-probs of the committed
    #                             tokens, laid out like seq (None: not recorded)
    cand: Tensor | None = None  # (B, K) int64 candidates for token cur (plan.K)
    on_tree: Tensor | None = None  # (B,) bool the next window is a tree (plan.K)

    def select(self, idx: Tensor) -> JacobiState:
        """The sub-batch of rows idx (copies)."""
        return JacobiState(*(None if getattr(self, f.name) is None else getattr(self, f.name)[idx]
                             for f in fields(self)))

    def assign(self, idx: Tensor, sub: JacobiState, new_images: bool = False) -> None:
        """Write a sub-batch back into rows idx (`key` changes only when rows get new images)."""
        for name in (("seq", "cur", "rounds", "q", "logp", "cand", "on_tree")
                     + (("key",) if new_images else ())):
            if getattr(self, name) is not None:
                getattr(self, name)[idx] = getattr(sub, name)
