"""Preallocated KV cache written at explicit positions.

K and V are [layers, slots, kv_heads, max_len, head_dim]; batch row b of a forward uses slot b.
A forward writes its tokens' keys/values at the positions given; attention reads positions
``< kv_len`` and masks keys later than the query, so the caller owns each sequence's length
(rolling back rejected drafts is using a smaller position next time). ``move``, ``copy_slot``,
``move_positions`` and ``grow`` compact, fork, move within and lengthen slots.
Details: docs/internals.md.
"""

from __future__ import annotations

import torch

from specrl.kernels import gemv
from specrl.kernels.hugepages import huge_zeros


class KVCache:
    """K/V storage for ``slots`` sequences of up to ``max_len`` tokens."""

    def __init__(
        self,
        num_layers: int,
        slots: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, slots, num_kv_heads, max_len, head_dim)
        self.k = _zeros(shape, dtype, torch.device(device))
        self.v = _zeros(shape, dtype, torch.device(device))

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (K and V)."""
        return self.k.nbytes + self.v.nbytes

    def grow(self, max_len: int) -> None:
        """Lengthen every slot to ``max_len`` positions, keeping the stored entries (a no-op when
        the cache is already that long). K is copied before V is allocated, so the peak is the
        old cache plus one new tensor."""
        if max_len <= self.max_len:
            return
        self.k = _longer(self.k, max_len)
        self.v = _longer(self.v, max_len)

    def write(
        self,
        layer: int,
        rows: torch.Tensor,  # [B, T] (or [B * T]) int64 slot per token
        positions: torch.Tensor,  # the same shape: int64 position per token
        k_new: torch.Tensor,  # [B, T, kv_heads, head_dim]
        v_new: torch.Tensor,  # [B, T, kv_heads, head_dim]
    ) -> None:
        """Store new keys/values at (slot, position)."""
        kernel = gemv.native_bf16(self.k, k_new, v_new)
        if kernel is not None:
            kernel.cache_write(self.k[layer], rows, positions, k_new)
            kernel.cache_write(self.v[layer], rows, positions, v_new)
            return
        shape = (*torch.broadcast_shapes(rows.shape, positions.shape), *k_new.shape[-2:])
        self.k[layer][rows, :, positions] = k_new.reshape(shape)
        self.v[layer][rows, :, positions] = v_new.reshape(shape)

    def read(
        self, layer: int, batch: int, kv_len: int, slots: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[batch, kv_heads, kv_len, head_dim]: views of slots 0..batch-1 (or of one given slot), or
        a gather of the given slots."""
        if slots is None:
            return self.k[layer, :batch, :, :kv_len], self.v[layer, :batch, :, :kv_len]
        if slots.numel() == 1:  # one slot: a view, no gather
            s = int(slots)
            return self.k[layer, s : s + 1, :, :kv_len], self.v[layer, s : s + 1, :, :kv_len]
        return self.k[layer, slots, :, :kv_len], self.v[layer, slots, :, :kv_len]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot src into slot dst (all layers)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    copy_slot = move

    def move_positions(self, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy position ``src[i]`` of slot ``slots[i]`` to position ``dst[i]`` (all layers;
        slots, src, dst: [N] int64)."""
        self.k[:, slots, :, dst] = self.k[:, slots, :, src]
        self.v[:, slots, :, dst] = self.v[:, slots, :, src]


def _longer(t: torch.Tensor, max_len: int) -> torch.Tensor:
    """A copy of cache tensor t [layers, slots, heads, L, dim] with L = max_len (zeros after)."""
    layers, slots, heads, length, dim = t.shape
    out = _zeros((layers, slots, heads, max_len, dim), t.dtype, t.device)
    out[:, :, :, :length] = t
    return out


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor: on huge pages on the CPU (where granted), plain elsewhere."""
    if device.type == "cpu":
        return huge_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)
