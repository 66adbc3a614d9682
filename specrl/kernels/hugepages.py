"""Zeroed CPU tensors backed by transparent huge pages, for the big arrays decoding streams.

``huge_zeros(shape, dtype)`` returns a zero-filled, contiguous CPU tensor; from
``HUGE_MIN_BYTES`` up its memory is a private anonymous mapping advised ``MADV_HUGEPAGE``
(ordinary memory where that is unavailable or refused). Values and operations are the same
either way; the memory is released with the tensor. Why, and measurements: docs/internals.md.
"""

from __future__ import annotations

import contextlib
import math
import mmap

import torch

HUGE_MIN_BYTES = 4 << 20  # below this a 2 MiB-aligned page rarely fits inside the buffer


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor of ``shape``, on huge pages where the OS grants them."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_MIN_BYTES or advice is None:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero-filled
    with contextlib.suppress(OSError):  # refused here: ordinary pages, the same tensor
        buf.madvise(advice)
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)
