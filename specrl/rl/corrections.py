"""Off-policy corrections: what the policy loss compares against, registered by name.

Contract: a correction is ``fn(current [N, T], behaviour [N, T], has_behaviour [N], cap) ->
Correction(old [N, T], weight [N, T] | None)``. ``current`` are the learner's logprobs of the
completion tokens before the update (detached), ``behaviour`` the logprobs of the distribution
the tokens were actually sampled from (the engine's processed logprobs; rows without them have
``has_behaviour`` False and arbitrary values). The loss then uses ``ratio = exp(logprobs - old)``
in its clip and multiplies each token's term by ``weight`` (1 where None).

- ``ppo``: ``old`` = behaviour where given, else current (ratio 1: on-policy); no weight. The
  clip both bounds the update and absorbs small behaviour/learner differences (bf16 rounding,
  one step of staleness).
- ``tis`` (decoupled PPO with truncated importance sampling): ``old`` = current (the proximal
  policy: the clip bounds the update around the learner's own weights) and ``weight =
  min(exp(current - behaviour), cap)`` (1 where there is no behaviour): the importance ratio from
  the behaviour policy to the learner's, truncated at ``cap`` so a stale token cannot dominate.
  With top-k/top-p sampling the behaviour logprobs belong to the truncated, renormalised
  distribution the engine sampled from, while the learner's are untruncated: the weight is then
  also the exact importance ratio for the truncation (on-policy it equals the probability mass
  the truncation kept, Z <= 1, at each position), so the learner optimises the untruncated
  policy it represents.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specrl.rl.registry import Registry


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
