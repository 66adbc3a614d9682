"""Refit: push the learner's weights into the rollout engine's own model copy.

Contract:
- ``engine_copy(policy, dtype)`` makes the engine's model: a deep copy of the learner's policy in
  the engine precision (bf16 for AMX matmuls), frozen and in eval mode. The learner owns and
  mutates ``policy``; the engine never shares a tensor with it.
- ``refit(engine, named_tensors)`` copies every tensor of ``named_tensors`` (our parameter names,
  e.g. ``dict(policy.named_parameters())``) into the engine model's parameter of the same name,
  in place under ``no_grad`` (casting to the engine dtype). In-place ``copy_`` moves each
  weight's version counter, so the bf16 prepacked-weight cache of ``models.transformer.Linear``
  rebuilds on the next forward and never serves stale weights. Tied weights are copied once.
  A missing or mis-shaped tensor raises ``ValueError`` before anything is copied. The engine's
  ``policy_version`` is bumped by one; the call returns the seconds it took.
Model-free drafters (ngram, suffix) need no refit; a learned drafter would be refit here too.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping

import torch
from torch import nn

from specrl.engine.engine import Engine


def engine_copy(policy: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A frozen eval-mode deep copy of ``policy`` in ``dtype`` for the rollout engine."""
    model = copy.deepcopy(policy).to(dtype=dtype)
    return model.eval().requires_grad_(False)


def _check(params: Mapping[str, torch.Tensor], named: Mapping[str, torch.Tensor]) -> None:
    for name, dst in params.items():
        src = named.get(name)
        if src is None:
            raise ValueError(f"refit: no tensor for engine parameter {name!r}")
        if src.shape != dst.shape:
            raise ValueError(
                f"refit: tensor {name!r} has shape {tuple(src.shape)}, "
                f"engine expects {tuple(dst.shape)}"
            )


@torch.no_grad()
def copy_weights(model: nn.Module, named_tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``named_tensors`` into ``model``'s parameters of the same names (in place)."""
    params = dict(model.named_parameters())  # tied weights appear once
    _check(params, named_tensors)
    for name, dst in params.items():
        dst.copy_(named_tensors[name])  # casts; bumps dst._version


def refit(engine: Engine, named_tensors: Mapping[str, torch.Tensor]) -> float:
    """Copy the learner's weights into ``engine.model``, bump its policy version; seconds taken."""
    t0 = time.perf_counter()
    copy_weights(engine.model, named_tensors)
    engine.policy_version += 1
    return time.perf_counter() - t0
