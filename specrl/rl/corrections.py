"""Off-policy corrections: what the policy loss compares against, registered by name.

A correction is ``fn(current [N, T], behaviour [N, T], has_behaviour [N], cap) ->
Correction(old [N, T], weight [N, T] | None)``: the loss clips ``ratio = exp(logprobs - old)``
and multiplies each token's term by ``weight`` (1 where None). ``ppo``: ``old`` = behaviour
where given, else current. ``tis``: ``old`` = current and ``weight = min(exp(current -
behaviour), cap)``, the truncated importance ratio. Details: docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specrl.registry import Registry


@dataclass(frozen=True)
class Correction:
    old: torch.Tensor  # [N, T] logprobs the ratio is taken against
    weight: torch.Tensor | None  # [N, T] per-token importance weight, None = 1


CorrectionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], Correction]
CORRECTIONS: Registry[CorrectionFn] = Registry("off-policy correction")
register_correction = CORRECTIONS.register
get_correction = CORRECTIONS.get


@register_correction("ppo")
def ppo_correction(
    current: torch.Tensor, behaviour: torch.Tensor, has: torch.Tensor, cap: float
) -> Correction:
    return Correction(torch.where(has[:, None], behaviour, current), None)  # rows without: ratio 1


@register_correction("tis")
def tis_correction(
    current: torch.Tensor, behaviour: torch.Tensor, has: torch.Tensor, cap: float
) -> Correction:
    ratio = torch.exp(current - behaviour).clamp(max=cap)  # [N, T]
    return Correction(current, torch.where(has[:, None], ratio, torch.ones_like(ratio)))
