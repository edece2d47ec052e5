"""One Jacobi round for a batch of images at different positions, fully vectorised.

Per image b (B images; `cur[b]` committed tokens; T = P + N):

    seq[b, :cur]          committed tokens
    seq[b, cur:cur+W-1]   the current drafts (seq is T + W wide; past T is scratch)
    logp[b, :cur]         behaviour log-prob of each committed token (prefix: unused), the
                          log-prob under the target p of its position
                          (rollout.sampling.token_logprob)
    q[b, c]               (decoding "speculative") the distribution the token of the next
                          window's column c was drawn from (one-hot for a token filled from
                          history)

A round feeds the window [token start - 1, ..., token start + W - 2] at positions start ..
start + W - 1 (image token j sits at position j + 1): start = cur, the last committed token and
W - 1 drafts.  Near the end the window is clipped: a row whose window would pass token T - 1
starts earlier instead (start = T - W) and re-feeds committed tokens (offset = cur - start > 0),
so every forward has the fixed shape (B, W); a finished row (cur = T) has offset W.  W is at
most N - 1.

Verification (rollout/verify.py) runs in window columns: column c predicts token start + c.
`m` tokens are committed (the accepted drafts plus the replacement / bonus token; the batch
minimum for Batch-Synchronous SJD, rollout/baselines/sjd_sync.py).  The round's tokens after
them are the next drafts: the argmax (greedy), the argmax of the column's perturbed scores
(decoding "sample": the keyed Gumbel-max rule, rollout/sampling.py `perturb`, verified as
greedy drafts are, so every committed token is the one Cached AR commits), or tokens
distributed exactly as this round's p, so q = p (decoding "speculative": redrawn, or kept by
maximal coupling, see rollout/verify.py).  Every column is written back in one scatter, the
columns committed before the round to scratch slots past T.  Then the W - 1 tokens after the
window are filled from history: token j gets the token H positions earlier, following the chain
j - H, j - 2H, ... back into the window or the committed tokens; H = 1 copies the left
neighbour.  Where the chain leaves the sequence the window's last token is used.  (Filled
tokens past the next window are never read before a later round writes them again.)

After the forward a round is `jacobi_update`: `verify` (the call's decoding picks
`verify_argmax` or `verify_speculative`) -> `commit_count` -> `commit` (write back, fill from
history, advance).  What a call varies is chosen once, in its `Plan`: the update (a baseline
brings its own, rollout/baselines/) and the window kind (`Plan.drafting`: `PlainWindow`, or
candidate drafting's plug-in, rollout/candidates.py), which the round calls at its seams.
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor

from rollout.engine import Request, cfg_rows, choose_token
from rollout.jacobi_state import Drafting, JacobiState, Path, Plan
from rollout.sampling import (STREAM_ACCEPT, STREAM_COUPLE, STREAM_DRAFT, STREAM_TOKEN,
                              guide, perturb, uniform, warp)
from rollout.verify import verify_greedy, verify_sample


def make_plan(T: int, W: int, H: int, device: torch.device, coupled: bool = True,
              drafting: Drafting | None = None, vocab_size: int | None = None,
              scratch_len: int | None = None) -> Plan:
    """drafting: the window kind (None: `PlainWindow`; candidate drafting:
    rollout/candidates.py `candidate_tree`); vocab_size: V (speculative decoding builds it when
    None); scratch_len: the state's slots past T (None: W; a call whose window changes between
    rounds sizes its state for the largest, `rewindow`)."""
    ar = torch.arange(W, device=device)
    col = ar[:, None]
    fill = torch.arange(max(W - 1, 1), device=device)[:, None]
    streams = torch.tensor([STREAM_ACCEPT, STREAM_COUPLE, STREAM_TOKEN, STREAM_DRAFT],
                           device=device).view(4, 1, 1, 1)
    vocab = None if vocab_size is None else torch.arange(vocab_size, device=device)
    return Plan(T, W, H, jacobi_update, coupled, ar, col, scratch=T + col, checked=col < W - 1,
                fill=fill, fill_src=fill % H - H, q_cols=col.clamp(max=max(W - 2, 0)),
                streams=streams, drafting=drafting or PlainWindow(), vocab=vocab,
                scratch_len=max(W, scratch_len or W))


class PlainWindow:
    """The window kind without candidate drafting (`jacobi_state.Drafting`): a round verifies
    the W columns of `window_inputs` as they are; nothing to carry, choose or move."""

    def fresh(self, B: int, device: torch.device) -> tuple[None, None]:
        return None, None

    def rewound(self, on_tree: None) -> None:
        return on_tree

    def forward(self, model, st: JacobiState, tokens: Tensor, positions: Tensor,
                offset: Tensor, req: Request, rows: Tensor | None,
                plan: Plan) -> tuple[Tensor, Tensor]:
        """-> logits (2B or B, W, V) of the windows tokens, positions (B, W), and positions."""
        logits = model.forward_cached(cfg_rows(tokens, req), cfg_rows(positions, req), rows)
        return logits, positions

    def path(self, st: JacobiState, guided: Tensor, p: Tensor | None, u: Tensor | None,
             offset: Tensor, off: Tensor, done: Tensor, plan: Plan) -> Path:
        """The window itself: the drafts of columns 0..W-2 checked, none committed before."""
        return Path(guided, p, done, plan.checked, None, plan.W - 1, None)

    def next(self, st: JacobiState, guided: Tensor, offset: Tensor, a: Tensor, m: Tensor,
             last: int, branch: None, plan: Plan) -> None:
        pass

    def move(self, model, positions: Tensor, offset: Tensor, branch: None, req: Request,
             rows: Tensor | None) -> None:
        pass


def fill_history(seq: Tensor, defined: Tensor, plan: Plan) -> Tensor:
    """In place: for the F tokens j = defined .. defined + F - 1 of each row set seq[b, j] =
    seq[b, j - k*H] with the smallest k that lands below `defined`, i.e.
    defined - H + (j - defined) % H, or seq[b, defined - 1] when that is negative.
    seq: (B, T + W, 1) (a view of JacobiState.seq), defined: (B, 1, 1) -> the filled tokens
    (B, F, 1)."""
    src = defined + plan.fill_src                                       # (B, F, 1)
    src = torch.where(src < 0, defined - 1, src)
    filled = seq.gather(1, src)
    seq.scatter_(1, defined + plan.fill, filled)
    return filled


def one_hot(tokens: Tensor, V: int, dtype: torch.dtype) -> Tensor:
    """(...) int64 -> (..., V) one-hot of `dtype`."""
    out = torch.zeros(*tokens.shape, V, dtype=dtype, device=tokens.device)
    return out.scatter_(-1, tokens.unsqueeze(-1), 1.0)


def init_state(req: Request, images: Tensor, plan: Plan, V: int) -> JacobiState:
    """State of images `images` before their first round: cur = P (the prefix), the drafts of
    tokens P .. P + W - 2 filled from history (`fill_history`; token 0 without a prefix).  Their
    first round is the prefill's forward (rollout/rounds.py `prefill_round`)."""
    B, P, T, W, dev = images.shape[0], req.prefix_len, req.total, plan.W, req.labels.device
    seq = torch.zeros(B, T + plan.scratch_len, dtype=torch.long, device=dev)
    seq[:, :P] = req.prefix[images]
    cur = torch.full((B,), P, dtype=torch.long, device=dev)
    if P:                           # without a prefix the drafts are token 0
        fill_history(seq.unsqueeze(2), cur.view(B, 1, 1), plan)
    q = None
    if req.speculative:             # the first window starts at cur (W <= N - 1)
        q = one_hot(seq[:, P: P + W], V, torch.float32)
    logp = torch.zeros(B, T + plan.scratch_len, dtype=torch.float32, device=dev)
    cand, on_tree = plan.drafting.fresh(B, dev)
    return JacobiState(seq, cur, torch.zeros_like(cur), req.keys[images], q, logp, cand, on_tree)


def rewindow(st: JacobiState, old: Plan, new: Plan) -> JacobiState:
    """The state of a round of window new.W after rounds of window old.W (W "auto"): a new
    JacobiState with its own q (and on_tree where it changes), sharing st's other tensors; st
    itself is left as it was (with compile it is a held buffer of old.W's shapes,
    `static_states.StaticStates`, which a later hold of those shapes copies into).  Sampled: column c
    of the new window holds token start' + c (start' = cur.clamp(max=T - new.W)); where that
    token was a column of the old window's layout its proposal is kept, else (a token past the
    old drafts: filled from history or left from an earlier round, a function of the past
    either way) the proposal is one-hot at the token itself, with which speculative sampling
    is exact whatever the token (the draft is accepted with probability p(token), else the
    residual is p without it).  Candidate drafting: a window without a tree (W = 1) leaves no
    tree for the next one.  After rounds of W = 1 (`ar_round`: no drafts, no history
    fill, no proposals kept) the new window's drafts are filled from history first, in place
    (tokens cur .. cur + W' - 2: st's seq past cur, which no round has read since), each with
    a one-hot proposal."""
    q, on_tree, B = st.q, st.on_tree, st.cur.shape[0]
    after_ar = old.W == 1 < new.W
    if after_ar:
        fill_history(st.seq.unsqueeze(2), st.cur.view(B, 1, 1), new)
    if q is not None:               # decoding "speculative"
        start = st.cur.clamp(max=old.T - old.W)
        start_new = st.cur.clamp(max=new.T - new.W)
        col = (start_new - start)[:, None] + new.ar                      # (B, W') old column
        kept = (col >= 0) & (col < old.W) & (not after_ar)
        tokens = st.seq.gather(1, start_new[:, None] + new.ar)
        V = q.shape[-1]
        moved = q.gather(1, col.clamp(0, old.W - 1)[..., None].expand(B, new.W, V))
        q = torch.where(kept[..., None], moved, one_hot(tokens, V, q.dtype))
    return replace(st, q=q, on_tree=new.drafting.rewound(on_tree))


def window_inputs(st: JacobiState, plan: Plan) -> tuple[Tensor, Tensor, Tensor]:
    """-> tokens (B, W) int64, positions (B, W) int64, offset (B,) int64: window index of the
    prediction of token cur (offset > 0 only for clipped windows, = W for finished rows).
    With candidate drafting the window kind's `forward` appends the branches
    (`candidates.tree_window`)."""
    start = st.cur.clamp(max=plan.T - plan.W)                 # >= P + 1 >= 1 after the first
    positions = start[:, None] + plan.ar
    return st.seq.gather(1, positions - 1), positions, st.cur - start


def commit_count(a: Tensor, offset: Tensor, W: int) -> Tensor:
    """a, offset: (B, 1, 1) (rollout/verify.py) -> tokens to commit per row (B, 1, 1): the
    accepted drafts and one more, a + 1 - offset; 0 for a finished row (a = offset = W)."""
    return (a + 1).clamp(max=W) - offset


def next_proposals(p: Tensor, filled: Tensor, start: Tensor, cur: Tensor,
                   plan: Plan) -> Tensor:
    """q of the next window: its column c holds token start' + c (start' = its first token),
    which this round held in column start' + c - start < W, a draft distributed as p there,
    or filled from history after the window (one-hot).  p: (B, W, V), filled: (B, F, 1)
    `fill_history`'s tokens, start: (B, 1, 1), cur: (B,) advanced -> (B, W, V)."""
    B, W, V = p.shape
    vocab = plan.vocab if plan.vocab is not None else torch.arange(V, device=p.device)
    shift = cur.clamp(max=plan.T - W).view(B, 1, 1) - start             # in [0, W]
    pool = torch.cat([p, filled == vocab], 1)                           # (B, W + F, V)
    return pool.gather(1, (shift + plan.q_cols).expand(B, W, V))


class Window(NamedTuple):
    """Where a round's windows sit (`verify`)."""
    seq: Tensor             # (B, T + scratch_len, 1) int64 a view of the state's seq
    start: Tensor           # (B, 1, 1) int64 the window's first token
    pos: Tensor             # (B, W, 1) int64 the token each column predicts
    offset: Tensor          # (B,) int64 the first column not committed before (`window_inputs`)
    off: Tensor             # (B, 1, 1) the same
    done: Tensor            # (B, W, 1) bool the columns committed before the round


class Verified(NamedTuple):
    """A round's windows after verification (`verify`), before anything is committed."""
    w: Window
    tokens: Tensor          # (B, W, 1) int64 the round's tokens: the accepted drafts, the token
    #                         at a, the next drafts after it
    a: Tensor               # (B, 1, 1) int64 the first column neither committed before nor
    #                         accepted (rollout/verify.py)
    last: Tensor | int      # the first column not checked: W - 1, or (B, 1, 1) on a tree path
    p: Tensor               # (B, W, V) the columns' distributions
    u: Tensor | None        # (4, B, W, 1) the round's uniforms (decoding "speculative")
    guided: Tensor          # (B, W, V) the logits verified (perturbed with decoding "sample")
    branch: Tensor | None   # (B,) int64 the branch each row's tree window took (candidates)


def jacobi_update(st: JacobiState, guided: Tensor, positions: Tensor, offset: Tensor,
                  req: Request, plan: Plan) -> tuple[Tensor, Tensor | None]:
    """A round's verification step, every row on its own: `verify` the windows, then `commit`
    the accepted drafts and one more token of each row (`commit_count`), in place.

    guided: (B, W, V) guided logits of the window forward ((B, C, V) with candidates: the
    tree's branches after the window); positions: (B, W) (or (B, C)) int64 the index of the
    token each column predicts (its position, `window_inputs`; the noise key of decoding
    "sample"); offset from `window_inputs`.
    Returns counts (3, B) int64 -- tokens committed, drafts accepted and drafts rejected (0 or
    1) by each row this round -- and with candidate drafting the branch (B,) each row's tree
    window took (else None)."""
    v = verify(st, guided, positions, offset, req, plan)
    m = commit_count(v.a, v.w.off, plan.W)                            # (B, 1, 1)
    accepted, rejected = commit(st, v, m, req, plan)
    return torch.stack([m, accepted, rejected.long()]).view(3, -1), v.branch


def verify(st: JacobiState, guided: Tensor, positions: Tensor, offset: Tensor, req: Request,
           plan: Plan) -> Verified:
    """Verify every window of the round (rollout/verify.py; arguments as `jacobi_update`'s) by
    the call's decoding: `verify_speculative`, else `verify_argmax` (greedy and "sample").
    `st` is left as it was, but for a tree window's chosen candidate, written as draft cur."""
    B = st.cur.shape[0]
    off = offset.view(B, 1, 1)
    start = (st.cur - offset).view(B, 1, 1)                           # the window's first token
    window = Window(st.seq.unsqueeze(2), start, start + plan.col, offset, off, plan.col < off)
    rule = verify_speculative if req.speculative else verify_argmax
    return rule(st, guided, positions, window, req, plan)


def verify_argmax(st: JacobiState, guided: Tensor, positions: Tensor, w: Window, req: Request,
                  plan: Plan) -> Verified:
    """Greedy: a draft is accepted while it equals the argmax of its column.  Decoding "sample":
    the same on the keyed perturbed scores (rollout/sampling.py `perturb`), whose argmax is the
    token Cached AR commits.  The window kind's seam (`plan.drafting.path`): the window itself,
    or with candidate drafting the tree window along the branch the root column chose."""
    B = st.cur.shape[0]
    if req.perturbed:       # from here on verified as greedy, on the perturbed scores
        guided, p = perturb(guided, st.key.view(B, 1, 1), positions[..., None],
                            req.temperature, req.top_k, req.top_p)    # (B, W or C, V)
    else:                   # the behaviour log-probs' distribution
        p = warp(guided, req.temperature, req.top_k, req.top_p)       # (B, W or C, V)
    path = plan.drafting.path(st, guided, p, None, w.offset, w.off, w.done, plan)
    tokens = path.guided.argmax(-1, keepdim=True)                     # (B, W, 1)
    a = verify_greedy(tokens, w.seq.gather(1, w.pos), path.held, path.checked)
    return Verified(w, tokens, a, path.last, path.p, None, path.guided, path.branch)


def verify_speculative(st: JacobiState, guided: Tensor, positions: Tensor, w: Window,
                       req: Request, plan: Plan) -> Verified:
    """Decoding "speculative": speculative sampling of every window with the round's keyed
    uniforms, and the next drafts refreshed (`plan.coupled`; rollout/verify.py
    `verify_sample`).  On a tree path the drafts past its valid predictions are coupled too."""
    B = st.cur.shape[0]
    u = uniform(st.key.view(B, 1, 1), w.pos, st.rounds.view(B, 1, 1), plan.streams)
    p = warp(guided, req.temperature, req.top_k, req.top_p)           # (B, W or C, V)
    path = plan.drafting.path(st, guided, p, u, w.offset, w.off, w.done, plan)
    a, tokens = verify_sample(path.p, w.seq.gather(1, w.pos), st.q, path.held, path.checked, u,
                              plan.col, plan.coupled, path.drafted)
    return Verified(w, tokens, a, path.last, path.p, u, path.guided, path.branch)


def commit(st: JacobiState, v: Verified, m: Tensor, req: Request,
           plan: Plan) -> tuple[Tensor, Tensor]:
    """Commit m (B, 1, 1) tokens of each row of the verified round v, in place: every column's
    token written back in one scatter (the columns committed before to scratch past T) with its
    behaviour log-prob, the W - 1 tokens after the window filled from history, cur and the
    round counter advanced, and the next window's proposals (decoding "speculative") and
    candidates (`plan.drafting.next`: candidate drafting's).  -> accepted (B, 1, 1)
    int64 drafts and rejected (B, 1, 1) bool (finished rows: 0, False)."""
    B, W, w = st.cur.shape[0], plan.W, v.w
    write = torch.where(w.done, plan.scratch, w.pos)  # committed before: to scratch past T
    w.seq.scatter_(1, write, v.tokens)
    # the log-probs: right for the committed columns; the rest is rewritten later
    st.logp.unsqueeze(2).scatter_(1, write, v.p.gather(2, v.tokens).log())   # token_logprob
    filled = fill_history(w.seq, w.start + W, plan)
    plan.drafting.next(st, v.guided, w.offset, v.a, m, v.last, v.branch, plan)
    st.cur += m.view(B)
    st.rounds += 1                # (a finished row's count is never used again)
    if req.speculative:
        st.q = next_proposals(v.p, filled, w.start, st.cur, plan)
    return v.a - w.off, v.a < v.last


def ar_round(model, st: JacobiState, req: Request, plan: Plan, rows: Tensor | None) -> Tensor:
    """A round of window 1 (no drafts) as Cached AR's step on the Jacobi state: token cur of
    every live row from a 1-token forward (cache rows `rows`, None = all), committed in place
    -> counts (3, B) int64 (1 / 0 committed, nothing accepted or rejected).

    Its tokens and log-probs are the ones `jacobi_update` commits at W = 1 (the argmax, the
    keyed Gumbel-max token, or the sample keyed by (image, token, round) on the token stream:
    verify_sample's token at a = 0),
    without the verification step; what it skips is the history fill after the window and the
    next proposals, which no round of W = 1 reads (a wider window after it fills its drafts,
    `rewindow`).  A finished row (cur = T) re-predicts token T - 1 into scratch slot T."""
    live = st.cur < plan.T
    j = st.cur.clamp(max=plan.T - 1)                               # the token predicted
    x = st.seq.gather(1, (j - 1)[:, None])                         # fed at position j
    logits = model.forward_cached(cfg_rows(x, req), cfg_rows(j[:, None], req), rows)[:, 0]
    return ar_commit(st, logits, live, j, req, plan)


def ar_commit(st: JacobiState, logits: Tensor, live: Tensor, j: Tensor, req: Request,
              plan: Plan) -> Tensor:
    """`ar_round`'s step after its forward (and a prefill round's at W = 1): token j (B,) of
    every `live` (B,) row chosen from its logits (2B or B, V), committed in place -> counts."""
    token, logp = choose_token(guide(logits, req.cfg_scale), req, j, st.rounds, st.key)
    write = torch.where(live, j, plan.T)[:, None]
    st.seq.scatter_(1, write, token[:, None])
    st.logp.scatter_(1, write, logp[:, None])
    st.cur += live
    st.rounds += 1
    committed = live.long()
    return torch.stack([committed, torch.zeros_like(committed), torch.zeros_like(committed)])
