"""The block drafter's head (DFlash, as vLLM's ``DFlashDraftModel``): k drafts in ONE forward.

``BlockHead(target, feature_layers=None, draft_vocab=None, layers=BLOCK_LAYERS,
block_size=BLOCK_SIZE, mask_token=None)`` is a ``DraftHead`` of kind ``"block"``. The context
is the target's features: an fc over several target layers (EAGLE-3's), normed (``hnorm``, vLLM's
``hidden_norm``), projected by each of its ``layers`` decoder layers (Qwen3 layers: q/k norms)
to keys and values at the context positions and cached per row (``step``); the context never
runs through the layers. The block (``block``) is k+1 slots after it: slot 0 the row's last
token (position n-1 of a row of n tokens), slots 1..k the ``mask_token``'s embedding, through the
layers attending to every context key and bidirectionally within the block; slot j's output
predicts the token at its own position (x_{n-1+j}), so slots 1..k give the k drafts. The
embedding and LM head are the target's (shared, not in the state dict; an optional reduced draft
vocabulary ``d2t`` as EAGLE-3's). The k drafts are drawn independently, each from its own q_j
(a distribution given the context), so the rejection sampler keeps the output exact.
``depth_outputs`` is the training forward: a sample of anchors per row, each with its block, in
one pass (a block's queries see the context keys up to its anchor and their own block),
aligned as the EAGLE-3 unroll's depths (depth j at position i predicts x_{i+2}). Details:
docs/internals.md.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from specrl.models.cache import KVCache
from specrl.models.fused import run_layers
from specrl.models.heads import DraftHead
from specrl.models.transformer import AttnContext, Block, Static, Transformer

BLOCK_LAYERS = 2  # decoder layers of a block head (DFlash uses a few)
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
        mask_token: int | None = None,  # the token id whose embedding fills the mask slots
    ) -> None:
        c = target.config
        mask_token = c.vocab_size - 1 if mask_token is None else mask_token
        if not 1 <= layers <= 64:
            raise ValueError(f"a block head has 1 to 64 layers, got {layers}")
        if not 1 <= block_size <= MAX_DRAFT:
            raise ValueError(f"block_size must be in [1, {MAX_DRAFT}], got {block_size}")
        if not 0 <= mask_token < c.vocab_size:
            raise ValueError(
                f"mask_token must be a token id in [0, {c.vocab_size}), got {mask_token}"
            )
        super().__init__(target, "block", feature_layers, draft_vocab, arch="proj")
        del self.block, self.enorm, self.proj  # an EAGLE-3 head's (fc, hnorm, norm stay)
        self.head_config = c.replace(num_layers=layers, qk_norm=True)
        self.layers = nn.ModuleList(Block(self.head_config, i) for i in range(layers))
        self.block_size, self.mask_token = block_size, int(mask_token)
        self.to(device=target.embed.weight.device, dtype=target.embed.weight.dtype)

    def geometry(self) -> dict:
        """Its layer count, block size and mask token (head.json; ``load_head`` rebuilds it)."""
        return {"layers": len(self.layers), "block_size": self.block_size,
                "mask_token": self.mask_token}  # fmt: skip

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

    def context(self, h: torch.Tensor, positions: torch.Tensor):
        """Each layer's context keys and values [B, T, kv_heads, D] from head inputs h [B, T, H]
        (``features_in``) at ``positions`` [B, T] (vLLM's precomputed context K/V)."""
        c = self.hnorm(h)
        cos, sin = self.target.rope(positions, like=self.norm.weight)
        return [blk.attn.project(c, cos, sin)[1:] for blk in self.layers]

    def step(
        self,
        h: torch.Tensor,  # [B, T, H] head inputs (``features_in``) of new context positions
        tokens: torch.Tensor,  # [B, T] unused (the context is features only)
        positions: torch.Tensor,  # [B, T] their positions
        cache: KVCache | None = None,
        rows: torch.Tensor | None = None,  # [B, T] cache slot written by each position
        slots: torch.Tensor | None = None,
        kv_len: int | Static | None = None,
    ) -> torch.Tensor:
        """Write the context's keys and values into every layer's cache at (``rows``,
        ``positions``); returns h (a block head has no per-position output to draft from)."""
        if cache is None or rows is None:
            raise ValueError("a block head's context goes into a cache (cache and rows)")
        for blk, (k, v) in zip(self.layers, self.context(h, positions), strict=True):
            cache.write(blk.attn.layer, rows, positions, k, v)
        return h

    def block(
        self,
        last: torch.Tensor,  # [B, 1] each row's last token
        positions: torch.Tensor,  # [B, k+1] the slots' positions (the last token's first)
        cache: KVCache,
        slots: torch.Tensor | None = None,  # [B] cache slot of each row; None = 0..B-1
        kv_len: int | Static | None = None,
    ) -> torch.Tensor:
        """The block after each row's cached context: g [B, k+1, H] (slot 0 the last token,
        slots 1..k masks), each slot seeing the cache before ``positions[:, 0]`` and every slot
        of its block (a draft tree whose every slot sees every other: ``attn_context``'s
        ``tree``). ``kv_len=STATIC``: a static step (no host read, row b in slot b)."""
        b, width = positions.shape
        ids = torch.cat([last, last.new_full((b, width - 1), self.mask_token)], dim=1)
        x = self.target.embed(ids).to(self.norm.weight.dtype)  # [B, k+1, H]
        every = torch.ones(width, width, dtype=torch.bool, device=positions.device)
        ctx = self.target.attn_context(positions, cache, kv_len, slots=slots, tree=every)
        cos, sin = self.target.rope(positions, like=self.norm.weight)
        return self.run(x, cos, sin, ctx)

    def new_cache(self, slots: int, max_len: int) -> KVCache:
        """A cache of ``slots`` rows over ``max_len`` context positions plus room for a block
        of up to ``MAX_DRAFT`` + 1 slots after the longest context."""
        c, p = self.head_config, self.norm.weight
        size = max_len + max(MAX_DRAFT, self.block_size) + 1
        return KVCache(c.num_layers, slots, c.num_kv_heads, size, c.head_dim, p.dtype, p.device)

    def unroll(self, feats, tokens, steps):  # noqa: D102 - EAGLE-3's unroll does not apply
        raise NotImplementedError("a block head trains through depth_outputs")

    # ------------------------------------------------------------------ training

    def depth_outputs(
        self,
        feats: torch.Tensor,  # [B, T, F] target features at positions 0..T-1
        tokens: torch.Tensor,  # [B, T] token x_{i+1} for each position i
        mask: torch.Tensor,  # [B, T] bool: position i's target x_{i+2} is a loss target
        steps: int,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per block slot j < ``steps``: (g [N_j, H], where [B, T] bool) as ``DraftHead``'s:
        mask slot j+1 of the block anchored at a (context 0..a, slot 0 the token x_{a+1} at
        position a+1) predicts x_{a+j+2}, listed at position a+j. Anchors: up to
        ceil(T / steps) loss positions per row (all of them at ``steps=1``), drawn by a
        generator seeded from the batch's tokens (reproducible)."""
        b, t, _ = feats.shape
        idx, valid = pick_anchors(mask, tokens, math.ceil(t / steps))  # [B, A] each
        a, w = idx.shape[1], steps + 1  # anchors, block width
        pos_c = torch.arange(t, device=feats.device).expand(b, t)  # [B, T]
        pos_b = (idx[:, :, None] + 1 + torch.arange(w, device=feats.device)).reshape(b, a * w)
        first = tokens.gather(1, idx)[:, :, None]  # [B, A, 1] x_{a+1}
        ids = torch.cat([first, first.new_full((b, a, steps), self.mask_token)], 2)
        x = self.target.embed(ids.reshape(b, a * w)).to(self.norm.weight.dtype)  # [B, A*W, H]
        context = self.context(self.features_in(feats), pos_c)
        rope = self.target.rope(pos_b, like=self.norm.weight)
        sees = training_mask(idx, w, t)  # [B, 1, A*W, T + A*W]
        for blk, kv in zip(self.layers, context, strict=True):
            x = _train_layer(blk, x, kv, rope, sees)
        g = x.view(b, a, w, -1)[:, :, 1:]  # [B, A, S, H] the mask slots
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


def training_mask(idx: torch.Tensor, width: int, t: int) -> torch.Tensor:
    """[B, 1, A*W, T + A*W] bool: a slot of the block anchored at a sees the context keys
    p <= a and every slot of its own block (idx [B, A] anchors, W slots per block)."""
    b, a = idx.shape
    dev = idx.device
    anchor = idx.repeat_interleave(width, dim=1)  # [B, A*W]
    sees_ctx = torch.arange(t, device=dev)[None, None, :] <= anchor[:, :, None]  # [B, A*W, T]
    own = torch.arange(a, device=dev).repeat_interleave(width)  # [A*W]
    sees_block = (own[:, None] == own[None, :]).expand(b, -1, -1)  # [B, A*W, A*W]
    return torch.cat([sees_ctx, sees_block], dim=2)[:, None]


def _train_layer(blk: Block, x, context, rope, sees) -> torch.Tensor:
    """One decoder layer over the blocks x [B, A*W, H], attending to the context's keys and
    values ``context`` ([B, T, kv_heads, D] each) and their own: the new x."""
    attn = blk.attn
    q, k, v = (y.transpose(1, 2) for y in attn.project(blk.attn_norm(x), *rope))
    keys = torch.cat([context[0].transpose(1, 2), k], 2)  # [B, kv_heads, T + A*W, D]
    values = torch.cat([context[1].transpose(1, 2), v], 2)
    out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=sees,
                                                           enable_gqa=True)  # fmt: skip
    b, n = x.shape[:2]
    x = x + attn.o(out.transpose(1, 2).reshape(b, n, -1))
    return x + blk.mlp(blk.mlp_norm(x))
