"""Where tensors live: the ``model.device`` setting resolved, and what differs per device.

``resolve_device(name)`` turns ``auto | cpu | cuda | cuda:N`` into a ``torch.device`` or raises
``DeviceError`` (one line). Everything else takes a ``torch.device``, never a global:
``synchronize``, ``autocast``, ``peak_flops``, ``mm_out_dtype`` and ``memory_budget``. No
module-level state. Details: docs/internals.md.
"""

from __future__ import annotations

import contextlib
import functools
import re

import torch

DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")

# Dense bf16 tensor-core peaks (datasheets, without sparsity), FLOP/s, by a substring of
# ``torch.cuda.get_device_name``; the first match wins, so longer names come first.
PEAK_BF16_FLOPS = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H200", 989e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
)


class DeviceError(ValueError):
    """A device setting that cannot be honoured here; the message names the value."""


def resolve_device(name: str = "auto") -> torch.device:
    """``auto | cpu | cuda | cuda:N`` -> ``torch.device`` (see docs/internals.md)."""
    if not isinstance(name, str) or not DEVICE_PATTERN.match(name):
        raise DeviceError(f"unknown device {name!r} (choose auto, cpu, cuda or cuda:N)")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"device {name!r}: this torch build or machine has no CUDA device")
    index = torch.cuda.current_device() if name == "cuda" else int(name.split(":")[1])
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"device {name!r}: only {count} CUDA device(s) here (cuda:0..)")
    return torch.device("cuda", index)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's first parameter (the CPU for a model without parameters)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def on(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Host-built tensors moved to ``device`` (the very same tensors when they are there)."""
    return tuple(t.to(device, non_blocking=True) for t in tensors)


def synchronize(device: torch.device) -> None:
    """Wait until the work queued on ``device`` is done (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_mark(device: torch.device) -> torch.cuda.Event | None:
    """A timing event recorded now on ``device``'s current stream (CUDA), to time device work
    the host does not wait for (``marked_seconds``); None elsewhere (the host waits for it)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def marked_seconds(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
    """Device seconds between two ``device_mark`` events (both done: the host waited since)."""
    return start.elapsed_time(end) / 1000


def autocast(device: torch.device, enabled: bool, dtype: torch.dtype = torch.bfloat16):
    """``torch.autocast`` for ``device``'s type, or a null context when not ``enabled``."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


@functools.cache
def mm_out_dtype(device: torch.device) -> bool:
    """Whether ``torch.mm(bf16, bf16, out_dtype=torch.float32)`` (float32 accumulation and
    output) runs on ``device`` (tried once per device, outside autograd: the op has no
    derivative, callers supply their own backward)."""
    try:
        with torch.no_grad():
            a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
            torch.mm(a, a, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def peak_flops(device: torch.device) -> float | None:
    """The datasheet dense bf16 peak (FLOP/s) of ``device``, or None when it is not known."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def memory_budget(device: torch.device, fraction: float, held: int = 0) -> int | None:
    """Bytes an engine may still allocate on ``device`` so that everything in use stays within
    ``fraction`` of the device's memory (vLLM's ``gpu_memory_utilization``); ``held`` bytes
    already counted as in use are the engine's own and may be reused, and so may the blocks
    torch's caching allocator holds free (the learner's freed activations). None on the CPU."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    used = total - free - cached - held  # blocks torch's allocator keeps free are reusable
    return max(0, int(fraction * total) - used)
