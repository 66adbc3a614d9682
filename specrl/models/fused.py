"""A bf16 model's whole decoder stack in one native call, for forwards that read the KV cache.

``run_layers(blocks, final_norm, config, x, cos, sin, ctx, capture)`` returns what
``Transformer.hidden_states`` returns for a stack of decoder blocks and its final norm from ONE
``GemvKernel.layers`` call, bit for bit what the modules compute, or None where that path does
not apply (a switch off, no kernel, autograd, not bf16, no cache read, layer features the
kernels do not take, MoE layers among them, weights not packed yet) and the caller runs the
modules. It reads the modules through the protocols below (what ``models.transformer``'s
``Block``, ``RMSNorm`` and ``AttnContext`` offer), so that it imports nothing of the model that
calls it.
Details, and why: docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from specrl.kernels import gemv
from specrl.models.cache import KVCache
from specrl.models.config import ModelConfig


class Norm(Protocol):
    """An RMSNorm: its weight and its native switch."""

    weight: torch.Tensor
    native: bool


class Packed(Protocol):
    """A linear layer with a native packed copy of its weight (``models.linear.Linear``)."""

    def native_weight(self) -> torch.Tensor | None: ...


class Attention(Protocol):
    native: bool
    native_rope: bool
    qkv: Packed
    o: Packed


class Mlp(Protocol):
    native: bool
    gate_up: Packed
    down: Packed


class Layer(Protocol):
    """A pre-norm decoder block."""

    attn_norm: Norm
    attn: Attention
    mlp_norm: Norm
    mlp: Mlp


class Context(Protocol):
    """A forward's attention context: the cache and which of its keys each query sees."""

    cache: KVCache | None
    read_cache: bool
    static: bool

    def write_index(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def visible_keys(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...


def run_layers(
    blocks: Sequence[Layer],
    final_norm: Norm,
    c: ModelConfig,
    x: torch.Tensor,  # [B, T, H] bf16, the residual stream into the first block (updated)
    cos: torch.Tensor,  # [B, T, 1, head_dim]
    sin: torch.Tensor,  # [B, T, 1, head_dim]
    ctx: Context,
    capture: tuple[int, ...] = (),
) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """``blocks`` then ``final_norm`` in one call: (normed [B, T, H], captured layer outputs),
    or None (see the module docstring)."""
    kernel = _kernel(c, final_norm, x, cos, ctx)
    if kernel is None:
        return None
    b, t, hd = x.shape
    table = (gemv.LayerPtrs * len(blocks))()
    captured = []
    for i, layer in enumerate(blocks):
        weights = _layer_weights(layer)
        if weights is None:
            return None
        cap = torch.empty(b, t, hd, dtype=x.dtype) if i in capture else None
        if cap is not None:
            captured.append(cap)
        table[i] = gemv.LayerPtrs(
            *weights,
            ctx.cache.k[i].data_ptr(),
            ctx.cache.v[i].data_ptr(),
            None if cap is None else cap.data_ptr(),
        )
    cache, d = ctx.cache, c.head_dim
    h = torch.empty_like(x)
    dims = (b, t, hd, c.num_heads, c.num_kv_heads, d, c.intermediate_size, cache.slots,
            cache.max_len)  # fmt: skip
    flat = (b * t, d)
    kernel.layers(
        table, final_norm.weight, x, h, cos.expand(b, t, 1, d).reshape(flat).contiguous(),
        sin.expand(b, t, 1, d).reshape(flat).contiguous(), ctx.write_index(),
        ctx.visible_keys(), dims, c.rms_norm_eps,
    )  # fmt: skip
    return h, captured


def _kernel(
    c: ModelConfig, final_norm: Norm, x: torch.Tensor, cos: torch.Tensor, ctx: Context
) -> gemv.GemvKernel | None:
    """The kernel when the one-call path applies to this stack and forward (see module)."""
    if ctx.cache is None or not ctx.read_cache or ctx.static or not x.is_contiguous():
        return None
    if c.is_moe or c.qk_norm or c.attention_bias or c.head_dim % 32 or c.head_dim > 256:
        return None
    kernel = gemv.native_bf16(x, cos, ctx.cache.k, final_norm.weight)
    return kernel if kernel is not None and final_norm.native else None


def _layer_weights(layer: Layer) -> tuple[int, ...] | None:
    """attn_norm, qkv, o, mlp_norm, gate_up, down pointers, or None (a switch off, a bias, a
    weight not packed for its current value, a norm weight not bf16)."""
    attn, mlp = layer.attn, layer.mlp
    norms = (layer.attn_norm, layer.mlp_norm)
    if not (attn.native and attn.native_rope and mlp.native and all(n.native for n in norms)):
        return None
    if any(n.weight.dtype != torch.bfloat16 or not n.weight.is_contiguous() for n in norms):
        return None
    packed = [m.native_weight() for m in (attn.qkv, attn.o, mlp.gate_up, mlp.down)]
    if any(p is None for p in packed):
        return None
    qkv, o, gate_up, down = (p.data_ptr() for p in packed)
    return (layer.attn_norm.weight.data_ptr(), qkv, o, layer.mlp_norm.weight.data_ptr(), gate_up,
            down)  # fmt: skip
