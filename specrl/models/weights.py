"""Moving weights between a learner's model and a rollout copy of it.

``engine_copy(policy, dtype)`` is a frozen eval-mode deep copy sharing no tensor;
``check_weights(model, named)`` raises ``ValueError`` naming the first missing or mis-shaped
tensor; ``copy_weights(model, named)`` copies in place (moving version counters, so packed-weight
caches rebuild; tied weights once); ``snapshot(named, dtype)`` makes detached copies for an
update applied later. Details: docs/internals.md.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import nn


def engine_copy(policy: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A frozen eval-mode deep copy of ``policy`` in ``dtype`` for a rollout engine."""
    model = copy.deepcopy(policy).to(dtype=dtype)
    return model.eval().requires_grad_(False)


def check_weights(model: nn.Module, named: Mapping[str, torch.Tensor]) -> None:
    """Every parameter of ``model`` has a tensor of its shape in ``named``."""
    for name, dst in model.named_parameters():
        src = named.get(name)
        if src is None:
            raise ValueError(f"weight update: no tensor for parameter {name!r}")
        if src.shape != dst.shape:
            raise ValueError(
                f"weight update: tensor {name!r} has shape {tuple(src.shape)}, "
                f"the model expects {tuple(dst.shape)}"
            )


@torch.no_grad()
def copy_weights(model: nn.Module, named: Mapping[str, torch.Tensor]) -> None:
    """Copy ``named`` into ``model``'s parameters of the same names (in place)."""
    check_weights(model, named)
    for name, dst in model.named_parameters():  # tied weights appear once
        dst.copy_(named[name])  # casts; bumps dst._version


@torch.no_grad()
def snapshot(named: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Detached copies of ``named`` in ``dtype`` (tied tensors stay shared)."""
    out: dict[str, torch.Tensor] = {}
    seen: dict[int, torch.Tensor] = {}
    for name, t in named.items():
        key = id(t)
        if key not in seen:
            seen[key] = t.detach().to(dtype=dtype, copy=True).contiguous()
        out[name] = seen[key]
    return out
