"""One Jacobi round for a batch of images at different positions, fully vectorised.

Per image b (B images; `cur[b]` committed tokens; T = P + N):

    seq[b, :cur]          committed tokens
    seq[b, cur:cur+W-1]   the current drafts (seq is T + W wide; past T is scratch)
    logp[b, :cur]         behaviour log-prob of each committed token (prefix: unused), the
                          log-prob under the aligned target p (rollout.sampling.token_logprob)
    q[b, i]               (sample mode) the distribution draft cur + i was drawn from

A round feeds the window [token cur-1, drafts] at positions cur .. cur+W-1 (image token j sits
at position j + 1).  Near the end the window is clipped: a row whose window would pass token
T - 1 starts earlier instead (start = T - W) and re-feeds committed tokens, so every forward
has the fixed shape (B, W); only predictions of tokens < T are used.  W is at most N - 1.

After verification (rollout/verify.py) `m` tokens are committed (`a` accepted drafts plus the
replacement / bonus token; the batch minimum for Batch-Synchronous SJD).  The next drafts are
this round's predictions after the committed point, and the rest of the window is filled from
history.  Greedy: the argmax.  Sampled, refresh="resample": a fresh sample from this round's
prediction p, q = p.  Sampled, refresh="coupled" (MC-SJD's maximal coupling): a draft x that was
never verified (index > a) and was drawn from q_old is kept with probability
min(1, p(x) / q_old(x)), else replaced by a sample of norm(max(0, p - q_old)); the result is
distributed exactly as p, so q = p as before, but it mostly stays the token the drafts after it
were predicted from, and the window converges like greedy Jacobi instead of being redrawn.
Drafts at indices <= a (verified, or the batch-minimum's uncommitted accepts) are resampled.
History filling: token j gets the token H positions earlier,
following the chain j - H, j - 2H, ... back to a defined token (committed or predicted); H = 1
copies the left neighbour.  Where the chain leaves the sequence the last defined token is used.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from rollout.candidates import Tree, candidates, choose_path, make_tree
from rollout.engine import Request
from rollout.sampling import (STREAM_ACCEPT, STREAM_COUPLE, STREAM_DRAFT, STREAM_TOKEN,
                              sample_from, token_logprob, uniform, warp)
from rollout.verify import residual, verify_greedy, verify_sample


@dataclass
class Plan:
    """Constants of one generate call, built once so a round allocates no index tensors."""
    T: int               # P + N
    W: int               # window (<= N - 1)
    H: int               # history offset
    sync: bool           # commit the batch minimum (Batch-Synchronous SJD)
    coupled: bool        # sampled drafts refreshed by maximal coupling (else resampled)
    ar: Tensor           # (W,) 0..W-1
    fill: Tensor         # (F,) 0..F-1 with F = max(W - 1, 1): offsets of history-filled drafts
    fill_mod: Tensor     # (F,) fill % H
    streams: Tensor      # (4, 1, 1) the streams of a round's uniforms: token, accept, draft,
    #                      couple
    tree: Tree | None = None  # candidate drafting's window layout (rollout/candidates.py)


def make_plan(T: int, W: int, H: int, sync: bool, device: torch.device,
              coupled: bool = True, candidates: int = 0, branch: int | None = None) -> Plan:
    """candidates: K >= 2 turns on candidate drafting (greedy, not sync), branch: columns of
    each branch j > 0 (None: 1)."""
    ar = torch.arange(W, device=device)
    fill = torch.arange(max(W - 1, 1), device=device)
    streams = torch.tensor([STREAM_TOKEN, STREAM_ACCEPT, STREAM_DRAFT, STREAM_COUPLE],
                           device=device)
    tree = make_tree(W, candidates, device, branch or 1)
    return Plan(T, W, H, sync, coupled, ar, fill, fill % H, streams.view(4, 1, 1), tree)


@dataclass
class JacobiState:
    seq: Tensor          # (B, T + W) int64 committed tokens, then drafts; past T scratch
    cur: Tensor          # (B,) int64 committed length
    rounds: Tensor       # (B,) int64 rounds taken so far (= attempt number of the next round)
    key: Tensor          # (B,) int64 RNG key of each image (sampling.image_key)
    q: Tensor | None     # (B, W - 1, V) proposal of each draft (sample mode), else None
    logp: Tensor | None = None  # (B, T + W) float32 behaviour log-probs of the committed
    #                             tokens, laid out like seq (None: not recorded)
    cand: Tensor | None = None  # (B, K) int64 candidates for token cur (plan.tree)
    on_tree: Tensor | None = None  # (B,) bool the next window is a tree (plan.tree)

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


def fill_history(seq: Tensor, defined: Tensor, stop: Tensor, plan: Plan) -> None:
    """In place: for j in [defined, stop) (at most F tokens per row) set seq[b, j] =
    seq[b, j - k*H] with the smallest k that lands below `defined`, i.e.
    defined - H + (j - defined) % H, or seq[b, defined - 1] when that is negative."""
    j = defined[:, None] + plan.fill                                       # (B, F)
    src = (defined - plan.H)[:, None] + plan.fill_mod
    src = torch.where(src < 0, (defined - 1)[:, None], src)
    src = torch.where(j < stop[:, None], src, j)                           # others: unchanged
    seq.scatter_(1, j, seq.gather(1, src))


def one_hot(tokens: Tensor, V: int, dtype: torch.dtype) -> Tensor:
    """(...) int64 -> (..., V) one-hot of `dtype`."""
    out = torch.zeros(*tokens.shape, V, dtype=dtype, device=tokens.device)
    return out.scatter_(-1, tokens.unsqueeze(-1), 1.0)


def init_state(req: Request, images: Tensor, first: Tensor, plan: Plan, V: int,
               first_logp: Tensor | None = None) -> JacobiState:
    """State of images `images` after their round 0 (prefill chose token P, with behaviour
    log-prob `first_logp`; None records no log-probs): cur = P + 1, drafts from history."""
    B, P, T, W = images.shape[0], req.prefix_len, req.total, plan.W
    seq = torch.zeros(B, T + W, dtype=torch.long, device=first.device)
    seq[:, :P] = req.prefix[images]
    seq[:, P] = first
    cur = torch.full((B,), P + 1, dtype=torch.long, device=first.device)
    fill_history(seq, cur, cur + W - 1, plan)
    q = None
    if req.sampled:
        q = one_hot(seq[:, P + 1: P + W], V, torch.float32)
    logp = None
    if first_logp is not None:
        logp = torch.zeros(B, T + W, dtype=torch.float32, device=first.device)
        logp[:, P] = first_logp
    cand = on_tree = None
    if plan.tree is not None:
        cand = torch.zeros(B, plan.tree.K, dtype=torch.long, device=first.device)
        on_tree = torch.zeros(B, dtype=torch.bool, device=first.device)
    return JacobiState(seq, cur, torch.ones_like(cur), req.keys[images], q, logp, cand, on_tree)


def window_inputs(st: JacobiState, plan: Plan) -> tuple[Tensor, Tensor, Tensor]:
    """-> tokens (B, W) int64, positions (B, W) int64, offset (B,) int64: window index of the
    prediction of token cur (offset > 0 only for clipped windows, = W for finished rows).
    With candidate drafting `candidates.tree_window` appends the branches."""
    start = st.cur.clamp(max=plan.T - plan.W)                             # >= P + 1 >= 1
    positions = start[:, None] + plan.ar
    return st.seq.gather(1, positions - 1), positions, st.cur - start


def commit_count(accepted: Tensor, live: Tensor, sync: bool) -> Tensor:
    """Tokens to commit per row: accepted + 1 (the batch minimum when sync); 0 if finished."""
    m = accepted + 1
    if sync:
        m = torch.where(live, m, torch.iinfo(m.dtype).max).amin().expand_as(m)
    return m * live


def refresh_drafts(p: Tensor, drafts: Tensor, q: Tensor, accepted: Tensor, u_draft: Tensor,
                   u_couple: Tensor, plan: Plan) -> Tensor:
    """New drafts for every aligned index, each distributed exactly as p[:, i] (so q = p).

    p: (B, W, V) aligned predictions, drafts / q: (B, W - 1) / (B, W - 1, V) this round's
    drafts and their proposals, accepted: (B,), u_draft / u_couple: (B, W) float64.
    Resample: sample_from(p, u_draft).  Coupled: index i > accepted with a stale draft x keeps x
    if u_couple * q(x) < p(x) (probability min(1, p(x) / q(x))), else samples the residual
    norm(max(0, p - q)) -- maximal coupling of q and p."""
    if not plan.coupled:
        return sample_from(p, u_draft)
    S = drafts.shape[1]
    stale = plan.ar[:S] > accepted[:, None]                               # (B, S) never verified
    dist = p.clone()
    dist[:, :S] = torch.where(stale[..., None], residual(p[:, :S], q), p[:, :S])
    dist[:, :S] = torch.where(dist[:, :S].sum(-1, keepdim=True) > 0, dist[:, :S], p[:, :S])
    new = sample_from(dist, u_draft)
    p_x = p[:, :S].gather(2, drafts[..., None]).squeeze(2).double()
    q_x = q.gather(2, drafts[..., None]).squeeze(2).double()
    keep = stale & (u_couple[:, :S] * q_x < p_x)
    new[:, :S] = torch.where(keep, drafts, new[:, :S])
    return new


def jacobi_update(st: JacobiState, guided: Tensor, offset: Tensor, req: Request,
                  plan: Plan) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Verify this round's window and advance `st` in place.

    guided: (B, W, V) guided logits of the window forward ((B, C, V) with candidates: the
    tree's branches after the window); offset from `window_inputs`.
    Returns committed (B,), accepted (B,) and rejected (B,) int64 counts of the round, and with
    candidate drafting the branch (B,) each row's tree window took (else None)."""
    W, ar = plan.W, plan.ar
    width = (plan.T - st.cur).clamp_(min=0, max=W)                       # valid predictions
    pos = st.cur[:, None] + ar                                            # tokens cur + i
    idx = (offset[:, None] + ar).clamp_(max=W - 1)                        # aligned index
    branch = None
    if plan.tree is not None:                 # verify along the branch the root chose
        branch, path, t_width = choose_path(guided, offset, st.cand, st.on_tree, plan.tree)
        idx = torch.where(st.on_tree[:, None], path, idx)
        valid = torch.minimum(width, t_width)                 # predictions under committed
        first = st.seq.gather(1, st.cur[:, None])            # the winning c_j is draft cur
        st.seq.scatter_(1, st.cur[:, None], torch.where(st.on_tree[:, None],
                                                        st.cand.gather(1, branch[:, None]), first))
    else:
        valid = width
    live, n_drafts = width > 0, valid - 1
    drafts = st.seq.gather(1, pos[:, :-1])                                # (B, W - 1)
    V = guided.shape[-1]
    if req.sampled or st.logp is not None:
        p = warp(guided, req.temperature, req.top_k, req.top_p)
        p = p.gather(1, idx[..., None].expand(-1, -1, V))                 # (B, W, V) aligned
    if not req.sampled:
        pred = guided.argmax(-1).gather(1, idx)                           # (B, W)
        accepted = verify_greedy(pred, drafts, n_drafts)
        m = commit_count(accepted, live, plan.sync)
        content = pred        # committed = argmax[:m] (= accepted drafts), then reused argmax
    else:
        u = uniform(st.key[:, None], pos, st.rounds[:, None], plan.streams)   # (4, B, W)
        accepted, token = verify_sample(p, drafts, st.q, n_drafts, u[1, :, :-1], u[0])
        m = commit_count(accepted, live, plan.sync)
        fresh = refresh_drafts(p, drafts, st.q, accepted, u[2], u[3], plan)  # (B, W) ~ p
        committed = torch.where(ar < accepted[:, None], torch.cat([drafts, token[:, None]], 1),
                                token[:, None])
        content = torch.where(ar < m[:, None], committed, fresh)
    st.seq.scatter_(1, pos, content)
    if st.logp is not None:      # right for the committed ar < m; the rest is rewritten later
        st.logp.scatter_(1, pos, token_logprob(p, content))
    fill_history(st.seq, st.cur + width, st.cur + m + (W - 1), plan)
    if req.sampled:
        nxt = m[:, None] + ar[:-1]                                        # aligned index
        q_pred = p.gather(1, nxt.clamp(max=W - 1)[..., None].expand(-1, -1, V))
        q_fill = one_hot(st.seq.gather(1, st.cur[:, None] + nxt), V, p.dtype)
        st.q = torch.where((nxt < width[:, None])[..., None], q_pred, q_fill)
    took = torch.minimum(accepted, m)
    rejected = ((accepted < m) & (accepted < n_drafts)).long()
    if plan.tree is not None:                 # a correction at cur + a: candidates for a + 1
        nxt = idx.gather(1, m.clamp(max=W - 1)[:, None])                  # (B, 1) column
        logits = guided.gather(1, nxt[..., None].expand(-1, -1, V)).squeeze(1)
        draft = st.seq.gather(1, (st.cur + m)[:, None]).squeeze(1)       # the window's draft
        above = st.seq.gather(1, (st.cur + m - plan.H).clamp(min=0)[:, None]).squeeze(1)
        st.cand = candidates(logits, draft, above, plan.tree.K)
        stale = (accepted < n_drafts) | (branch > 0)          # draft cur + m saw a wrong token
        st.on_tree = live & stale & (m < width) & (st.cur + m + 1 < plan.T)
    st.cur += m
    st.rounds += live
    return m, took, rejected, branch
