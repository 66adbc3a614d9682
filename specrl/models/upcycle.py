"""Sparse upcycling: a dense decoder turned into a mixture of experts that computes the same.

Contract: ``upcycle(model, experts, top_k, seed, router_std)`` returns a new ``Transformer`` of
the MoE family matching ``model``'s (``UPCYCLED``: Llama/Mistral -> Mixtral, Qwen2 -> Qwen2-MoE,
Qwen3 -> Qwen3-MoE) in which every layer's MLP is ``experts`` copies of the dense one, routed
top-``top_k`` with renormalised weights by a router drawn from N(0, router_std) (seeded).
Attention, norms, embeddings and head are copied. The weights of a token's experts sum to one,
so at step 0 the MoE's output is the dense model's up to float rounding; RL then moves the
experts apart. ``model`` is left as it was.
"""

from __future__ import annotations

import torch

from specrl.models.config import ModelConfig
from specrl.models.transformer import Transformer

UPCYCLED = {"llama": "mixtral", "mistral": "mixtral", "qwen2": "qwen2_moe", "qwen3": "qwen3_moe"}
MAX_EXPERTS = 256


def upcycled_config(dense: ModelConfig, experts: int, top_k: int) -> ModelConfig:
    """The MoE config of ``dense`` upcycled to ``experts`` experts, ``top_k`` per token."""
    if dense.is_moe:
        raise ValueError(f"the model is a mixture of experts already ({dense.model_type})")
    if dense.model_type not in UPCYCLED:
        raise ValueError(f"cannot upcycle a {dense.model_type!r} model; can: {', '.join(UPCYCLED)}")
    if not 2 <= experts <= MAX_EXPERTS:
        raise ValueError(f"experts must be in [2, {MAX_EXPERTS}], got {experts}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, experts={experts}], got {top_k}")
    return dense.replace(model_type=UPCYCLED[dense.model_type], num_experts=experts,
                         num_experts_per_tok=top_k, norm_topk_prob=True,
                         moe_intermediate_size=dense.intermediate_size)  # fmt: skip


@torch.no_grad()
def upcycle(
    model: Transformer, experts: int, top_k: int, seed: int = 0, router_std: float = 0.02
) -> Transformer:
    """``model`` as a mixture of ``experts`` copies of its MLPs (see the module)."""
    if not router_std >= 0 or router_std == float("inf"):
        raise ValueError(f"router_std must be finite and >= 0, got {router_std}")
    config = upcycled_config(model.config, experts, top_k)
    weight = model.embed.weight
    with torch.device("meta"):
        moe = Transformer(config)
    moe = moe.to_empty(device=weight.device).to(weight.dtype)
    moe.inv_freq = model.inv_freq.clone()
    moe.tie_weights()
    dense = dict(model.named_parameters())
    generator = torch.Generator().manual_seed(seed)
    for name, p in moe.named_parameters():
        p.copy_(_upcycled(name, p, dense, generator, router_std))
    return moe.eval().requires_grad_(weight.requires_grad)


def _upcycled(
    name: str,
    p: torch.Tensor,
    dense: dict[str, torch.Tensor],
    generator: torch.Generator,
    router_std: float,
) -> torch.Tensor:
    """The value of MoE parameter ``name``: the dense one, its MLP's weight repeated per expert
    ([E, rows, cols]), or a router drawn on the CPU (the same for every device)."""
    if name in dense:
        return dense[name]
    layer, _, part = name.removeprefix("layers.").partition(".mlp.")
    prefix = f"layers.{layer}.mlp."
    if part == "gate.weight":
        return torch.randn(p.shape, generator=generator) * router_std
    source = {"gate_up": "gate_up.weight", "down": "down.weight"}.get(part)
    if source is None:  # a parameter the dense model has no counterpart of (none expected)
        raise ValueError(f"upcycle: no dense counterpart for {name}")
    return dense[prefix + source].unsqueeze(0).expand(p.shape)
