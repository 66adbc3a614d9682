"""Policy-gradient losses of the GRPO family, registered by name, plus the k3 KL penalty.

Every loss is ``fn(logprobs [N, T], old_logprobs [N, T], advantages [N], mask [N, T], *,
eps_low, eps_high, ref_logprobs=None, kl_coef=0.0, max_len=None, norm=None, is_weight=None) ->
LossOutput``: one clipped per-token objective (plus ``kl_coef`` x the k3 KL), aggregated per
loss (``grpo``: per sequence, then over sequences; ``dr_grpo``: over ``num_sequences *
max_len``; ``dapo``: over all tokens). ``norm`` carries batch-wide counts so that micro-batch
losses add up to the whole batch's. Details (formulas, metrics): docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specrl.registry import Registry


@dataclass(frozen=True)
class LossNorm:
    """Batch-wide normalisers (whole batch, not the micro-batch)."""

    num_sequences: int
    num_tokens: int

    @staticmethod
    def of(mask: torch.Tensor) -> LossNorm:  # [N, T]
        return LossNorm(int(mask.shape[0]), max(int(mask.sum().item()), 1))


@dataclass(frozen=True)
class LossOutput:
    loss: torch.Tensor  # [] scalar, differentiable
    metrics: dict[str, float]


LossFn = Callable[..., LossOutput]
LOSSES: Registry[LossFn] = Registry("policy loss")
register_loss = LOSSES.register  # a loss with the module's common signature
get_loss = LOSSES.get


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || ref): exp(d) - d - 1 with d = ref - policy."""
    d = ref_logprobs - logprobs  # [N, T]
    return torch.exp(d) - d - 1


@dataclass(frozen=True)
class _Terms:
    per_token: torch.Tensor  # [N, T] term_t (not yet masked)
    metrics: dict[str, float]


def _token_terms(
    logprobs: torch.Tensor,  # [N, T]
    old_logprobs: torch.Tensor,  # [N, T]
    advantages: torch.Tensor,  # [N]
    mask: torch.Tensor,  # [N, T]
    eps_low: float,
    eps_high: float,
    ref_logprobs: torch.Tensor | None,  # [N, T]
    kl_coef: float,
    is_weight: torch.Tensor | None = None,  # [N, T] detached
) -> _Terms:
    mask = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype)[:, None]  # [N, 1]
    ratio = torch.exp(logprobs - old_logprobs)  # [N, T]
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    if is_weight is not None:
        per_token = per_token * is_weight
    kl = torch.zeros_like(logprobs)
    if ref_logprobs is not None:
        kl = k3_kl(logprobs, ref_logprobs)
        per_token = per_token + kl_coef * kl
    with torch.no_grad():
        active = ((ratio > 1 + eps_high) & (adv > 0)) | ((ratio < 1 - eps_low) & (adv < 0))
        n = mask.sum().clamp(min=1)
        metrics = {
            "clip_frac": float((active * mask).sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
            "kl": float((kl * mask).sum() / n),
            "is_weight_mean": float((is_weight * mask).sum() / n) if is_weight is not None else 1.0,
            "tokens": float(mask.sum()),
        }
    return _Terms(per_token * mask, metrics)


def _check(logprobs, old_logprobs, advantages, mask) -> None:
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and "
            f"mask {tuple(mask.shape)} must have the same [N, T] shape"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"advantages must be [N]={logprobs.shape[0]}, got {tuple(advantages.shape)}"
        )


@register_loss("grpo")
def grpo_loss(
    logprobs, old_logprobs, advantages, mask, *, eps_low=0.2, eps_high=None, ref_logprobs=None,
    kl_coef=0.0, max_len=None, norm: LossNorm | None = None, is_weight=None,
) -> LossOutput:  # fmt: skip
    _check(logprobs, old_logprobs, advantages, mask)
    norm = norm or LossNorm.of(mask)
    eps_high = eps_low if eps_high is None else eps_high
    t = _token_terms(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, ref_logprobs,
                     kl_coef, is_weight)  # fmt: skip
    lengths = mask.sum(dim=1).clamp(min=1).to(logprobs.dtype)  # [N]
    loss = (t.per_token.sum(dim=1) / lengths).sum() / norm.num_sequences
    return LossOutput(loss, t.metrics)


@register_loss("dr_grpo")
def dr_grpo_loss(
    logprobs, old_logprobs, advantages, mask, *, eps_low=0.2, eps_high=None, ref_logprobs=None,
    kl_coef=0.0, max_len=None, norm: LossNorm | None = None, is_weight=None,
) -> LossOutput:  # fmt: skip
    _check(logprobs, old_logprobs, advantages, mask)
    norm = norm or LossNorm.of(mask)
    eps_high = eps_low if eps_high is None else eps_high
    max_len = mask.shape[1] if max_len is None else max_len
    t = _token_terms(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, ref_logprobs,
                     kl_coef, is_weight)  # fmt: skip
    loss = t.per_token.sum() / (norm.num_sequences * max_len)
    return LossOutput(loss, t.metrics)


@register_loss("dapo")
def dapo_loss(
    logprobs, old_logprobs, advantages, mask, *, eps_low=0.2, eps_high=0.28, ref_logprobs=None,
    kl_coef=0.0, max_len=None, norm: LossNorm | None = None, is_weight=None,
) -> LossOutput:  # fmt: skip
    _check(logprobs, old_logprobs, advantages, mask)
    norm = norm or LossNorm.of(mask)
    eps_high = 0.28 if eps_high is None else eps_high
    t = _token_terms(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, ref_logprobs,
                     kl_coef, is_weight)  # fmt: skip
    loss = t.per_token.sum() / norm.num_tokens
    return LossOutput(loss, t.metrics)
