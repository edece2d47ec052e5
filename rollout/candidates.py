"""Candidate drafting at the correction point (SJD-PAC's proactive drafting), every decoding.

After a round whose verification corrected a token, the next window's first draft (token cur)
was predicted from the rejected draft: the Jacobi "single-token stall" (each round commits the
corrected token and little more).  With K candidates such a row's next window also verifies
K - 1 alternatives for token cur, as branches of a token tree appended to the W columns:

    columns 0..W-1       the plain window: root (token cur - 1 at position cur), branch 0 =
                         the W - 1 drafts (its first, c_0, is the stale prediction's draft)
    branch j = 1..K-1    L columns: [c_j, drafts cur + 1 ..] at positions cur + 1 ..

Candidates (`candidates`): c_0, then committed tokens before token cur -- the one a history
offset H above (one grid row: HB-SJD's history draft), and with decoding "speculative" first token
cur - 1, the corrected token itself (a residual draw lands where the new distribution exceeds
the stale one, rarely among the stale top tokens, while image tokens often repeat their left
neighbour; greedy windows gained more with H's token alone) -- then the most likely tokens of
the stale prediction, without repeats.
A branch sees the committed tokens, the root and its own earlier columns (`make_tree`'s mask;
in a clipped tail window every column up to the root).  The model caches column s in slot
start + s (rollout/protocol.py); a winning branch j > 0 is moved to slots cur + 1 .. .

Verification: the root column chooses token cur (`root_token`) -- greedy: its
argmax; decoding "sample": the argmax of its perturbed scores (rollout/sampling.py `perturb`,
applied to the whole tree window before the path is chosen, so the candidates are the stale
prediction's next-best perturbed tokens and every committed token is Cached AR's, as greedy);
"speculative": speculative sampling of c_0 alone, i.e. c_0 kept with probability
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

A plug-in: `candidate_tree` builds the call's window kind (`Plan.drafting`, the
`jacobi_state.Drafting` methods the round calls in place of rollout/jacobi.py's `PlainWindow`):
`CandidateTree.forward` runs the tree window (rollout/rounds.py `forward_window`), `path` turns
it into the plain window the verification reads (rollout/jacobi.py `verify`), `next` drafts
the next candidates (`commit`), `move` moves a winning branch's cache slots into place
(rollout/rounds.py `verify_window`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from rollout.engine import Request, cfg_rows
from rollout.jacobi_state import JacobiState, Path, Plan, Tree
from rollout.verify import verify_sample


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
    sampled), known (B, h) committed tokens before it (`CandidateTree.known`: the one a history
    offset H earlier; sampled, first the token just before it) -> (B, K) int64 distinct tokens:
    [draft, known, the most likely tokens of the prediction], each first occurrence kept
    (K <= V)."""
    top = logits.topk(K, dim=-1).indices
    pool = torch.cat([draft[:, None], known, top], 1)                   # (B, K + h + 1)
    repeat = (pool[:, :, None] == pool[:, None, :]).tril(-1).any(2)   # equals an earlier one
    order = torch.sort(repeat.to(torch.uint8), dim=1, stable=True).indices[:, :K]
    return pool.gather(1, order)


def tree_window(tokens: Tensor, positions: Tensor, offset: Tensor, seq: Tensor, cand: Tensor,
                tree: Tree, T: int) -> tuple[Tensor, Tensor, Tensor]:
    """Append the branches j > 0 to plain windows.  tokens, positions (B, W) and offset (B,)
    from `window_inputs`, seq (B, T + scratch_len) (scratch_len >= W: the largest window with
    W "auto"), cand (B, K), T = P + N (`Plan.T`) -> tokens, positions (B, C) and the attention
    mask (B, C, C) bool.  Branch j is [c_j, the drafts after token cur] at positions cur + 1..; it
    sees the window's columns up to the root (column offset) and its own earlier columns.  Only
    rows with candidates use it (elsewhere the columns are computed, ignored)."""
    W = tokens.shape[1]
    root = positions.gather(1, offset.clamp(max=W - 1)[:, None])          # (B, 1) = cur
    pos = (root + tree.depth[W:]).clamp_(max=T - 1)     # past token T - 1: unused columns
    alt = seq.gather(1, pos - 1)
    alt[:, tree.base[1:] - W] = cand[:, 1:]
    mask = tree.mask.expand(tokens.shape[0], -1, -1).clone()
    mask[:, W:, :W] = torch.arange(W, device=offset.device) <= offset[:, None, None]
    return torch.cat([tokens, alt], 1), torch.cat([positions, pos], 1), mask


def root_token(st: JacobiState, guided: Tensor, p: Tensor | None, offset: Tensor,
               u: Tensor | None, plan: Plan) -> Tensor:
    """The token cur the root column chooses.
    guided: (B, C, V) logits of the tree window, p: their warped probabilities (sampled; else
    None), u: (4, B, W, 1) the round's uniforms (sampled) -> (B,) int64: the argmax (greedy),
    or (sampled) `verify_sample` of the root column alone: its draft c_0 = seq[cur] kept with
    probability min(1, p(c_0) / q(c_0)), else the residual draw -- the same uniforms, so the
    same token as the whole window's verification gives that column on branch 0."""
    B, V = guided.shape[0], guided.shape[-1]
    col = offset.clamp(max=plan.W - 1).view(B, 1, 1)
    if u is None:
        return guided.gather(1, col.expand(B, 1, V)).argmax(-1).view(B)
    c0 = st.seq.gather(1, st.cur[:, None]).view(B, 1, 1)
    p0, q0 = (x.gather(1, col.expand(B, 1, V)) for x in (p, st.q))          # (B, 1, V)
    u0 = u.gather(2, col.expand(4, B, 1, 1))                                 # (4, B, 1, 1)
    no = torch.zeros(B, 1, 1, dtype=torch.bool, device=col.device)
    _, token = verify_sample(p0, c0, q0, no, ~no, u0, plan.col[:1], False)
    return token.view(B)


def choose_path(root: Tensor, offset: Tensor, cand: Tensor, on: Tensor,
                tree: Tree) -> tuple[Tensor, Tensor, Tensor]:
    """root: (B,) the token the root column chose for token cur (`root_token`),
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


def candidate_tree(W: int, K: int, H: int, device: torch.device, L: int | None = None,
                   speculative: bool = False) -> CandidateTree:
    """Candidate drafting with K >= 2 candidates, branches of L columns (None: 1), history
    offset H, at window W (no tree at W = 1, `make_tree`); speculative: decoding
    "speculative" (the token just before joins the candidates)."""
    return CandidateTree(make_tree(W, K, device, L or 1), K,
                         torch.tensor([1, H] if speculative else [H], device=device))


class CandidateTree:
    """Candidate drafting as a call's window kind (`jacobi_state.Drafting`): a row whose last
    round corrected a token verifies a token tree, the plain window and K - 1 branches."""

    def __init__(self, tree: Tree | None, K: int, known: Tensor):
        self.tree = tree      # the window layout (None: W = 1, no tree; the state still
        #                       carries cand and on_tree, so rows refilled then match the rest)
        self.K = K
        self.known = known    # (h,) the committed tokens this far before token cur join its
        #                       candidates, (H,) greedy or "sample", (1, H) "speculative"

    def fresh(self, B: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """The candidate state of B fresh images: cand (B, K) int64 zeros, on_tree (B,) False."""
        return (torch.zeros(B, self.K, dtype=torch.long, device=device),
                torch.zeros(B, dtype=torch.bool, device=device))

    def rewound(self, on_tree: Tensor) -> Tensor:
        """A window without a tree (W = 1) leaves no tree for the next one."""
        return on_tree if self.tree is not None else torch.zeros_like(on_tree)

    def forward(self, model, st: JacobiState, tokens: Tensor, positions: Tensor, offset: Tensor,
                req: Request, rows: Tensor | None, plan: Plan) -> tuple[Tensor, Tensor]:
        """The verifier forward of the plain windows tokens, positions (B, W) with their
        branches (`tree_window`; cache rows `rows`, None = Full execution) -> logits (2B or B,
        C, V) and positions (B, C)."""
        tokens, positions, mask = tree_window(tokens, positions, offset, st.seq, st.cand,
                                              self.tree, plan.T)
        logits = model.forward_cached(cfg_rows(tokens, req), cfg_rows(positions, req), rows,
                                      cfg_rows(mask, req))
        return logits, positions

    def path(self, st: JacobiState, guided: Tensor, p: Tensor | None, u: Tensor | None,
             offset: Tensor, off: Tensor, done: Tensor, plan: Plan) -> Path:
        """Verify along the branch whose candidate is the token the root column chose
        (`root_token`).  guided: (B, C, V) logits of the tree window, p: their probabilities
        or None, u: the round's uniforms or None (`root_token`), offset: (B,) the root's
        column (off: the same, (B, 1, 1)), done: (B, W, 1) bool the columns committed before
        the round.  Writes the winning candidate into seq as draft cur."""
        root = root_token(st, guided, p, offset, u, plan)
        B, W, V = guided.shape[0], plan.W, guided.shape[-1]
        branch, path, t_width = choose_path(root, offset, st.cand, st.on_tree, self.tree)
        behind = plan.ar - offset[:, None]                    # (B, W) path index of column c
        on = st.on_tree[:, None] & (behind >= 0)
        cols = torch.where(on, path.gather(1, behind.clamp(min=0)), plan.ar)
        first = st.seq.gather(1, st.cur[:, None])
        st.seq.scatter_(1, st.cur[:, None], torch.where(
            st.on_tree[:, None], st.cand.gather(1, branch[:, None]), first))
        valid = torch.minimum(W - offset, t_width)           # predictions under committed
        last = (offset + valid - 1).view(B, 1, 1)
        idx = cols[..., None].expand(B, W, V)
        guided, p = guided.gather(1, idx), None if p is None else p.gather(1, idx)
        checked = plan.col < last
        held = done | ((plan.col == off) & (branch > 0).view(B, 1, 1))  # c_j: chosen above
        return Path(guided, p, held, checked, plan.checked, last, branch)

    def next(self, st: JacobiState, guided: Tensor, offset: Tensor, a: Tensor, m: Tensor,
             last: Tensor, branch: Tensor, plan: Plan) -> None:
        """After a correction at `a` the next window is a tree: the candidates for token
        cur + m (before `st.cur` advances).  guided: (B, W, V) the path's logits, a, m, last:
        (B, 1, 1)."""
        B, W, V = guided.shape
        col = (offset.view(B, 1, 1) + m).clamp(max=W - 1)             # predicts token cur + m
        logits = guided.gather(1, col.expand(B, 1, V)).squeeze(1)
        nxt = st.cur[:, None] + m.view(B, 1)
        draft = st.seq.gather(1, nxt).squeeze(1)                      # the window's draft
        known = st.seq.gather(1, (nxt - self.known).clamp(min=0))    # (B, h) tokens before it
        st.cand = candidates(logits, draft, known, self.K)
        stale = (a < last).view(B) | (branch > 0)         # draft cur + m saw a wrong token
        live, nxt = offset < W, nxt.view(B)
        st.on_tree = live & stale & (m.view(B) < W - offset) & (nxt + 1 < plan.T)

    def move(self, model, positions: Tensor, offset: Tensor, branch: Tensor, req: Request,
             rows: Tensor | None) -> None:
        """After verification: the cache slots of each winning branch j > 0 (branch (B,))
        into place (`moves`; positions (B, C), offset (B,) from `forward`)."""
        src, dst = moves(positions[:, 0], offset, branch, self.tree)
        model.move_cached(rows, cfg_rows(src, req), cfg_rows(dst, req))
