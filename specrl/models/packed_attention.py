"""Attention over packed rows without a dense [T, T] mask: FlexAttention block masks.

Contract: a packed row holds several sequences as segments (``segments`` [B, T], padding -1);
a completion segment also sees the prompt segment that ``parents`` [B, T] names (-2 = none).
``PackedAttention.mask(segments, parents)`` builds, once per forward, a ``PackedMask`` that
every layer shares; ``PackedMask.attend(q, k, v)`` is ``flex_attention`` under it: query i of
row b sees key j of the same row iff j <= i, key j is not padding, and key j's segment is
query i's own or the one ``parents[b, i]`` names. At every non-padding query this is exactly
the dense mask of ``Transformer.attn_context``; a padding query sees nothing (output 0), and
only blocks with a visible key are computed. GQA goes through ``enable_gqa``; q and k are cast
to v's dtype (under autocast RoPE leaves them float32 while v comes out of a bf16 matmul).

On CUDA the block-mask construction and the attention run compiled (``torch.compile``, once
per ``PackedAttention``, which a model holds; no module-level state), so neither materialises
a [T, T] mask. Elsewhere both run eagerly: fine for checking equivalence on the CPU, forward
only (PyTorch has no CPU backward for flex attention), so the CPU keeps the dense mask.
``use_flex(mode, device, head_dim)`` is the choice: 'flex', 'dense', or 'auto' (flex on CUDA
where the compiled kernel runs: head_dim >= 16).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

MODES = ("auto", "flex", "dense")
MIN_HEAD_DIM = 16  # the compiled (Triton) flex kernel's smallest head dimension


def use_flex(mode: str, device: torch.device, head_dim: int = MIN_HEAD_DIM) -> bool:
    """Whether packed, cache-free forwards on ``device`` use flex attention under ``mode``."""
    if mode not in MODES:
        raise ValueError(f"packed_attention must be one of {MODES}, got {mode!r}")
    auto = device.type == "cuda" and head_dim >= MIN_HEAD_DIM
    return mode == "flex" or (mode == "auto" and auto)


def packed_mask_mod(segments: torch.Tensor, parents: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The ``mask_mod`` of packed rows (segments, parents [B, T]; see the module docstring)."""

    def mask_mod(b, h, q, kv):  # noqa: ANN001, ANN202 (flex passes index tensors)
        key = segments[b, kv]
        visible = (key == segments[b, q]) | (key == parents[b, q])
        return (kv <= q) & (key >= 0) & visible

    return mask_mod


@dataclass(frozen=True)
class PackedMask:
    """One forward's block mask and the attention function that reads it."""

    block_mask: BlockMask
    attention: Callable[..., torch.Tensor]

    def attend(
        self,
        q: torch.Tensor,  # [B, heads, T, D]
        k: torch.Tensor,  # [B, kv_heads, T, D]
        v: torch.Tensor,  # [B, kv_heads, T, D]
    ) -> torch.Tensor:  # [B, heads, T, D]
        q, k = q.to(v.dtype), k.to(v.dtype)
        return self.attention(q, k, v, block_mask=self.block_mask, enable_gqa=True)


class PackedAttention:
    """Builds ``PackedMask``es; holds the compiled functions on CUDA (compiled on first use).
    A copy starts without them (compiled functions are not copied or pickled)."""

    def __init__(self) -> None:
        self._compiled: dict[str, Callable[..., Any]] = {}

    def _fn(self, fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
        if device.type != "cuda":
            return fn
        if fn.__name__ not in self._compiled:
            self._compiled[fn.__name__] = torch.compile(fn)
        return self._compiled[fn.__name__]

    def mask(
        self,
        segments: torch.Tensor,  # [B, T] segment ids; -1 = padding
        parents: torch.Tensor | None,  # [B, T] a segment also seen; -2 = none
    ) -> PackedMask:
        if parents is None:
            parents = torch.full_like(segments, -2)
        b, t = segments.shape
        device = segments.device
        build = self._fn(create_block_mask, device)
        block_mask = build(packed_mask_mod(segments, parents), b, None, t, t, device=device)
        return PackedMask(block_mask, self._fn(flex_attention, device))

    def __deepcopy__(self, memo: dict) -> PackedAttention:
        return PackedAttention()

    def __getstate__(self) -> dict:
        return {"_compiled": {}}
