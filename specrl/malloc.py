"""Keep freed memory in the process for reuse: glibc malloc settings for a training process.

Contract: ``keep_freed_memory()`` sets, through glibc's ``mallopt``, no trimming of the heap below
TRIM_THRESHOLD_BYTES of free memory at its top, TOP_PAD_BYTES of padding on every heap growth,
and the largest mmap threshold glibc takes (32 MiB): allocations below it come from the heap and
are reused, not mapped fresh and unmapped each time. It returns True when glibc took all three,
False where the C library is not glibc or refused one (nothing else happens). Values are never
affected, only where freed memory goes; the process keeps its peak heap instead of returning it
to the OS. ``specrl train`` calls it at start, the Ray learner actor in its own process (the
training processes; importing specrl never does). ``return_freed_memory()`` does the opposite
once: the free memory at the heap's top and in its free pages goes back to the OS
(``malloc_trim(0)``; False where the C library is not glibc).
Why: a learner step allocates and frees the same large activations and gradients at every
micro-batch; glibc's defaults hand them back to the OS and take them again as zero-filled page
faults, most at a step whose packed shapes the process has not run before
(``benchmarks/malloc_settings.py``, ``benchmarks/results/malloc_settings.json``).
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int: the largest it can say
TOP_PAD_BYTES = 256 << 20
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's maximum on 64-bit systems


def _libc() -> ctypes.CDLL | None:
    """The C library, or None where it cannot be found."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Set the three malloc parameters (see module); True when glibc took them all."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES), (M_TOP_PAD, TOP_PAD_BYTES),
                (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))  # fmt: skip
    return all([mallopt(param, value) == 1 for param, value in settings])


def return_freed_memory() -> bool:
    """Hand the heap's free memory back to the OS once (glibc's ``malloc_trim(0)``); True when
    glibc did it."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
