"""A bf16 model's whole decoder stack in one native call, for forwards that read the KV cache.

``native_layers(model, x, cos, sin, ctx, capture)`` returns what ``Transformer.hidden_states``
returns from ONE ``GemvKernel.layers`` call, bit for bit what the modules compute, or None where
that path does not apply (a switch off, no kernel, autograd, not bf16, no cache read, layer
features the kernels do not take, weights not packed yet) and the caller runs the modules.
``run_layers`` is the same for any stack of ``Block``s. Details, and why: docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specrl.kernels import gemv

if TYPE_CHECKING:
    from specrl.models.config import ModelConfig
    from specrl.models.transformer import AttnContext, Block, RMSNorm, Transformer


def native_layers(
    model: Transformer,
    x: torch.Tensor,  # [B, T, H] bf16 embeddings (updated in place: the residual stream)
    cos: torch.Tensor,  # [B, T, 1, head_dim]
    sin: torch.Tensor,  # [B, T, 1, head_dim]
    ctx: AttnContext,
    capture: tuple[int, ...],
) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """(final normed hidden [B, T, H], captured layer outputs) in one call, or None."""
    if not model.native_layers:
        return None
    return run_layers(model.layers, model.norm, model.config, x, cos, sin, ctx, capture)


def run_layers(
    blocks: Sequence[Block],
    final_norm: RMSNorm,
    c: ModelConfig,
    x: torch.Tensor,  # [B, T, H] bf16, the residual stream into the first block (updated)
    cos: torch.Tensor,  # [B, T, 1, head_dim]
    sin: torch.Tensor,  # [B, T, 1, head_dim]
    ctx: AttnContext,
    capture: tuple[int, ...] = (),
) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """``blocks`` then ``final_norm`` in one call: (normed [B, T, H], captured), or None."""
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
    c: ModelConfig, final_norm: RMSNorm, x: torch.Tensor, cos: torch.Tensor, ctx: AttnContext
) -> gemv.GemvKernel | None:
    """The kernel when the one-call path applies to this stack and forward (see module)."""
    if ctx.cache is None or not ctx.read_cache or ctx.static or not x.is_contiguous():
        return None
    if c.qk_norm or c.attention_bias or c.head_dim % 32 or c.head_dim > 256:
        return None
    kernel = gemv.native_bf16(x, cos, ctx.cache.k, final_norm.weight)
    return kernel if kernel is not None and final_norm.native else None


def _layer_weights(layer: Block) -> tuple[int, ...] | None:
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
