"""Model FLOPs of a training step, by the MFU convention: what the model needs, not what ran.

``train_flops(model, forward_tokens, head_positions)`` = 6 x trunk parameters x forward tokens
+ 6 x LM-head parameters x head positions (``param_counts``: the trunk is every parameter but
the embedding and the LM head). Attention scores, recomputation and elementwise work are not
counted. Details: docs/internals.md.
"""

from __future__ import annotations

from torch import nn


def param_counts(model: nn.Module) -> tuple[int, int]:
    """(trunk parameters, LM-head parameters) of a model with ``embed`` and ``lm_head``."""
    skip = {id(model.embed.weight), id(model.lm_head.weight)}
    trunk = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    return trunk, model.lm_head.weight.numel()


def train_flops(model: nn.Module, forward_tokens: int, head_positions: int) -> float:
    """Model FLOPs of a forward + backward (see docs/internals.md)."""
    trunk, head = param_counts(model)
    return 6.0 * trunk * forward_tokens + 6.0 * head * head_positions
