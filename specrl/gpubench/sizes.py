"""Every size of ``specrl bench gpu``: the random models' shapes, the GPU's sizes and smoke's.

Contract: pure data (``shape`` builds each model's ``ModelConfig`` on ``tiny_config``). ``GPU`` /
``SMOKE`` (``Sizes``) size the check's floors, learner, grpo and exactness sections; ``ENGINE_GPU``
/ ``ENGINE_SMOKE`` (``EngineSizes``) its engine section. The models have the shapes of real ones
(random weights: the GPU machine gets no checkpoint): Llama-3.1-8B (engine, calibrate), Llama-3.2-1B
(learner; RoPE without llama3 scaling, the same FLOPs), SmolLM2-360M (grpo); ``TINY`` (untied, like
the 8B) and ``TINY_TIED`` (tied, like the 1B and the 360M) stand in for them in smoke runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from specrl.models.config import ModelConfig, tiny_config


def shape(
    layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, head_dim: int, **more: Any
) -> ModelConfig:
    """A model of these shapes (``ffn``: the MLP's width), ``tiny_config``'s otherwise but for
    ``more`` (``ModelConfig``'s fields: the vocabulary, the context, RoPE, tied embeddings)."""
    sizes = {"num_layers": layers, "hidden_size": hidden, "intermediate_size": ffn}
    heads_of = {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim}
    return tiny_config(**sizes, **heads_of, **more)


LLAMA3 = {"vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0}
LLAMA_8B = shape(32, 4096, 14336, 32, 8, 128, **LLAMA3, tie_word_embeddings=False)
LLAMA_3_2_1B = shape(16, 2048, 8192, 32, 8, 64, **LLAMA3)
SMOLLM2_360M = shape(
    32, 960, 2560, 15, 5, 64, vocab_size=49152, max_position_embeddings=8192, rope_theta=1e5
)
TINY_TIED = shape(2, 64, 128, 4, 2, 16, vocab_size=512, max_position_embeddings=512)
TINY = replace(TINY_TIED, max_position_embeddings=4096, tie_word_embeddings=False)


@dataclass(frozen=True)
class Sizes:
    """The check's sizes but the engine section's (``EngineSizes``)."""

    budget_s: float  # the run's default budget (``run.budget_s`` unset)
    copy_bytes: int  # floors: the device-to-device copy
    gemm_n: int  # floors: the bf16 n^3 matmul
    floor_repeats: int
    learner_model: ModelConfig
    learner_groups: int  # GRPO groups of the learner batch
    learner_group: int  # sequences per group (one prompt)
    learner_prompt: int
    learner_completion: int
    micro_seqs: int  # sequences per micro-batch (both learners)
    learner_repeats: int
    grpo_model: ModelConfig
    prompts: int
    group: int
    grpo_prompt: int
    new_tokens: int
    grpo_steps: int  # timed steps, after one warm-up step
    exactness_k: str  # pytest -k
    exactness_timeout_s: float


GPU = Sizes(
    budget_s=390.0, copy_bytes=4 << 30, gemm_n=8192, floor_repeats=10,
    learner_model=LLAMA_3_2_1B, learner_groups=8, learner_group=8, learner_prompt=256,
    learner_completion=512, micro_seqs=16, learner_repeats=3,
    grpo_model=SMOLLM2_360M, prompts=8, group=8, grpo_prompt=64, new_tokens=128, grpo_steps=3,
    exactness_k="cuda", exactness_timeout_s=150,
)  # fmt: skip
SMOKE = Sizes(
    budget_s=300.0, copy_bytes=16 << 20, gemm_n=256, floor_repeats=3,
    learner_model=TINY_TIED, learner_groups=2, learner_group=2, learner_prompt=8,
    learner_completion=8, micro_seqs=2, learner_repeats=2,
    grpo_model=TINY_TIED, prompts=2, group=2, grpo_prompt=6, new_tokens=8, grpo_steps=1,
    exactness_k="cpu and greedy", exactness_timeout_s=240,
)  # fmt: skip


@dataclass(frozen=True)
class EngineSizes:
    """The engine section's sizes."""

    model: ModelConfig
    model_name: str  # the simulator's bundled spec ("" = write one beside the result)
    prompt: int  # tokens of the one prompt every row samples from (a GRPO group)
    batches: tuple[int, ...]  # decode points (a), in the order they run
    short_tokens: int  # (a): step time = (min T(long) - min T(short)) / (long - short)
    long_tokens: int
    repeats: int  # (a): timed (short, long) pairs after one warm-up long call
    transformers_batches: tuple[int, ...]  # (a) for transformers, in the order they run
    verify_points: tuple[tuple[int, int], ...]  # (b): (batch, k), in the order they run
    verify_tokens: int
    rollout_batches: tuple[int, ...]  # (c)
    rollout_tokens: int
    rollout_k: int
    acceptance_lengths: tuple[float, ...]  # (c): targets, emitted tokens per verify step


ENGINE_GPU = EngineSizes(
    LLAMA_8B, "llama-3.1-8b", prompt=512, batches=(1, 8, 64, 256), short_tokens=16,
    long_tokens=64, repeats=3, transformers_batches=(64, 8, 256, 1),
    verify_points=tuple((b, k) for b in (1, 64, 256) for k in (3, 5, 7)), verify_tokens=32,
    rollout_batches=(1, 64), rollout_tokens=256, rollout_k=5, acceptance_lengths=(2.0, 2.8, 3.3),
)  # fmt: skip
ENGINE_SMOKE = EngineSizes(
    TINY, "", prompt=16, batches=(1, 64), short_tokens=4, long_tokens=20, repeats=2,
    transformers_batches=(64,), verify_points=((1, 3),), verify_tokens=8,
    rollout_batches=(1, 8), rollout_tokens=64, rollout_k=3, acceptance_lengths=(2.0, 2.8, 3.3),
)  # fmt: skip
