"""A bf16 GEMV kernel for batch-1..4 decoding on AVX512-BF16 CPUs, built on first use.

Contract. ``gemv_kernel()`` returns a ``GemvKernel`` or ``None`` when it cannot run here: not
Linux/x86 with the ``avx512f avx512bw avx512vl avx512_bf16`` flags, no C compiler (``$CC`` or
``gcc``), a failed build (a warning says why), or ``SPECRL_NATIVE_KERNELS=0`` in the environment.
Callers then use PyTorch's ops; nothing else changes. The shared library is compiled once from
``gemv_bf16.c`` (shipped with the package) into ``$SPECRL_CACHE/kernels/`` under a name that
hashes the source and flags, written atomically, and loaded with ctypes (no torch headers, ~0.3 s
to build). The result is cached per process (``functools.cache``).

``GemvKernel.pack(weight [N, K] bf16) -> [N/16, K/2, 16, 2]`` lays the weight out once;
``GemvKernel.matmul(x [M, K] bf16, packed, n) -> [M, N] bf16`` computes ``x @ weight.T`` with
float32 accumulation for M <= ``MAX_ROWS``, reading the weight once per call, its output rows
split over ``torch.get_num_threads()`` OpenMP threads (the same values for any thread count).
Why: one core streams these small-batch products at ~25-28 GB/s against ~12-16 GB/s for oneDNN's
prepacked bf16 linear on this project's (non-AMX) CPU, and batch-1 decoding is nearly all such
products.
The sum order differs from oneDNN's, so results agree to bf16 rounding, not bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import warnings
from pathlib import Path

import torch

from specrl.paths import cache_dir

MAX_ROWS = 4  # input rows per call the kernel takes (it reads the weight once for all)
SOURCE = Path(__file__).with_name("gemv_bf16.c")
FLAGS = (
    "-O3",
    "-fopenmp",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512bf16",
    "-shared",
    "-fPIC",
)
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
ENV_SWITCH = "SPECRL_NATIVE_KERNELS"


class GemvKernel:
    """The loaded library's ``specrl_gemv_bf16`` with packing and shape checks."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.specrl_gemv_bf16
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """Whether a [N, K] weight can be packed: bf16 on the CPU, N % 16 == 0, K % 4 == 0."""
        n, k = weight.shape
        return (
            weight.dtype == torch.bfloat16
            and weight.device.type == "cpu"
            and n % 16 == 0
            and k % 4 == 0
        )

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """[N, K] bf16 -> [N/16, K/2, 16, 2]: 16 output rows x 2 consecutive ks per 64 bytes."""
        n, k = weight.shape
        return weight.detach().view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()

    def matmul(self, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        """x [M, K] bf16 (M <= MAX_ROWS) times the packed [N, K] weight transposed -> [M, N]."""
        m, k = x.shape
        if packed.shape[0] * 16 != n or packed.shape[1] * 2 != k:
            raise ValueError(
                f"x [{m}, {k}] does not match a packed [{n}, ...] weight {packed.shape}"
            )
        x = x.contiguous()
        y = torch.empty(m, n, dtype=torch.bfloat16)
        if (
            self._fn(
                packed.data_ptr(), x.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads()
            )
            != 0
        ):
            raise ValueError(f"gemv kernel refused shapes M={m}, N={n}, K={k}")
        return y


@functools.cache
def gemv_kernel() -> GemvKernel | None:
    """The kernel, built and loaded on first call; None where it cannot run (see module)."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or not cpu_supported():
        return None
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        return None
    try:
        return GemvKernel(ctypes.CDLL(str(_build(compiler))))
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        warnings.warn(f"specrl: native GEMV kernel unavailable ({e}); using oneDNN", stacklevel=2)
        return None


def cpu_supported() -> bool:
    """Linux on x86-64 whose /proc/cpuinfo lists every flag in ``CPU_FLAGS``."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    flags = set(line.split(":", 1)[-1].split())
    return all(f in flags for f in CPU_FLAGS)


def _build(compiler: str) -> Path:
    """Compile ``SOURCE`` into the cache (once per source and flags); return the library path."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"gemv_bf16-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    cmd = [compiler, *FLAGS, str(SOURCE), "-o", str(tmp)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    os.replace(tmp, out)
    return out
