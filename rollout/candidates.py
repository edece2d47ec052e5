"""Candidate drafting at the correction point (SJD-PAC's proactive drafting), greedy and sampled.

After a round whose verification corrected a token, the next window's first draft (token cur)
was predicted from the rejected draft: the Jacobi "single-token stall" (each round commits the
corrected token and little more).  With K candidates such a row's next window also verifies
K - 1 alternatives for token cur, as branches of a token tree appended to the W columns:

    columns 0..W-1       the plain window: root (token cur - 1 at position cur), branch 0 =
                         the W - 1 drafts (its first, c_0, is the stale prediction's draft)
    branch j = 1..K-1    L columns: [c_j, drafts cur + 1 ..] at positions cur + 1 ..

Candidates (`candidates`): c_0, then committed tokens before token cur -- the one a history
offset H above (one grid row: HB-SJD's history draft), and with sampled decoding first token
cur - 1, the corrected token itself (a residual draw lands where the new distribution exceeds
the stale one, rarely among the stale top tokens, while image tokens often repeat their left
neighbour; greedy windows gained more with H's token alone) -- then the most likely tokens of
the stale prediction, without repeats.
A branch sees the committed tokens, the root and its own earlier columns (`make_tree`'s mask;
in a clipped tail window every column up to the root).  The model caches column s in slot
start + s (rollout/protocol.py); a winning branch j > 0 is moved to slots cur + 1 .. .

Verification: the root column chooses token cur (`rollout.jacobi.root_token`) -- greedy: its
argmax; sampled: speculative sampling of c_0 alone, i.e. c_0 kept with probability
min(1, p(c_0) / q(c_0)), else a draw y from norm(max(0, p - q)) (rollout/verify.py).  The
branch whose c_j equals that token (else branch 0, whose c_0 is then rejected) is the row's
*path*; verification runs along it as along a plain window, over its 1 + L valid predictions
for j > 0 (the drafts after them are branch 0's, predicted after a wrong token, so the next
window is a tree again).  Greedy: every committed token is an argmax given committed tokens
only, so the output is Cached AR's (invariant 1).  Sampled: this is recursive rejection
sampling with one random draft c_0 ~ q and K - 1 fixed ones (a fixed draft c is accepted with
the probability the residual gives it, i.e. exactly when the residual's draw is c), so token
cur is distributed as p whatever the candidates are; the drafts along the path were drawn
from their recorded proposals with uniforms of earlier rounds, independent of this round's,
so ordinary speculative sampling against the path's p (computed after c_j) and the coupled
refresh after its first rejection stay exact (invariant 2; tests/rollout/test_distribution.py).
Past a branch's L columns the path's tokens still hold drafts: the coupled refresh keeps them
too, and a bonus token at the branch's last column keeps its draft with probability
min(1, p / q) (else the residual draw), distributed as p all the same.
Each round costs (K - 1) L more query columns for every row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
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


def make_tree(W: int, K: int, device: torch.device, L: int = 1) -> Tree | None:
    """The layout, or None when there is nothing to branch (K < 2 or W < 2)."""
    if K < 2 or W < 2:
        return None
    L = min(L, W - 1)
    length = torch.tensor([W - 1] + [L] * (K - 1))
    base = torch.tensor([1] + [W + j * L for j in range(K - 1)])
    C = W + (K - 1) * L
    branch = torch.full((C,), -1, dtype=torch.long)
    depth = torch.zeros(C, dtype=torch.long)
    for j in range(K):
        cols = torch.arange(int(base[j]), int(base[j] + length[j]))
        branch[cols], depth[cols] = j, 1 + torch.arange(len(cols))
    col = torch.arange(C)
    mask = (col[None] == 0) | ((branch[:, None] == branch[None]) & (depth[None] <= depth[:, None]))
    path = torch.zeros(K, W, dtype=torch.long)
    path[:, 1:] = torch.arange(1, W)                  # past branch j: branch 0's columns
    for j in range(1, K):
        path[j, 1: L + 1] = base[j] + torch.arange(L)
    return Tree(K, L, depth.to(device), base.to(device), length.to(device), path.to(device),
                mask.to(device))


def candidates(logits: Tensor, draft: Tensor, known: Tensor, K: int) -> Tensor:
    """The K candidates for the token after a correction: (B, V) logits of its (stale)
    prediction, draft (B,) the window's draft for it (its argmax when greedy, a sample when
    sampled), known (B, h) committed tokens before it (`Plan.known`: the one a history offset
    H earlier; sampled, first the token just before it) -> (B, K) int64 distinct tokens:
    [draft, known, the most likely tokens of the prediction], each first occurrence kept
    (K <= V)."""
    top = logits.topk(K, dim=-1).indices
    pool = torch.cat([draft[:, None], known, top], 1)                   # (B, K + h + 1)
    repeat = (pool[:, :, None] == pool[:, None, :]).tril(-1).any(2)   # equals an earlier one
    order = torch.sort(repeat.to(torch.uint8), dim=1, stable=True).indices[:, :K]
    return pool.gather(1, order)


def tree_window(tokens: Tensor, positions: Tensor, offset: Tensor, seq: Tensor, cand: Tensor,
                tree: Tree) -> tuple[Tensor, Tensor, Tensor]:
    """Append the branches j > 0 to plain windows.  tokens, positions (B, W) and offset (B,)
    from `window_inputs`, seq (B, T + W), cand (B, K) -> tokens, positions (B, C) and the
    attention mask (B, C, C) bool.  Branch j is [c_j, the drafts after token cur] at positions
    cur + 1..; it sees the window's columns up to the root (column offset) and its own earlier
    columns.  Only rows with candidates use it (elsewhere the columns are computed, ignored)."""
    W, T = tokens.shape[1], seq.shape[1] - tokens.shape[1]
    root = positions.gather(1, offset.clamp(max=W - 1)[:, None])          # (B, 1) = cur
    pos = (root + tree.depth[W:]).clamp_(max=T - 1)     # past token T - 1: unused columns
    alt = seq.gather(1, pos - 1)
    alt[:, tree.base[1:] - W] = cand[:, 1:]
    mask = tree.mask.expand(tokens.shape[0], -1, -1).clone()
    mask[:, W:, :W] = torch.arange(W, device=offset.device) <= offset[:, None, None]
    return torch.cat([tokens, alt], 1), torch.cat([positions, pos], 1), mask


def choose_path(root: Tensor, offset: Tensor, cand: Tensor, on: Tensor,
                tree: Tree) -> tuple[Tensor, Tensor, Tensor]:
    """root: (B,) the token the root column chose for token cur (`rollout.jacobi.root_token`),
    offset: (B,) the root's column, cand: (B, K), on: (B,) rows with candidates.  -> branch
    (B,) (the first c_j equal to root, else 0; 0 off the tree), path (B, W) column of each
    aligned index, valid (B,) aligned predictions made under committed tokens only along the
    path (W on branch 0)."""
    W = tree.path.shape[1]
    match = cand == root[:, None]
    branch = torch.where(on & match.any(1), match.long().argmax(1), 0)
    path = tree.path[branch]
    path = torch.where(path >= W, path, (path + offset[:, None]).clamp(max=W - 1))
    return branch, path, 1 + tree.length[branch]


def moves(start: Tensor, offset: Tensor, branch: Tensor, tree: Tree) -> tuple[Tensor, Tensor]:
    """Cache slots to move after a round: (B, L) src, dst.  start, offset: (B,) the window's
    first slot and the root's column (`window_inputs`).  The columns of a winning branch
    j > 0 go to slots cur + 1..; other rows copy slots start + 1.. onto themselves."""
    t = torch.arange(tree.L, device=start.device)
    won = (branch > 0)[:, None]
    dst = torch.where(won, (start + offset + 1)[:, None], (start + 1)[:, None]) + t
    src = torch.where(won, start[:, None] + tree.base[branch][:, None] + t, dst)
    return src, dst
