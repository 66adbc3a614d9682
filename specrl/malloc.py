"""Keep freed memory in the process for reuse: glibc malloc settings for a training process.

``keep_freed_memory()`` sets glibc's trim threshold, top pad and mmap threshold (``mallopt``) so
that freed heap memory is reused instead of returned to the OS; True when glibc took all three,
False elsewhere (nothing else happens). ``return_freed_memory()`` hands free memory back once
(``malloc_trim(0)``). Values are never affected. ``specrl train`` and the Ray learner actor call
it; importing specrl never does. Details and measurements: docs/internals.md.
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
