"""Llama/Qwen-family decoder in plain PyTorch.

``Transformer(config)`` maps token ids at explicit positions to logits, optionally through a
``KVCache`` (row b uses slot b), returning chosen layers' hidden states (EAGLE-3 / MTP), reading
a draft tree in one forward, over packed rows (``segments``: ``packed_attention``), or as a
static, capturable step (``kv_len=STATIC``). Hugging
Face weight semantics, stored fused (qkv, gate_up); ``checkpoint_layers`` recomputes decoder
blocks in backward. No sampling, no RL.
Details: docs/internals.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from specrl.kernels import gemv
from specrl.models.attention import grouped_attention, grouped_sdpa, sdpa
from specrl.models.cache import KVCache
from specrl.models.config import ModelConfig
from specrl.models.fused import run_layers
from specrl.models.linear import Linear
from specrl.models.moe import MoE, Routing
from specrl.models.packed_attention import PackedAttention, PackedMask, use_flex
from specrl.models.rope import rope_inv_freq, rotate_half


@dataclass(frozen=True)
class Static:
    """``kv_len`` of a static step (``specrl.models.graphs``): every row reads the first
    ``length`` positions of its slot's cache (None: all of them) under a mask built on the
    device, so nothing is read on the host and the shapes are the key's."""

    length: int | None = None


STATIC = Static()  # a static step over the whole cache


def set_native_elementwise(model: nn.Module, enabled: bool) -> None:
    """Turn only the native per-token kernels (norms, SwiGLU, RoPE) on or off in ``model``."""
    for m in model.modules():
        if isinstance(m, (RMSNorm, MLP)):
            m.native = enabled
        if isinstance(m, Attention):
            m.native_rope = enabled


def set_native_kernels(model: nn.Module, enabled: bool) -> None:
    """Turn the native kernels (products, attention, norms, SwiGLU, RoPE) on or off for every
    ``Linear``, ``Attention``, ``RMSNorm``, ``MLP`` and ``MoE`` in ``model`` (for A/B runs)."""
    set_native_elementwise(model, enabled)
    for m in model.modules():
        if isinstance(m, (Linear, Attention, MoE)):
            m.native = enabled


def native_elementwise(enabled: bool, *xs: torch.Tensor) -> gemv.GemvKernel | None:
    """The native kernel for per-token work on inputs ``xs``, or None: not ``enabled`` (the
    module's switch) or not ``gemv.native_bf16`` work."""
    return gemv.native_bf16(*xs) if enabled else None


class RMSNorm(nn.Module):
    """RMSNorm; in bf16 inference one native call (``add_norm`` also fuses the residual add)."""

    native: bool = True

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = native_elementwise(self.native, x, self.weight)
        if kernel is not None:
            return kernel.rmsnorm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm) for a residual stream x [..., H] and a branch output delta."""
        kernel = native_elementwise(self.native, x, delta, self.weight)
        if kernel is not None:
            return kernel.rmsnorm(x, self.weight, self.eps, delta=delta)
        x = x + delta
        return x, self(x)


class Attention(nn.Module):
    """Self-attention with fused q/k/v; reading a bf16 cache it uses the native attention kernel
    (``native``, see ``set_native_kernels``) where that runs, else ``grouped_attention``; in bf16
    inference RoPE is one native call (``native_rope``)."""

    native: bool = True
    native_rope: bool = True

    def __init__(self, c: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.c = layer, c
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.qkv = Linear(c.hidden_size, q + 2 * kv, bias=c.attention_bias)
        self.o = Linear(q, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def project(
        self,
        x: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,  # [B, T, 1, head_dim]
        sin: torch.Tensor,  # [B, T, 1, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, T, heads, D], k and v [B, T, kv_heads, D]; q/k normed (Qwen3) and rotated
        (q and k in one go: the same elementwise ops, fewer of them)."""
        c = self.c
        b, t, _ = x.shape
        heads = (c.num_heads, c.num_kv_heads)
        qk, v = self.qkv(x).split([sum(heads) * c.head_dim, c.num_kv_heads * c.head_dim], dim=-1)
        qk = qk.view(b, t, sum(heads), c.head_dim)
        v = v.view(b, t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = qk.split(heads, dim=2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        cos, sin = cos.to(qk.dtype), sin.to(qk.dtype)  # no-ops when rope() made them in it
        kernel = native_elementwise(self.native_rope, qk, cos)
        if kernel is not None and c.head_dim % 32 == 0:
            q, k = kernel.rope(qk, cos, sin).split(heads, dim=2)
        else:
            q, k = (qk * cos + rotate_half(qk) * sin).split(heads, dim=2)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,  # [B, T, 1, head_dim]
        sin: torch.Tensor,  # [B, T, 1, head_dim]
        ctx: AttnContext,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        if ctx.cache is not None:
            ctx.cache.write(self.layer, *ctx.write_index(), k, v)
        if ctx.packed is not None:  # packed rows through flex attention
            out = ctx.packed.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            return self.o(out.transpose(1, 2).reshape(b, t, -1))
        reads = ctx.cache is not None and ctx.read_cache
        native = reads and not ctx.static
        out = self._attend_native(q, ctx) if native else None  # [B, T, heads, head_dim]
        if out is None:
            if reads:
                keys, values = ctx.cache.read(self.layer, b, ctx.kv_len, ctx.slots)
            else:
                keys, values = k.transpose(1, 2), v.transpose(1, 2)
            attend = grouped_attention if ctx.read_cache and q.dtype != torch.float32 else sdpa
            attend = grouped_sdpa if ctx.static else attend
            out = attend(q.transpose(1, 2), keys, values, ctx.mask).transpose(1, 2)
        return self.o(out.reshape(b, t, -1))

    def _attend_native(self, q: torch.Tensor, ctx: AttnContext) -> torch.Tensor | None:
        """q [B, T, heads, D] over the cache with the native kernel -> [B, T, heads, D]; None
        where it does not apply (turned off, not built here, not bf16, head_dim). Causal reads
        see the keys at positions <= the query's (below kv_len); a draft tree's, its mask."""
        kernel = gemv.gemv_kernel() if self.native else None
        cache = ctx.cache
        if kernel is None or not kernel.attention_fits(q, cache.k):
            return None
        slots, lens, mask = ctx.visible_keys()
        return kernel.attention(q, cache.k[self.layer], cache.v[self.layer], slots, lens, mask)


class MLP(nn.Module):
    """SwiGLU; in bf16 inference silu(gate) * up is one native call."""

    native: bool = True

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_up = Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down = Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        kernel = native_elementwise(self.native, gate_up)
        if kernel is not None:
            return self.down(kernel.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """A pre-norm decoder layer: attention, then a dense SwiGLU or (``config.is_moe_layer``) a
    mixture of experts, which reads the forward's ``ctx.routing``."""

    def __init__(self, c: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attn = Attention(c, layer)
        self.mlp_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.moe = c.is_moe_layer(layer)
        self.mlp = MoE(c, c.moe_layers.index(layer)) if self.moe else MLP(c)

    def forward(self, x, cos, sin, ctx: AttnContext) -> torch.Tensor:
        x, h = self.mlp_norm.add_norm(x, self.attn(self.attn_norm(x), cos, sin, ctx))
        return x + (self.mlp(h, ctx.routing, not ctx.static) if self.moe else self.mlp(h))


@dataclass
class AttnContext:
    """What attention needs besides activations: cache, slots, positions, mask."""

    positions: torch.Tensor  # [B, T]
    mask: torch.Tensor | None  # [B, 1, T, kv_len] bool, True = attend; None = every key
    cache: KVCache | None = None
    rows: torch.Tensor | None = None  # [B, T] cache slot of each token
    kv_len: int = 0
    read_cache: bool = True  # False: prefill, attend only within the new tokens
    slots: torch.Tensor | None = None  # [B] slots read (None: slots 0..B-1, a view)
    store: torch.Tensor | None = None  # [B, T] cache position of each token (None: positions)
    packed: PackedMask | None = None  # packed rows via flex attention (no cache; mask None)
    static: bool = False  # a static step: the whole cache through SDPA, no host reads
    routing: Routing | None = None  # MoE layers' routing record / replay (``models.moe``)
    _visible: tuple | None = field(default=None, repr=False)  # visible_keys(), once per forward
    _written: tuple | None = field(default=None, repr=False)  # write_index(), once per forward

    def write_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each token's keys/values go, built once for all layers: slots [N] and cache
        positions [N] int64 (N = B * T tokens in row order)."""
        if self._written is None:
            at = self.positions if self.store is None else self.store
            rows, at = torch.broadcast_tensors(self.rows, at)
            self._written = (rows.reshape(-1).to(torch.int64).contiguous(),
                             at.reshape(-1).to(torch.int64).contiguous())  # fmt: skip
        return self._written

    def visible_keys(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The native attention kernel's view of which cached keys each query sees, built once
        for all layers: slots [B] int64, lens [B, T] int32 (keys j < lens considered) and a
        draft tree's mask [B, T, kv_len] uint8 (None for causal reads: positions <= the
        query's, below kv_len)."""
        if self._visible is None:
            b, t = self.positions.shape
            if self.store is None:
                lens, mask = (self.positions + 1).clamp(max=self.kv_len), None
            else:
                lens = torch.full((b, t), self.kv_len)
                mask = self.mask[:, 0].to(torch.uint8).contiguous()  # [B, T, kv_len]
            slots = _rows(self.slots, b, self.positions.device).to(torch.int64).contiguous()
            self._visible = (slots, lens.to(torch.int32).contiguous(), mask)
        return self._visible


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [B, T', V]
    hidden: torch.Tensor  # [B, T, H] final (normed) hidden state
    captured: list[torch.Tensor]  # outputs of the requested layers, each [B, T, H]


class Transformer(nn.Module):
    """Decoder-only LM. ``forward`` returns logits; ``hidden_states`` stops before the LM head.
    Forwards that read the cache in bf16 run all layers in one native call
    (``specrl.models.fused``; ``native_layers = False`` runs the modules one by one).
    ``packed_attention`` picks the attention of packed, cache-free forwards: 'auto' (flex
    attention on CUDA, the dense mask elsewhere), 'flex' or 'dense'. ``checkpoint_layers``
    recomputes each block in backward (forwards under autograd only): less activation memory
    for about one more forward of compute."""

    native_layers: bool = True
    packed_attention: str = "auto"
    checkpoint_layers: bool = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.flex = PackedAttention()  # compiled flex attention, per model

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def rope(
        self, positions: torch.Tensor, like: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, T, 1, head_dim] for integer positions [B, T], computed in float32 and
        rounded once to the dtype of ``like`` (default: this model's weights), which attention
        would round them to anyway; under autocast they stay float32 (rounded per use)."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [B, T, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)  # [B, T, 1, head_dim]
        weights = self.embed.weight if like is None else like
        kind = positions.device.type  # "meta" (shape checks) has no autocast state
        autocast = kind != "meta" and torch.is_autocast_enabled(kind)
        dtype = torch.float32 if autocast else weights.dtype
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def attn_context(
        self,
        positions: torch.Tensor,  # [B, T]
        cache: KVCache | None,
        kv_len: int | Static | None,
        segments: torch.Tensor | None = None,  # [B, T] packed-sequence ids (no cache)
        slots: torch.Tensor | None = None,  # [B] cache slot of each row; None = 0..B-1
        prefill: bool = False,
        tree: torch.Tensor | None = None,  # [T, T] bool ancestor-or-self mask (cache only)
        parents: torch.Tensor | None = None,  # [B, T] segment a token also sees; -2 = none
    ) -> AttnContext:
        b, t = positions.shape
        packed = cache is None and segments is not None
        if packed and use_flex(self.packed_attention, positions.device, self.config.head_dim):
            return AttnContext(positions, None, packed=self.flex.mask(segments, parents))
        if cache is None or prefill:
            mask = positions[:, None, :] <= positions[:, :, None]  # [B, T, T] key <= query
            mask = mask & torch.ones(t, t, dtype=torch.bool, device=positions.device).tril()
            if segments is not None:
                same = segments[:, None, :] == segments[:, :, None]  # [B, T, T]
                if parents is not None:  # a shared prompt earlier in the row
                    same = same | (segments[:, None, :] == parents[:, :, None])
                mask = mask & same
            if cache is None:
                return AttnContext(positions=positions, mask=mask[:, None])
            rows = _rows(slots, b, positions.device)[:, None].expand(b, t)
            return AttnContext(positions, mask[:, None], cache, rows, t, read_cache=False)
        if tree is not None:
            return self._tree_context(positions, cache, kv_len, slots, tree)
        if isinstance(kv_len, Static):
            return _static_context(positions, cache, kv_len.length or cache.max_len)
        if kv_len is None:
            kv_len = int(positions.max()) + 1
        rows = _rows(slots, b, positions.device)[:, None].expand(b, t)
        return AttnContext(
            positions, cache_mask(positions, kv_len), cache, rows, kv_len, slots=slots
        )

    @staticmethod
    def _tree_context(
        positions: torch.Tensor,  # [B, T] RoPE positions
        cache: KVCache,
        kv_len: int | Static | None,
        slots: torch.Tensor | None,
        tree: torch.Tensor,  # [T, T] bool: tree[i, j] = token j is token i or its ancestor
    ) -> AttnContext:
        """Token i of row b is stored at cache position ``positions[b, 0] + i`` and attends to
        everything cached before the first token plus its ancestors (and itself) in ``tree``.
        ``kv_len=STATIC``: a static step (rows 0..B-1 in slots 0..B-1 over the whole cache,
        the mask built on the device)."""
        b, t = positions.shape
        start = positions[:, :1]  # [B, 1] cache position of the first (root) token
        store = start + torch.arange(t, device=positions.device)[None, :]  # [B, T]
        static = isinstance(kv_len, Static)
        if static:
            kv_len, slots = kv_len.length or cache.max_len, None
        elif kv_len is None:
            kv_len = int(store.max()) + 1
        keys = torch.arange(kv_len, device=positions.device)
        rel = keys[None, :] - start  # [B, kv_len] key index relative to the root
        inside = (rel >= 0) & (rel < t)  # [B, kv_len]
        in_tree = tree[:, rel.clamp(0, t - 1)].permute(1, 0, 2) & inside[:, None, :]
        mask = (rel < 0)[:, None, :] | in_tree  # [B, T, kv_len]
        rows = _rows(slots, b, positions.device)[:, None].expand(b, t)
        return AttnContext(positions, mask[:, None], cache, rows, kv_len, slots=slots, store=store,
                           static=static)  # fmt: skip

    def hidden_states(
        self,
        ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        cache: KVCache | None = None,
        kv_len: int | Static | None = None,
        capture: tuple[int, ...] = (),
        segments: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
        prefill: bool = False,
        tree: torch.Tensor | None = None,
        parents: torch.Tensor | None = None,
        routing: Routing | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final normed hidden [B, T, H] and the outputs of layers in ``capture``.

        Without a cache, ``segments`` ([B, T] ids) packs sequences into rows: a token attends to
        earlier tokens of its own segment, and (``parents``, [B, T]) to those of the segment its
        parent id names (a prompt shared by several completions placed after it in the row).

        With a cache, row b writes its keys/values into slot ``slots[b]`` (default b) at its
        positions and attends to that slot's positions <= its own; with ``prefill`` it attends
        only within the given tokens (no cache read). ``kv_len=STATIC``: a static step
        (``specrl.models.graphs``): rows 0..B-1 read their slots' whole cache through SDPA under
        a mask built on the device, no host read of device data. With ``tree`` ([T, T]
        ancestor-or-self, a draft tree) the T tokens are stored at consecutive cache positions from
        ``positions[:, 0]`` while RoPE uses ``positions`` (a token's depth), and each token
        attends to the cache before the root and to its ancestors only. ``routing``
        (``models.moe.Routing``): the MoE layers record their experts into it or replay its.
        """
        ctx = self.attn_context(positions, cache, kv_len, segments, slots, prefill, tree, parents)
        ctx.routing = routing
        cos, sin = self.rope(positions)
        x = self.embed(ids)
        if self.native_layers:  # the whole stack in one native call, where that applies
            fused = run_layers(self.layers, self.norm, self.config, x, cos, sin, ctx, capture)
            if fused is not None:
                return fused
        captured = []
        recompute = self.checkpoint_layers and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            if recompute:
                x = checkpoint(layer, x, cos, sin, ctx, use_reentrant=False)
            else:
                x = layer(x, cos, sin, ctx)
            if i in capture:
                captured.append(x)
        return self.norm(x), captured

    def forward(
        self,
        ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        cache: KVCache | None = None,
        kv_len: int | Static | None = None,
        logits_at: torch.Tensor | None = None,  # [B, T'] indices into T; None = all
        capture: tuple[int, ...] = (),
        slots: torch.Tensor | None = None,  # [B] cache slot of each row; None = 0..B-1
        prefill: bool = False,  # write the cache, attend only within ids
        tree: torch.Tensor | None = None,  # [T, T] draft tree (see ``hidden_states``)
        routing: Routing | None = None,  # MoE routing record / replay (``models.moe``)
    ) -> ForwardOutput:
        h, captured = self.hidden_states(
            ids, positions, cache, kv_len, capture, slots=slots, prefill=prefill, tree=tree,
            routing=routing,
        )  # fmt: skip
        sel = h if logits_at is None else h.gather(1, _expand_idx(logits_at, h.shape[-1]))
        return ForwardOutput(self.lm_head(sel), h, captured)

    def new_cache(self, slots: int, max_len: int) -> KVCache:
        c, p = self.config, self.embed.weight
        return KVCache(c.num_layers, slots, c.num_kv_heads, max_len, c.head_dim, p.dtype, p.device)


def _static_context(positions: torch.Tensor, cache: KVCache, length: int) -> AttnContext:
    """A static step's context: rows 0..B-1 read the first ``length`` positions of their slots'
    cache through SDPA, each query the keys at positions <= its own; built on the device from
    ``positions`` [B, T] (no host read: shapes come from the inputs and ``length``)."""
    b, t = positions.shape
    keys = torch.arange(length, device=positions.device)
    mask = (keys[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, length]
    rows = torch.arange(b, device=positions.device)[:, None].expand(b, t)
    return AttnContext(positions, mask, cache, rows, length, static=True)


def cache_mask(positions: torch.Tensor, kv_len: int) -> torch.Tensor | None:
    """[B, 1, T, kv_len] bool: cached key position <= query position (positions [B, T]); None
    when that is every key (a single query at position kv_len - 1: batch-1 decoding)."""
    if positions.numel() == 1 and int(positions) == kv_len - 1:
        return None
    keys = torch.arange(kv_len, device=positions.device)
    return (keys[None, None, :] <= positions[:, :, None])[:, None]


def layer_prefix_model(model: Transformer, num_layers: int) -> Transformer:
    """A smaller model made of ``model``'s embedding, first ``num_layers`` layers, norm and head.

    Weights are copied, so the result can be trained without touching ``model``.
    """
    import copy

    if not 1 <= num_layers <= model.config.num_layers:
        raise ValueError(f"num_layers must be in [1, {model.config.num_layers}], got {num_layers}")
    small = Transformer(model.config.replace(num_layers=num_layers)).to(model.embed.weight.dtype)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("layers.")}
    for i in range(num_layers):
        prefix = f"layers.{i}."
        state |= {k: v for k, v in model.state_dict().items() if k.startswith(prefix)}
    small.load_state_dict(copy.deepcopy(state), strict=False)
    small.tie_weights()
    return small.eval().requires_grad_(model.embed.weight.requires_grad)


def _rows(slots: torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor:
    return torch.arange(batch, device=device) if slots is None else slots


def _expand_idx(idx: torch.Tensor, dim: int) -> torch.Tensor:
    return idx.unsqueeze(-1).expand(*idx.shape, dim)
