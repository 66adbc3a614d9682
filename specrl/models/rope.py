"""Rotary position embeddings: the inverse frequencies of a config and the rotate-half map.

Contract: ``rope_inv_freq(config)`` is the [head_dim / 2] inverse frequencies with the config's
theta and scaling (none, 'linear' or 'llama3'; another type is a ``ValueError``);
``rotate_half(x)`` is Hugging Face's rotate-half over the last dimension (q * cos +
rotate_half(q) * sin applies RoPE).
"""

from __future__ import annotations

import math

import torch

from specrl.models.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] with the config's theta and scaling (llama3, linear)."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling_dict
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_scale(inv, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


def _llama3_scale(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(is_mid, mid, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> [..., D]: the halves (x1, x2) as (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
