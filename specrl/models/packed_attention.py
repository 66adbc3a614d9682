"""Attention over packed rows without a dense [T, T] mask: FlexAttention block masks.

``PackedAttention.mask(segments, parents)`` builds once per forward a ``PackedMask`` that every
layer shares; ``PackedMask.attend(q, k, v)`` is ``flex_attention`` under it: a query sees the
earlier non-padding keys of its own segment or of the prompt segment ``parents`` names, exactly
the dense mask of ``Transformer.attn_context`` (a padding query sees nothing). Compiled on CUDA,
eager elsewhere (forward only). ``use_flex(mode, device, head_dim)`` chooses flex or dense.
Details: docs/internals.md.
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
    """The ``mask_mod`` of packed rows (segments, parents [B, T]; see docs/internals.md)."""

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
