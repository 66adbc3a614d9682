"""Zeroed CPU tensors backed by transparent huge pages, for the big arrays decoding streams.

Contract: ``huge_zeros(shape, dtype)`` returns a zero-filled, contiguous CPU tensor. From
``HUGE_MIN_BYTES`` up its memory is a private anonymous mapping advised ``MADV_HUGEPAGE``
before anything touches it, so that where Linux's transparent huge pages run in ``madvise`` (or
``always``) mode its 2 MiB-aligned part is backed by 2 MiB pages; below that size, where the
platform has no such advice, or where the advice is refused, it is ordinary memory. Values and
every operation on the tensor are the same either way; the memory is released with the tensor.
Why: a decode step streams the packed weights and the KV cache from memory, and with 4 KiB pages
the streams miss the TLB every 4 KiB. On this project's 2-core CPU a batch-64 decode forward over
128 cached tokens took 30.7 ms on 4 KiB pages and 29.3 ms on huge pages (1.05x; batch 1 and 8:
no difference): ``benchmarks/hugepages.py``, ``benchmarks/results/hugepages.json``.
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
