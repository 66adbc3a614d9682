"""Architecture description of a Llama/Qwen-family decoder, read from a Hugging Face config.json.

Contract: ``ModelConfig`` is an immutable description of shapes and numerics; ``from_hf_dict``
accepts the fields Llama, Qwen2, Qwen3 and Mistral configs use, and the mixture-of-experts ones of
Qwen3-MoE, Qwen2-MoE (a gated shared expert) and Mixtral (top-k softmax router, experts of
``moe_intermediate_size``), and rejects what we do not implement with a clear ``ValueError``;
``to_hf_dict`` writes the config.json those loaders (transformers, vLLM) read back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# model_type -> the Hugging Face architecture class of config.json
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM"}  # fmt: skip
SUPPORTED_TYPES = tuple(ARCHITECTURES)
MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")
QK_NORM_TYPES = ("qwen3", "qwen3_moe")
QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")  # q/k/v biases unless the config says otherwise


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a decoder-only transformer."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # mixture of experts (num_experts 0: a dense MLP in every layer)
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts per token
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert (0: none)

    def __post_init__(self) -> None:
        if self.num_experts:
            self._check_moe()
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def _check_moe(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
            raise ValueError(
                "moe_intermediate_size and decoder_sparse_step must be positive, got "
                f"{self.moe_intermediate_size} and {self.decoder_sparse_step}"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a mixture of experts instead of a dense MLP."""
        if not self.num_experts or layer in self.mlp_only_layers:
            return False
        return (layer + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_parameters(self, active: bool = False) -> int:
        """Parameter count (embedding and LM head counted once when tied); ``active``: what one
        token uses (top-k of each MoE layer's experts, the router and any shared expert)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv) * self.attention_bias
        attn += 2 * self.head_dim * self.qk_norm
        mlp = sum(self._mlp_parameters(i, active) for i in range(self.num_layers))
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * (attn + 2 * h) + mlp + h + head

    def _mlp_parameters(self, layer: int, active: bool) -> int:
        h = self.hidden_size
        if not self.is_moe_layer(layer):
            return 3 * h * self.intermediate_size
        experts = self.num_experts_per_tok if active else self.num_experts
        shared = self.shared_expert_intermediate_size
        return (
            experts * 3 * h * self.moe_intermediate_size
            + self.num_experts * h
            + (3 * h * shared + h if shared else 0)
        )

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dictionary."""
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_TYPES)}"
            )
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        # transformers >= 5 stores theta and scaling together in "rope_parameters"
        rope = d.get("rope_parameters") or {}
        theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        bias = d.get("attention_bias", d.get("qkv_bias", model_type in QKV_BIAS_TYPES))
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=float(theta),
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(bias),
            qk_norm=model_type in QK_NORM_TYPES,
            model_type=model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            **(_moe_fields(d, model_type) if model_type in MOE_TYPES else {}),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json dictionary a Hugging Face loader accepts."""
        return self._dense_hf_dict() | (_moe_hf_fields(self) if self.is_moe else {})

    def _dense_hf_dict(self) -> dict[str, Any]:
        return {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
        }


def _moe_fields(d: dict[str, Any], model_type: str) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from a MoE config.json (Mixtral's experts are
    ``intermediate_size`` wide and always renormalise the top-k; transformers 5 writes
    ``num_local_experts`` where the Hub's Qwen configs say ``num_experts``)."""
    experts = d.get("num_experts", d.get("num_local_experts"))
    if not experts:
        return {}
    mixtral = model_type == "mixtral"
    width = d["intermediate_size"] if mixtral else d["moe_intermediate_size"]
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(d["num_experts_per_tok"]),
        moe_intermediate_size=int(width),
        norm_topk_prob=True if mixtral else bool(d.get("norm_topk_prob", False)),
        decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
        shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0),
    )


def _moe_hf_fields(c: ModelConfig) -> dict[str, Any]:
    """The mixture-of-experts fields of ``c``'s config.json, in its family's names."""
    if c.model_type == "mixtral":
        return {"num_local_experts": c.num_experts, "num_experts_per_tok": c.num_experts_per_tok,
                "intermediate_size": c.moe_intermediate_size}  # fmt: skip
    out = {
        "num_experts": c.num_experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "moe_intermediate_size": c.moe_intermediate_size,
        "norm_topk_prob": c.norm_topk_prob,
        "decoder_sparse_step": c.decoder_sparse_step,
        "mlp_only_layers": list(c.mlp_only_layers),
        "output_router_logits": False,
    }
    if c.model_type == "qwen2_moe":
        out["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size
    return out


def tiny_config(**overrides: Any) -> ModelConfig:
    """A tiny random-model config for tests and examples."""
    base = dict(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    base.update(overrides)
    return ModelConfig(**base)
