"""Content fingerprints of named tensors: a cheap checksum both sides of a weight sync compute.

``fingerprint(named, dtype=None)`` is ``"<dtype>:<16 hex digits>"``, a deterministic function of
the names, shapes and a fixed sample of the values once cast to ``dtype`` (the same in any
process and at any thread count; a learner's float32 masters cast to the engine's dtype match
the engine's copy). It costs O(samples + rows) per tensor and catches a scaled, offset or
rewritten row, not always a few scattered elements. ``fingerprint_parts`` / ``combine``: the
same fingerprint from tensors held apart. ``fingerprint_dtype(fp)`` reads the dtype.
Details (the sample): docs/internals.md.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

import torch

SAMPLES = 4096  # random positions per tensor (plus one per row of a matrix)
_DIGEST_BYTES = 8


def _seed(name: str) -> int:
    """A 63-bit generator seed from a tensor's name (the same in every process)."""
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def positions(name: str, shape: torch.Size) -> torch.Tensor | None:
    """Flat indices ``[S]`` (int64) of the sampled elements of a tensor of ``shape`` named
    ``name``; ``None`` when every element is hashed."""
    numel = math.prod(shape)
    if numel <= SAMPLES:
        return None
    gen = torch.Generator().manual_seed(_seed(name))
    picks = torch.randint(0, numel, (SAMPLES,), generator=gen)  # [SAMPLES]
    if len(shape) < 2:
        return picks
    rows = shape[0]
    cols = numel // rows
    per_row = torch.arange(rows) * cols + torch.randint(0, cols, (rows,), generator=gen)  # [rows]
    return torch.cat([picks, per_row])  # [SAMPLES + rows]


def _sample_bytes(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> bytes:
    flat = tensor.detach().reshape(-1)  # [N]
    idx = positions(name, tensor.shape)
    values = flat if idx is None else flat[idx.to(flat.device)]  # [S]
    if values.is_floating_point():
        values = values.to(dtype)
    return values.cpu().contiguous().view(torch.uint8).numpy().tobytes()


def _default_dtype(named: Mapping[str, torch.Tensor]) -> torch.dtype:
    floats = (named[n].dtype for n in sorted(named) if named[n].is_floating_point())
    return next(floats, torch.float32)


def fingerprint(named: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> str:
    """See docs/internals.md."""
    dtype = dtype or _default_dtype(named)
    return combine(fingerprint_parts(named, dtype), dtype)


def fingerprint_parts(named: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, bytes]:
    """Each tensor's share of the fingerprint in ``dtype`` (its header and sampled values): the
    parts of tensors held in different places (gathered blocks) ``combine`` into one."""
    out = {}
    for name, tensor in named.items():
        header = f"{name}|{tuple(tensor.shape)}|{tensor.is_floating_point()}\n".encode()
        out[name] = header + _sample_bytes(name, tensor, dtype)
    return out


def combine(parts: Mapping[str, bytes], dtype: torch.dtype) -> str:
    """The fingerprint of the tensors whose ``fingerprint_parts`` (in ``dtype``) are ``parts``."""
    digest = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    for name in sorted(parts):
        digest.update(parts[name])
    return f"{_dtype_name(dtype)}:{digest.hexdigest()}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fingerprint_dtype(fp: str) -> torch.dtype:
    """The dtype ``fp`` was taken in."""
    name, sep, _ = fp.partition(":")
    dtype = getattr(torch, name, None) if sep else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a weight fingerprint: {fp!r}")
    return dtype
