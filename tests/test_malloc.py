"""``specrl.malloc.keep_freed_memory``: in a fresh process, a 16 MiB allocation comes from the
heap instead of a fresh mapping, and freeing it keeps the heap; without it glibc maps and unmaps.
Each case runs in a child process (the settings are process-wide)."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import subprocess
import sys

import pytest

CHILD = """
import ctypes, json, sys
from specrl.malloc import keep_freed_memory
libc = ctypes.CDLL("libc.so.6")
names = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
         "fordblks", "keepcost")
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in names]
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
took = keep_freed_memory() if sys.argv[1] == "keep" else None
before = libc.mallinfo2()
p = libc.malloc(16 << 20)
during = libc.mallinfo2()
libc.free(p)
after = libc.mallinfo2()
print(json.dumps({"took": took, "mapped": during.hblkhd - before.hblkhd,
                  "heap_grew": during.arena - before.arena,
                  "heap_kept": after.arena - before.arena}))
"""


def glibc_with_mallinfo2() -> bool:
    name = ctypes.util.find_library("c")
    try:
        return name is not None and hasattr(ctypes.CDLL(name), "mallinfo2")
    except OSError:
        return False


def run(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                         check=True)  # fmt: skip
    return json.loads(out.stdout)


@pytest.mark.skipif(not glibc_with_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_kept_memory_comes_from_the_heap_and_stays():
    kept, default = run("keep"), run("default")
    assert kept["took"] is True
    assert kept["mapped"] == 0 and kept["heap_grew"] >= 16 << 20
    assert kept["heap_kept"] >= 16 << 20  # not trimmed after the free
    assert default["mapped"] >= 16 << 20 and default["heap_kept"] < 16 << 20  # glibc's default
