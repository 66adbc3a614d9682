"""Which floating-point precision is fast here: 'auto' resolved by what the device can do.

Contract: ``fast_bf16()`` is True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX:
flags in ``/proc/cpuinfo``; elsewhere torch's CPU capability must be AVX512); then bf16 halves
the bytes a memory-bound decode step reads. Without it (e.g. an AVX2-only CPU) torch emulates
bf16 GEMMs ~8-10x slower than fp32, so ``resolve_precision("auto")`` gives "fp32" there and
"bf16" otherwise; on a CUDA device 'auto' is "bf16" where the GPU computes in bf16 (Ampere
and newer), else "fp32"; "fp32"/"bf16" pass through. ``torch_dtype(name, device)`` maps a
resolved name (or "auto") to the torch dtype.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@functools.cache
def fast_bf16() -> bool:
    """Whether this CPU has native bf16 dot products (see the module docstring)."""
    info = Path("/proc/cpuinfo")
    if info.exists():
        flags = next((ln for ln in info.read_text().splitlines() if ln.startswith("flags")), "")
        return any(flag in flags.split() for flag in BF16_FLAGS)
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def resolve_precision(name: str, device: torch.device | None = None) -> str:
    """'auto' -> 'bf16' where ``device`` (default: the CPU) multiplies bf16 natively, else
    'fp32'."""
    if name == "auto":
        if device is not None and device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
        return "bf16" if fast_bf16() else "fp32"
    if name not in TORCH_DTYPES:
        raise ValueError(f"unknown precision {name!r} (choose fp32, bf16 or auto)")
    return name


def torch_dtype(name: str, device: torch.device | None = None) -> torch.dtype:
    return TORCH_DTYPES[resolve_precision(name, device)]
