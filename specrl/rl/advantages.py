"""Group-relative advantage estimators, registered by name.

An estimator maps rewards ``[num_groups, G]`` (a prompt's G completions per row) to advantages of
the same shape; the learner broadcasts each over its completion's tokens. Pure functions looked
up with ``get_advantage``: ``grpo`` ((r - mean) / (std + eps), unbiased std), ``dr_grpo``
(r - mean) and ``rloo`` (leave-one-out baseline, G >= 2). Details: docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specrl.registry import Registry

AdvantageFn = Callable[..., torch.Tensor]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")
register_advantage = ADVANTAGES.register  # fn(rewards [num_groups, G], **kw) -> [num_groups, G]
get_advantage = ADVANTAGES.get


def compute_advantages(name: str, rewards: torch.Tensor, **kwargs) -> torch.Tensor:
    """Advantages ``[num_groups, G]`` for rewards ``[num_groups, G]`` with estimator ``name``."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {tuple(rewards.shape)}")
    return get_advantage(name)(rewards.float(), **kwargs)


def _centred(rewards: torch.Tensor) -> torch.Tensor:
    return rewards - rewards.mean(dim=1, keepdim=True)  # [num_groups, G]


@register_advantage("grpo")
def grpo_advantages(
    rewards: torch.Tensor,  # [num_groups, G]
    eps: float = 1e-6,
    normalize_std: bool = True,
) -> torch.Tensor:
    centred = _centred(rewards)
    if not normalize_std or rewards.shape[1] < 2:
        return centred
    std = rewards.std(dim=1, keepdim=True)  # unbiased, [num_groups, 1]
    return centred / (std + eps)


@register_advantage("dr_grpo")
def dr_grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:  # [num_groups, G]
    return _centred(rewards)


@register_advantage("rloo")
def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:  # [num_groups, G]
    g = rewards.shape[1]
    if g < 2:
        raise ValueError(f"rloo needs at least 2 completions per prompt, got G={g}")
    return _centred(rewards) * (g / (g - 1))
