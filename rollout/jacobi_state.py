"""The records of a Jacobi rollout call: its constants (`Plan`, with candidate drafting's window
layout `Tree`), the batch's state (`JacobiState`), and the window kind a round calls
(`Drafting`: rollout/jacobi.py's `PlainWindow`, or rollout/candidates.py's `CandidateTree`, a
plug-in) with the window it verifies (`Path`).  rollout/jacobi.py's round and
rollout/candidates.py's candidate drafting both read and write them; they live here so neither
of the two imports the other's types.  A backticked function without a module is
rollout/jacobi.py's.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, NamedTuple, Protocol

from torch import Tensor

if TYPE_CHECKING:
    import torch

    from rollout.engine import Request


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
    drafting: Drafting   # the window kind: `PlainWindow`, or candidate drafting's
    #                      (rollout/candidates.py `CandidateTree`)
    vocab: Tensor | None = None  # (V,) 0..V-1 (one-hot proposals of filled tokens)
    scratch_len: int = 0  # slots of seq / logp past T (>= W; the largest window with W "auto")


@dataclass
class JacobiState:
    seq: Tensor          # (B, T + scratch_len) int64 committed tokens, then drafts; past T scratch
    cur: Tensor          # (B,) int64 committed length
    rounds: Tensor       # (B,) int64 rounds taken so far (= attempt number of the next round)
    key: Tensor          # (B,) int64 RNG key of each image (sampling.image_key)
    q: Tensor | None     # (B, W, V) proposal of the token of each window column (sample
    #                      mode; the last column's is never used), else None
    logp: Tensor | None = None  # (B, T + scratch_len) float32 behaviour log-probs of the
    #                             committed tokens, laid out like seq (`init_state` makes it;
    #                             every round writes it)
    cand: Tensor | None = None  # (B, K) int64 candidates for token cur (candidate drafting)
    on_tree: Tensor | None = None  # (B,) bool the next window is a tree (candidate drafting)

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


class Path(NamedTuple):
    """The plain window a round's verification reads (rollout/verify.py): the window itself, or
    a tree window along the branch its root column chose (rollout/candidates.py)."""
    guided: Tensor        # (B, W, V) the path's logits
    p: Tensor | None      # (B, W, V) their probabilities (None where the round has none)
    held: Tensor          # (B, W, 1) bool committed before, or (a branch j > 0) chosen by the
    #                       root column: c_j at the root's column
    checked: Tensor       # (W, 1) or (B, W, 1) bool the drafts to check
    drafted: Tensor | None  # (W, 1) bool the columns holding drafts (the coupled refresh's;
    #                         None: the checked ones)
    last: Tensor | int    # the first column not checked: W - 1, or (B, 1, 1) int64
    branch: Tensor | None  # (B,) int64 the branch each row took (None: no tree)


class Drafting(Protocol):
    """The window kind of a call, which a round calls at its seams instead of branching on it:
    rollout/jacobi.py `PlainWindow` (the W columns as they are) or rollout/candidates.py
    `CandidateTree` (candidate drafting's token tree)."""

    def fresh(self, B: int, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
        """The state of B fresh images: `JacobiState.cand` and `on_tree`."""

    def rewound(self, on_tree: Tensor | None) -> Tensor | None:
        """on_tree for a round of this window after rounds of another (`rewindow`)."""

    def forward(self, model, st: JacobiState, tokens: Tensor, positions: Tensor,
                offset: Tensor, req: Request, rows: Tensor | None,
                plan: Plan) -> tuple[Tensor, Tensor]:
        """The verifier forward of the plain windows tokens, positions (B, W) -> logits
        (2B or B, C, V) and positions (B, C) of its C >= W columns."""

    def path(self, st: JacobiState, guided: Tensor, p: Tensor | None, u: Tensor | None,
             offset: Tensor, off: Tensor, done: Tensor, plan: Plan) -> Path:
        """The plain window the verification reads from the forward's C columns."""

    def next(self, st: JacobiState, guided: Tensor, offset: Tensor, a: Tensor, m: Tensor,
             last: Tensor | int, branch: Tensor | None, plan: Plan) -> None:
        """After the commit (before cur advances): the next window's drafting state."""

    def move(self, model, positions: Tensor, offset: Tensor, branch: Tensor | None,
             req: Request, rows: Tensor | None) -> None:
        """After the verification: the cache slots of the columns kept, into place."""
