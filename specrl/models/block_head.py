"""The block drafter's head (DFlash-style parallel drafting): k draft tokens in ONE forward.

``BlockHead(target, feature_layers=None, draft_vocab=None, layers=BLOCK_LAYERS,
block_size=BLOCK_SIZE)`` is a ``DraftHead`` of kind ``"block"``: the same input layer as an
EAGLE-3 head (an fc over several target layers' features, then ``proj`` of the normed feature
h_i and the embedding of x_{i+1}) feeds ``layers`` decoder layers, causally over the context
(``step``: the row's cached keys, as EAGLE-3's head keeps them), and a block of k mask positions
after it (``block``: a learned mask vector at RoPE positions n-1 .. n+k-2 for a row of n
tokens) that attends to every context key and bidirectionally within the block, giving
g [B, k, H] whose slot j predicts x_{n+j}. The embedding and LM head are the target's (shared,
not in the state dict; an optional reduced draft vocabulary ``d2t`` as EAGLE-3's). The k drafts
of a block are drawn independently, each from its own q_j (a distribution given the context), so
the rejection sampler keeps the output exact. ``depth_outputs`` is the training forward: a
sample of anchors per row, each with its k-slot block, in one pass (context causal; a block's
queries see the context keys up to its anchor and their own block), aligned as the EAGLE-3
unroll's depths (depth j at position i predicts x_{i+2}). Details: docs/internals.md.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from specrl.models.cache import KVCache
from specrl.models.fused import run_layers
from specrl.models.heads import DraftHead, _qkv
from specrl.models.transformer import AttnContext, Block, Static, Transformer

BLOCK_LAYERS = 2  # decoder layers of a block head (DFlash uses a few; 2 is measured here)
BLOCK_SIZE = 8  # draft positions a block head trains for (the k it is built to draft)
MAX_DRAFT = 16  # the most drafts one block may hold (rollout.num_spec_tokens' bound)


class BlockHead(DraftHead):
    """A block drafter over a frozen target (see the module docstring)."""

    def __init__(
        self,
        target: Transformer,
        feature_layers: tuple[int, ...] | None = None,
        draft_vocab: torch.Tensor | None = None,  # [Vd] sorted target ids; None = full vocab
        layers: int = BLOCK_LAYERS,
        block_size: int = BLOCK_SIZE,
    ) -> None:
        if not 1 <= layers <= 64:
            raise ValueError(f"a block head has 1 to 64 layers, got {layers}")
        if not 1 <= block_size <= MAX_DRAFT:
            raise ValueError(f"block_size must be in [1, {MAX_DRAFT}], got {block_size}")
        super().__init__(target, "block", feature_layers, draft_vocab, arch="proj")
        c = target.config
        del self.block  # the EAGLE-3 head's one layer; a block head has ``layers`` of its own
        self.head_config = c.replace(num_layers=layers)
        self.layers = nn.ModuleList(Block(self.head_config, i) for i in range(layers))
        self.mask_embed = nn.Parameter(torch.randn(c.hidden_size) * 0.02)  # [H]
        self.block_size = block_size
        self.to(device=target.embed.weight.device, dtype=target.embed.weight.dtype)

    def geometry(self) -> dict:
        """Its layer count and block size (head.json; ``load_head`` rebuilds it from them)."""
        return {"layers": len(self.layers), "block_size": self.block_size}

    # ------------------------------------------------------------------ drafting

    def run(self, x: torch.Tensor, cos, sin, ctx: AttnContext) -> torch.Tensor:
        """The head's layers over x [B, T, H] (one native call where that applies): g [B, T, H]
        (x itself when the native call wrote it there)."""
        native = self.target.native_layers
        if native and run_layers(self.layers, self.norm, self.head_config, x, cos, sin, ctx):
            return x  # the stack's output, left in its input
        for blk in self.layers:
            x = blk(x, cos, sin, ctx)
        return x

    def layer(self, h, tokens, cos, sin, ctx: AttnContext) -> torch.Tensor:
        """The context stream: ``layers`` decoder layers over the head inputs -> g [B, T, H]."""
        return self.run(self.inputs(h, tokens), cos, sin, ctx)

    def block(
        self,
        positions: torch.Tensor,  # [B, k] RoPE and cache positions of the block's slots
        cache: KVCache,
        slots: torch.Tensor | None = None,  # [B] cache slot of each row; None = 0..B-1
        kv_len: int | Static | None = None,
    ) -> torch.Tensor:
        """The block after each row's cached context: g [B, k, H]; slot j at ``positions[:, j]``
        (the row's history length - 1 + j) sees the cache before ``positions[:, 0]`` and every
        slot of its block. ``kv_len=STATIC``: a static step (no host read, row b in slot b)."""
        b, k = positions.shape
        ctx = block_context(positions, cache, slots, kv_len)
        cos, sin = self.target.rope(positions, like=self.norm.weight)
        x = self.mask_embed.expand(b, k, -1).contiguous()
        return self.run(x, cos, sin, ctx)

    def new_cache(self, slots: int, max_len: int) -> KVCache:
        """A cache of ``slots`` rows over ``max_len`` context positions plus room for a block
        of up to ``MAX_DRAFT`` slots after the longest context."""
        c, p = self.head_config, self.norm.weight
        size = max_len + max(MAX_DRAFT, self.block_size)
        return KVCache(c.num_layers, slots, c.num_kv_heads, size, c.head_dim, p.dtype, p.device)

    # ------------------------------------------------------------------ training

    def depth_outputs(
        self,
        feats: torch.Tensor,  # [B, T, F] target features at positions 0..T-1
        tokens: torch.Tensor,  # [B, T] token x_{i+1} for each position i
        mask: torch.Tensor,  # [B, T] bool: position i's next-next token is a loss target
        steps: int,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per block slot j < ``steps``: (g [N_j, H], where [B, T] bool) as ``DraftHead``'s:
        slot j of the block whose context ends at anchor a predicts x_{a+j+2}, listed at
        position a+j. Anchors: up to ceil(T / steps) loss positions per row (all of them at
        ``steps=1``), drawn by a generator seeded from the batch's tokens (reproducible)."""
        b, t, _ = feats.shape
        idx, valid = pick_anchors(mask, tokens, math.ceil(t / steps))  # [B, A] each
        a = idx.shape[1]
        offsets = torch.arange(steps, device=feats.device)
        pos_c = torch.arange(t, device=feats.device).expand(b, t)  # [B, T]
        pos_b = (idx[:, :, None] + 1 + offsets).reshape(b, a * steps)  # [B, A*S]
        x_c = self.inputs(self.features_in(feats), tokens)  # [B, T, H]
        x_b = self.mask_embed.expand(b, a * steps, -1)  # [B, A*S, H]
        rope_c = self.target.rope(pos_c, like=self.norm.weight)
        rope_b = self.target.rope(pos_b, like=self.norm.weight)
        mask_c, mask_b = training_masks(idx, steps, t)
        for blk in self.layers:
            x_c, x_b = _train_layer(blk, x_c, x_b, rope_c, rope_b, mask_c, mask_b)
        g = x_b.view(b, a, steps, -1)  # [B, A, S, H]
        out = []
        for j in range(steps):
            at = idx + j  # [B, A]
            ok = valid & (at < t)
            ok = ok & mask.gather(1, at.clamp(max=t - 1))
            where = torch.zeros_like(mask)
            where[torch.arange(b, device=mask.device)[:, None].expand_as(at)[ok], at[ok]] = True
            out.append((g[:, :, j][ok], where))
        return out


def pick_anchors(
    mask: torch.Tensor, tokens: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``count`` distinct anchor positions per row among ``mask``'s [B, T] True ones,
    sorted: indices [B, A] int64 and which are real [B, A] bool (A = min(count, T)); drawn by a
    generator seeded from ``tokens``' sum, so a batch always gets the same anchors."""
    b, t = mask.shape
    a = min(count, t)
    g = torch.Generator().manual_seed(int(tokens.sum()) % (2**63 - 1))
    noise = torch.rand(b, t, generator=g).to(mask.device)
    score = noise + mask.float() * 2.0  # loss positions first, in random order
    idx = score.topk(a, dim=1).indices.sort(dim=1).values  # [B, A]
    return idx, mask.gather(1, idx)


def training_masks(idx: torch.Tensor, steps: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention masks of ``depth_outputs``: the context's causal [T, T] and the blocks'
    [B, 1, A*S, T + A*S] (a slot of anchor a sees context keys p <= a and its own block)."""
    b, a = idx.shape
    dev = idx.device
    causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
    p = torch.arange(t, device=dev)
    anchor = idx.repeat_interleave(steps, dim=1)  # [B, A*S]
    sees_ctx = p[None, None, :] <= anchor[:, :, None]  # [B, A*S, T]
    own = torch.arange(a, device=dev).repeat_interleave(steps)  # [A*S]
    sees_block = (own[:, None] == own[None, :]).expand(b, -1, -1)  # [B, A*S, A*S]
    return causal, torch.cat([sees_ctx, sees_block], dim=2)[:, None]


def _train_layer(blk: Block, x_c, x_b, rope_c, rope_b, mask_c, mask_b):
    """One decoder layer over the context x_c [B, T, H] (causal) and the blocks x_b
    [B, A*S, H] (over the context's keys and their own): the new (x_c, x_b)."""
    attn = blk.attn
    q_c, k_c, v_c = _qkv(attn, blk.attn_norm(x_c), *rope_c)  # [B, heads, T, D]
    q_b, k_b, v_b = _qkv(attn, blk.attn_norm(x_b), *rope_b)  # [B, heads, A*S, D]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    a_c = sdpa(q_c, k_c, v_c, attn_mask=mask_c, enable_gqa=True)
    keys, values = torch.cat([k_c, k_b], 2), torch.cat([v_c, v_b], 2)
    a_b = sdpa(q_b, keys, values, attn_mask=mask_b, enable_gqa=True)
    outs = []
    for x, att in ((x_c, a_c), (x_b, a_b)):
        b, n = x.shape[:2]
        x = x + attn.o(att.transpose(1, 2).reshape(b, n, -1))
        outs.append(x + blk.mlp(blk.mlp_norm(x)))
    return outs[0], outs[1]


def block_context(
    positions: torch.Tensor,  # [B, k] the slots' positions (consecutive per row)
    cache: KVCache,
    slots: torch.Tensor | None,
    kv_len: int | Static | None,
) -> AttnContext:
    """The block's attention context: each slot stored at its position in its row's slot and
    seeing the keys before the block's first position and every key of the block (built on the
    device; a static step reads the whole cache, rows 0..B-1 in slots 0..B-1)."""
    b, k = positions.shape
    static = isinstance(kv_len, Static)
    if static:
        length = kv_len.length or cache.max_len
    else:
        length = kv_len if kv_len is not None else int(positions.max()) + 1
    keys = torch.arange(length, device=positions.device)
    rel = keys[None, :] - positions[:, :1]  # [B, L] key position relative to slot 0
    mask = (rel < k)[:, None, :].expand(b, k, length)  # [B, k, L]
    rows = torch.arange(b, device=positions.device) if slots is None or static else slots
    rows = rows[:, None].expand(b, k)
    return AttnContext(positions, mask[:, None], cache, rows, length,
                       slots=None if static else slots, store=positions,
                       static=static)  # fmt: skip
