"""Attention over a KV cache's keys and values for few queries (decode, verify, drafting).

``sdpa`` is PyTorch's fused attention with grouped-query heads; ``grouped_sdpa`` the same with the
query heads that share a KV head stacked as query rows (one read of each KV head by a fused kernel
that takes a mask: static steps); ``grouped_attention`` batched GEMMs per KV head (the CPU's bf16
path). Shapes: q [B, H, T, D], k/v [B, KV, L, D], mask [B, 1, T, L] bool (True = attend).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """PyTorch's fused attention (q [B, H, T, D], k/v [B, KV, L, D], mask [B, 1, T, L] or None
    = every key visible)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def grouped_sdpa(
    q: torch.Tensor,  # [B, H, T, D]
    k: torch.Tensor,  # [B, KV, L, D] (a view of the whole cache)
    v: torch.Tensor,  # [B, KV, L, D]
    mask: torch.Tensor,  # [B, 1, T, L] bool, True = attend
) -> torch.Tensor:
    """PyTorch's fused attention with the H/KV query heads sharing a KV head stacked as query
    rows: each KV head is read once by a fused kernel that takes a mask (SDPA's grouped-query
    path under a mask is its math kernel, which copies K and V per query head). [B, H, T, D]."""
    b, h, t, d = q.shape
    kv, length = k.shape[1], k.shape[2]
    g = h // kv
    rows = mask[:, :, None].expand(b, 1, g, t, length).reshape(b, 1, g * t, length)
    out = F.scaled_dot_product_attention(q.reshape(b, kv, g * t, d), k, v, attn_mask=rows)
    return out.reshape(b, h, t, d)  # CUDA's kernel returns a transposed (strided) view


FP32_ATTENTION_ROWS = 4  # batch rows up to which grouped_attention computes in float32


def grouped_attention(
    q: torch.Tensor,  # [B, H, T, D]
    k: torch.Tensor,  # [B, KV, L, D] (a strided view of the cache)
    v: torch.Tensor,  # [B, KV, L, D]
    mask: torch.Tensor | None,  # [B, 1, T, L] bool, True = attend; None = every key
) -> torch.Tensor:
    """Attention for few queries over a long cache, as batched GEMMs per KV head.

    The H/KV query heads sharing a KV head are stacked as rows, so each KV head's keys are read
    once; on CPU in bf16 this is several times faster than the fused kernel at T <= 8. Up to
    ``FP32_ATTENTION_ROWS`` rows it computes in float32 (tiny bf16 batched GEMMs are slow on CPU:
    ~3x at batch 1, conversions included); the result has q's dtype either way.
    """
    b, h, t, d = q.shape
    dtype = q.dtype
    kv = k.shape[1]
    g = h // kv
    qg = q.reshape(b, kv, g * t, d)
    if b <= FP32_ATTENTION_ROWS:
        qg, k, v = qg.float(), k.float(), v.float()
        scores = torch.matmul(qg, k.transpose(-1, -2))  # [B, KV, gT, L]
    else:
        scores = torch.matmul(k, qg.transpose(-1, -2)).transpose(-1, -2).float()
    scores = scores.view(b, kv, g, t, -1).mul_(d**-0.5)
    if mask is not None:
        scores.masked_fill_(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, kv, g * t, -1)
    return torch.matmul(probs, v).view(b, h, t, d).to(dtype)
