"""LlamaGen class-conditional GPT with a per-row KV cache.

Parameter names and shapes are LlamaGen's (docs/FACTS.md §1), so official `c2i_*.pt` state
dicts load strictly.  What differs is the cache: LlamaGen writes one position vector for the whole batch;
here every row has its own positions and every call names the physical cache rows it uses, which
is what the rollout engines' protocol (`rollout/protocol.py`) asks for.

Sequence layout: class token at position 0, image token i at position i + 1; logits at position p
are the distribution of image token p.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from opd.models.args import ModelArgs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dt = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(dt)
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)
        self.ffn_dropout = nn.Dropout(args.ffn_dropout_p)

    def forward(self, x: Tensor) -> Tensor:
        return self.ffn_dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


def rope_2d_table(grid_size: int, head_dim: int, base: float) -> Tensor:
    """(1 + grid², head_dim // 2, 2) float64 (cos, sin).  Half of the rotary pairs encode the
    row, half the column; position 0 (class token) is all zeros, as in LlamaGen."""
    half = head_dim // 2
    freqs = 1.0 / (base ** (torch.arange(0, half, 2, dtype=torch.float64)[: half // 2] / half))
    t = torch.arange(grid_size, dtype=torch.float64)
    freqs = torch.outer(t, freqs)                                       # (G, hd/4)
    grid = torch.cat([freqs[:, None, :].expand(-1, grid_size, -1),      # row
                      freqs[None, :, :].expand(grid_size, -1, -1)], -1)  # column -> (G, G, hd/2)
    table = torch.stack([torch.cos(grid), torch.sin(grid)], -1).flatten(0, 1)
    return torch.cat([torch.zeros(1, half, 2, dtype=torch.float64), table])


def rope_operands(table: Tensor, dtype: torch.dtype) -> Tensor:
    """(L, head_dim // 2, 2) (cos, sin) -> (L, 2, head_dim) of `dtype`: cos repeated over each
    pair, and sin signed (-sin, sin), so that `apply_rope` needs no strided access."""
    cos = table[..., 0].repeat_interleave(2, -1)
    sin = torch.stack([-table[..., 1], table[..., 1]], -1).flatten(-2)
    return torch.stack([cos, sin], 1).to(dtype)


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    """x: (B, S, H, hd); rope: (B, S, 2, hd) from `rope_operands` in x's compute dtype.
    Rotates each pair (x0, x1) to (x0 cos - x1 sin, x1 cos + x0 sin) -- LlamaGen's formula,
    bit for bit (x1 * -sin is exactly -(x1 * sin), and the additions happen in its order)."""
    dt = torch.promote_types(x.dtype, torch.float32)
    xs = x.to(dt)
    swapped = xs.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)             # (x1, x0) per pair
    return (xs * rope[:, :, None, 0] + swapped * rope[:, :, None, 1]).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = args.n_head, args.kv_heads, args.head_dim
        total = (args.n_head + 2 * args.kv_heads) * args.head_dim
        self.wqkv = nn.Linear(args.dim, total, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)
        self.resid_dropout = nn.Dropout(args.resid_dropout_p)
        self.k_cache: Tensor | None = None   # (max_batch, n_kv_head, max_len, head_dim)
        self.v_cache: Tensor | None = None
        self.static = False   # attend over the whole cache (fixed shapes for torch.compile)

    def forward(self, x: Tensor, rope: Tensor, positions: Tensor | None,
                rows: Tensor | None, use_cache: bool, tree: Tensor | None = None) -> Tensor:
        """x: (B, S, D); positions: (B, S) or None for 0..S-1 causal; rows: (B,) or None;
        tree: (B, S, S) bool or None (see GPT.forward_cached)."""
        B, S, _ = x.shape
        hd, kvd = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        q, k, v = self.wqkv(x).split([hd, kvd, kvd], dim=-1)
        q = apply_rope(q.view(B, S, self.n_head, self.head_dim), rope)
        k = apply_rope(k.view(B, S, self.n_kv_head, self.head_dim), rope)
        v = v.view(B, S, self.n_kv_head, self.head_dim)
        q = q.transpose(1, 2)                                           # (B, H, S, hd)
        gqa = self.n_kv_head != self.n_head
        if not use_cache:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            assert self.k_cache is not None, "call setup_cache() before a cached forward"
            kc, vc = self.k_cache, self.v_cache
            slots = positions
            if tree is not None:                     # column s lives in slot start + s
                slots = positions[:, :1] + torch.arange(S, device=x.device)
            length = kc.shape[2] if self.static else int(slots.max()) + 1
            if rows is None:                                            # rows 0..B-1: no gather
                kc[:B].transpose(1, 2)[torch.arange(B, device=x.device)[:, None], slots] = k
                vc[:B].transpose(1, 2)[torch.arange(B, device=x.device)[:, None], slots] = v
                keys, values = kc[:B, :, :length], vc[:B, :, :length]
            else:
                kc[rows[:, None], :, slots] = k                         # (B, S, Hkv, hd) scatter
                vc[rows[:, None], :, slots] = v
                keys, values = kc[rows, :, :length], vc[rows, :, :length]
            key_pos = torch.arange(length, device=x.device)
            if tree is None:
                mask = key_pos[None, None, :] <= positions[:, :, None]           # (B, S, L)
            else:                                    # committed slots, then the tree's columns
                col = key_pos[None, :] - positions[:, :1]                         # (B, L)
                inside = (col >= 0) & (col < S)
                seen = tree.gather(2, col.clamp(0, S - 1)[:, None, :].expand(-1, S, -1))
                mask = (col < 0)[:, None, :] | (inside[:, None, :] & seen)
            mask = mask.unsqueeze(1)                                              # (B,1,S,L)
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
        y = y.transpose(1, 2).reshape(B, S, hd)
        return self.resid_dropout(self.wo(y))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: Tensor, rope: Tensor, positions: Tensor | None, rows: Tensor | None,
                use_cache: bool, tree: Tensor | None = None) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope, positions, rows, use_cache, tree)
        return h + self.feed_forward(self.ffn_norm(h))


class LabelEmbedder(nn.Module):
    """Class embedding with one extra row (index num_classes) for the null class of CFG."""

    def __init__(self, num_classes: int, dim: int, dropout_prob: float):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + 1, dim)
        self.num_classes, self.dropout_prob = num_classes, dropout_prob

    def forward(self, labels: Tensor) -> Tensor:
        if self.training and self.dropout_prob > 0:
            drop = torch.rand(labels.shape, device=labels.device) < self.dropout_prob
            labels = torch.where(drop, torch.full_like(labels, self.num_classes), labels)
        return self.embedding_table(labels)


class GPT(nn.Module):
    """Class-conditional LlamaGen GPT.  Implements `rollout.protocol.RolloutModel`."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        args.validate()
        self.args = args
        self.vocab_size, self.num_classes = args.vocab_size, args.num_classes
        self.grid_size, self.block_size = args.grid_size, args.block_size
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.cls_embedding = LabelEmbedder(args.num_classes, args.dim, args.class_dropout_prob)
        self.tok_dropout = nn.Dropout(args.token_dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self._rope64 = rope_2d_table(args.grid_size, args.head_dim, args.rope_base)
        self._rope: dict[tuple, Tensor] = {}
        self.max_batch = 0
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """LlamaGen init: normal(0, 0.02) linears and embeddings, zero output head."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=std)
        nn.init.zeros_(self.output.weight)

    def _rope_table(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        """`rope_operands` of the table on `device` in the compute dtype (cached)."""
        dt = torch.promote_types(dtype, torch.float32)
        key = (device.type, device.index, dt)
        if key not in self._rope:       # a normal tensor (a rollout's inference mode would
            with torch.inference_mode(False):   # make one that training cannot save)
                self._rope[key] = rope_operands(self._rope64, dt).to(device)
        return self._rope[key]

    def _run(self, h: Tensor, positions: Tensor | None, rows: Tensor | None,
             use_cache: bool, tree: Tensor | None = None) -> Tensor:
        table = self._rope_table(h.device, h.dtype)
        if positions is None:
            rope = table[: h.shape[1]].unsqueeze(0).expand(h.shape[0], -1, -1, -1)
        else:
            rope = table[positions]
        h = self.tok_dropout(h)
        for layer in self.layers:
            h = layer(h, rope, positions, rows, use_cache, tree)
        return self.output(self.norm(h)).float()

    def forward(self, labels: Tensor, tokens: Tensor) -> Tensor:
        """Teacher forcing.  labels: (B,) int64; tokens: (B, T) int64 with T <= block_size.
        Returns logits (B, T + 1, V) float32; logits[:, i] is the distribution of image token i.
        Label dropout (CFG training) applies in train mode only."""
        if tokens.shape[1] > self.block_size:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens exceeds block_size "
                             f"{self.block_size}")
        h = torch.cat([self.cls_embedding(labels).unsqueeze(1), self.tok_embeddings(tokens)], 1)
        return self._run(h, None, None, use_cache=False)

    # ---- rollout protocol -------------------------------------------------------------
    def setup_cache(self, max_batch: int, max_len: int) -> None:
        """KV caches for `max_batch` rows of `max_len` slots (a forward's positions end at
        block_size; slots past it are scratch, e.g. a token tree's branches, see
        `forward_cached`).  Caches that already hold at
        least that many rows and positions in the parameters' dtype and device are kept: a
        cached forward writes every position before any query attends to it, so what an
        earlier call left behind is never read, and rollouts allocate once per worker."""
        p = next(self.parameters())
        kc = self.layers[0].attention.k_cache
        if (kc is not None and kc.dtype == p.dtype and kc.device == p.device
                and kc.shape[0] >= max_batch and kc.shape[2] >= max_len):
            return
        shape = (max_batch, self.args.kv_heads, max_len, self.args.head_dim)
        with torch.inference_mode(False):    # normal tensors, written in place in any mode
            for layer in self.layers:
                layer.attention.k_cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
                layer.attention.v_cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.max_batch = max_batch

    def swap_cache(self, cache: list | None) -> list:
        """Install `cache` (what an earlier swap_cache returned; None: none, so the next
        `setup_cache` makes a fresh one) and return the KV caches it replaces: a caller that
        keeps caches of its own (a teacher scoring several rollout calls span by span,
        opd/distill/span_scoring.py) swaps them in around its forwards."""
        old = [(layer.attention.k_cache, layer.attention.v_cache) for layer in self.layers]
        for layer, (k, v) in zip(self.layers, cache or [(None, None)] * len(self.layers)):
            layer.attention.k_cache, layer.attention.v_cache = k, v
        return old

    def static_cache(self, on: bool) -> None:
        """Cached forwards attend over every cache position (masked past each query) instead
        of up to the batch's last position: one shape per (rows, window), what a compiled
        verifier needs (rollout option compile).  Same values up to float summation order.
        On CUDA the caches are marked static addresses, so CUDA graphs may update them in
        place."""
        for layer in self.layers:
            layer.attention.static = on
            for cache in (layer.attention.k_cache, layer.attention.v_cache):
                if on and cache is not None and cache.is_cuda:
                    torch._dynamo.mark_static_address(cache)

    def prefill(self, labels: Tensor, prefix: Tensor, rows: Tensor | None) -> Tensor:
        """labels: (B,), prefix: (B, P), rows: (B,) or None (rows 0..B-1).
        Returns logits (B, P + 1, V); the last row is the distribution of image token P."""
        B, P = prefix.shape
        h = torch.cat([self.cls_embedding(labels).unsqueeze(1), self.tok_embeddings(prefix)], 1)
        positions = torch.arange(P + 1, device=prefix.device).expand(B, -1)
        return self._run(h, positions, rows, use_cache=True)

    def forward_cached(self, tokens: Tensor, positions: Tensor, rows: Tensor | None,
                       tree: Tensor | None = None) -> Tensor:
        """tokens, positions: (B, S) int64; rows: (B,) or None (rows 0..B-1).
        Returns logits (B, S, V) float32 for the image tokens at indices `positions`.

        tree: (B, S, S) bool or None.  A token tree verified in one forward (candidate
        drafting): column s is rotated at positions[b, s] but cached in slot
        positions[b, 0] + s, and sees the cache slots < positions[b, 0] and the columns t with
        tree[b, s, t] (its ancestors and itself).  A causal tree over consecutive positions is
        the plain forward.  Columns whose slot is not their position are moved into place with
        `move_cached` before a later forward reads them."""
        return self._run(self.tok_embeddings(tokens), positions, rows, use_cache=True,
                         tree=tree)

    def move_cached(self, rows: Tensor | None, src: Tensor, dst: Tensor) -> None:
        """Copy the cached keys/values of slots src (B, C) to slots dst (B, C) of each row
        (rows: (B,) or None for rows 0..B-1); src is read before dst is written."""
        rows = torch.arange(src.shape[0], device=src.device) if rows is None else rows
        for layer in self.layers:
            for c in (layer.attention.k_cache, layer.attention.v_cache):
                c.transpose(1, 2)[rows[:, None], dst] = c.transpose(1, 2)[rows[:, None], src]
