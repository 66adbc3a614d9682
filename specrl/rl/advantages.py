"""Group-relative advantage estimators, registered by name.

Contract: an estimator maps rewards ``[num_groups, G]`` (the G completions of one prompt share a
row) to advantages of the same shape, one scalar per completion; the learner broadcasts it over the
completion's tokens. Estimators are pure functions looked up by name with ``get_advantage``:

- ``grpo``: ``(r - mean_group) / (std_group + eps)``; ``normalize_std=False`` skips the division.
  The std is the unbiased sample std (as in TRL/DeepSeekMath); a group of identical rewards gets
  advantage 0 everywhere.
- ``dr_grpo``: ``r - mean_group`` (Dr. GRPO: no std normalisation, which biases toward easy or hard
  prompts).
- ``rloo``: leave-one-out baseline ``r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_group)``;
  needs G >= 2.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specrl.rl.registry import Registry

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
