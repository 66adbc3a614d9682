"""Moving weights between a learner's model and a rollout copy of it.

Contract:
- ``engine_copy(policy, dtype)``: a frozen eval-mode deep copy of ``policy`` in ``dtype``; the
  rollout side never shares a tensor with the learner.
- ``check_weights(model, named)``: ``ValueError`` naming the first missing or mis-shaped tensor
  (nothing is copied when it raises).
- ``copy_weights(model, named)``: copy ``named`` (our parameter names) into ``model``'s parameters
  in place under ``no_grad``, casting to their dtype. In-place ``copy_`` moves each weight's
  version counter, so the packed-weight caches of ``models.linear.Linear`` rebuild on the
  next forward and never serve stale weights. Tied weights are copied once.
- ``snapshot(named, dtype)``: detached contiguous copies in ``dtype`` (for an update applied
  later, while the learner keeps changing its own tensors).
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
