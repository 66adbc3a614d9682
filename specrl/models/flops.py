"""Model FLOPs of a training step, by the MFU convention: what the model needs, not what ran.

Contract: ``train_flops(model, forward_tokens, head_positions)`` =
6 x trunk parameters x forward tokens + 6 x LM-head parameters x head positions
(2 FLOPs per parameter and token in the forward, 4 in the backward). Trunk parameters
(``param_counts``) are every parameter of the model except the token embedding (a lookup) and
the LM head; LM-head parameters are its weight [V, H], counted even when tied to the
embedding. Forward tokens are the non-padding tokens of the packed rows; head positions the
positions whose logits are computed (the completion tokens' predicting positions). Not
counted: attention scores (the T^2 term), recomputation (activation checkpointing, the chunked
LM head's backward), elementwise work.
"""

from __future__ import annotations

from torch import nn


def param_counts(model: nn.Module) -> tuple[int, int]:
    """(trunk parameters, LM-head parameters) of a model with ``embed`` and ``lm_head``."""
    skip = {id(model.embed.weight), id(model.lm_head.weight)}
    trunk = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    return trunk, model.lm_head.weight.numel()


def train_flops(model: nn.Module, forward_tokens: int, head_positions: int) -> float:
    """Model FLOPs of a forward + backward (see the module docstring)."""
    trunk, head = param_counts(model)
    return 6.0 * trunk * forward_tokens + 6.0 * head * head_positions
