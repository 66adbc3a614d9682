"""Drafter kinds: how each speculation mechanism becomes a forward the cost model can price.

Contract: ``draft_forward(drafter, target)`` returns the ModelSpec of ONE draft forward (one draft
position for every sequence), or None for model-free drafters whose cost is CPU time per sequence
(``DrafterSpec.cpu_s_per_seq`` and ``cpu_s_per_ctx_token``). ``catches_up(drafter)`` says whether
the kind's first forward of a round runs over all k + 1 verified positions of every sequence
(vLLM's EAGLE-3, MTP and draft-model proposers feed the target's hidden states / tokens of every
scheduled position) rather than one; ``in_one_forward(drafter)`` whether it drafts all k
positions in ONE forward of k + 1 query tokens per sequence (the block drafter, DFlash: nearly
flat in k where that forward is memory-bound) rather than k forwards. Kinds are registered
(``DRAFTER_KINDS``: a builder and those flags) and looked up by ``DrafterSpec.kind``; adding a
mechanism means adding one entry here, not branches in the cost model. A kind's per-position
acceptance shape is data (``DrafterSpec.position_ratio``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

from specrl.costmodel.specs import DrafterSpec, ModelSpec, load_model

Builder = Callable[[DrafterSpec, ModelSpec], ModelSpec | None]


def _layer_dense_params(target: ModelSpec) -> float:
    """Non-routed parameters of one target layer (attention, dense MLP or shared expert)."""
    embeddings = 2.0 * target.vocab * target.hidden
    return max(target.dense_params - embeddings, 0.0) / target.layers


def _eagle3(drafter: DrafterSpec, target: ModelSpec) -> ModelSpec:
    """EAGLE-3: fc over 3 target layers, ``layers`` decoder layers whose q/k/v read the token's
    embedding beside the hidden state (2H inputs), the LM head over the draft vocabulary."""
    return _feature_head("eagle3", drafter, target, qkv_inputs=2)


def _block(drafter: DrafterSpec, target: ModelSpec) -> ModelSpec:
    """DFlash (vLLM's ``DFlashDraftModel``): fc over 3 target layers, ``layers`` Qwen3 layers
    whose K/V projections also read the context, the LM head over the draft vocabulary."""
    return _feature_head("block", drafter, target, qkv_inputs=1)


def _feature_head(kind: str, drafter: DrafterSpec, target: ModelSpec, qkv_inputs: int) -> ModelSpec:
    """A head over the target's features: fc (3H -> H), ``drafter.layers`` decoder layers of
    the target's attention shape (q/k/v reading ``qkv_inputs`` x H), its MLP and LM head."""
    h, heads, kv, hd = target.hidden, target.heads, target.kv_heads, target.head_dim
    inter = drafter.intermediate or target.intermediate
    vocab = drafter.draft_vocab or target.vocab
    attention = qkv_inputs * h * (heads + 2 * kv) * hd + heads * hd * h
    params = 3 * h * h + drafter.layers * (attention + 3 * h * inter) + h * vocab
    return ModelSpec(name=f"{kind}[{target.name}]", layers=drafter.layers, hidden=h,
                     heads=heads, kv_heads=kv, head_dim=hd, vocab=vocab, intermediate=inter,
                     params_total=params, params_active=params)  # fmt: skip


def _mtp(drafter: DrafterSpec, target: ModelSpec) -> ModelSpec:
    h, vocab = target.hidden, target.vocab
    fixed = drafter.layers * (2 * h * h + _layer_dense_params(target)) + h * vocab
    per_layer_experts = target.experts * target.expert_params
    active_experts = target.experts_per_token * target.expert_params
    kv_per_layer = target.kv_bytes // target.layers
    return ModelSpec(
        name=f"mtp[{target.name}]",
        layers=drafter.layers,
        hidden=h,
        heads=target.heads,
        kv_heads=target.kv_heads,
        head_dim=target.head_dim,
        vocab=vocab,
        intermediate=target.intermediate,
        params_total=fixed + drafter.layers * per_layer_experts,
        params_active=fixed + drafter.layers * active_experts,
        experts=target.experts,
        experts_per_token=target.experts_per_token,
        shared_experts=target.shared_experts,
        moe_layers=drafter.layers if target.is_moe else 0,
        moe_intermediate=target.moe_intermediate,
        kv_bytes_per_token=kv_per_layer * drafter.layers,
    )


def _draft_model(drafter: DrafterSpec, target: ModelSpec) -> ModelSpec:
    return load_model(drafter.model)


def _model_free(drafter: DrafterSpec, target: ModelSpec) -> None:
    return None


@dataclass(frozen=True)
class DrafterKind:
    """How a kind drafts: the forward it runs, whether its first forward catches up on the
    k + 1 verified positions, and whether one forward drafts all k positions."""

    build: Builder
    catches_up: bool
    in_one_forward: bool = False


DRAFTER_KINDS: MappingProxyType[str, DrafterKind] = MappingProxyType(
    {
        "eagle3": DrafterKind(_eagle3, True),
        "block": DrafterKind(_block, False, in_one_forward=True),
        "mtp": DrafterKind(_mtp, True),
        "draft_model": DrafterKind(_draft_model, True),
        "ngram": DrafterKind(_model_free, False),
        "suffix": DrafterKind(_model_free, False),
    }
)


def _kind(drafter: DrafterSpec) -> DrafterKind:
    try:
        return DRAFTER_KINDS[drafter.kind]
    except KeyError:
        known = sorted(DRAFTER_KINDS)
        raise KeyError(f"unknown drafter kind {drafter.kind!r}; known: {known}") from None


def draft_forward(drafter: DrafterSpec, target: ModelSpec) -> ModelSpec | None:
    """The forward one draft position costs, or None for a model-free drafter."""
    return _kind(drafter).build(drafter, target)


def catches_up(drafter: DrafterSpec) -> bool:
    """Whether the kind's first draft forward runs over the k + 1 verified positions."""
    return _kind(drafter).catches_up


def in_one_forward(drafter: DrafterSpec) -> bool:
    """Whether the kind drafts all k positions in one forward of k + 1 tokens per sequence."""
    return _kind(drafter).in_one_forward
