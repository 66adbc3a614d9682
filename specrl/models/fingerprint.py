"""Content fingerprints of named tensors: a cheap checksum both sides of a weight sync compute.

Contract:
- ``fingerprint(named, dtype=None) -> str`` is ``"<dtype>:<16 hex digits>"``, a deterministic
  function of the names, shapes and a fixed sample of the values of ``named`` once its floating
  tensors are cast to ``dtype`` (default: the dtype of its first floating tensor in name order);
  other tensors (index buffers) are hashed as they are. It is the same in any process and at
  any thread count, and a learner's float32 master weights cast to the engine's dtype give
  exactly the fingerprint of the engine's copy (the cast rounds as ``Tensor.copy_`` does).
  Tied weights appear once in ``named_parameters()``, so both sides hash them once.
- The sample, per tensor (names in sorted order): every element of a tensor of at most
  ``SAMPLES`` elements; else ``SAMPLES`` positions drawn by a generator seeded with a hash of
  the name, plus, for a tensor of 2+ dimensions, one element of every row (first dimension) at
  a column drawn the same way. So a scaled or offset tensor and a zeroed or rewritten row
  always change it; a skipped update changes it unless no sampled element changed in the
  engine's dtype; a change confined to a few scattered elements only when the sample hits one.
- Cost: ``O(SAMPLES + rows)`` per tensor, whatever its size: milliseconds for a 135M-parameter
  model (measured in docs/pipelines.md, "Weight-sync guardrails").
- ``fingerprint_dtype(fp)``: the dtype a fingerprint was taken in (``ValueError`` if malformed).
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
    """See the module docstring."""
    dtype = dtype or _default_dtype(named)
    digest = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    for name in sorted(named):
        tensor = named[name]
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.is_floating_point()}\n".encode())
        digest.update(_sample_bytes(name, tensor, dtype))
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
