"""Step cost model: seconds for prefill, decode, draft and verify forwards of one engine replica.

Contract (all times in seconds, one replica of ``gpus`` GPUs holding one copy of the model):

    T_forward = (W_read + KV_read) / (gpus * BW * eta_mem)          memory term
              + FLOPs / (gpus * P * eta_compute)                    compute term
              + T_comm                                              TP/EP collectives
    T_step    = step_overhead + [draft(k)] + T_forward(target, tokens_per_seq = 1 or k+1)
              + [n_seqs * (k+1) * vocab * verify_s_per_logit]       rejection sampler
    T_prefill = step_overhead + T_forward(target, n_seqs / prefill_group prompts, prompt tokens)

W_read is every dense weight plus, for MoE, the expected number of distinct experts per layer for
the T routed tokens of the forward, E * (1 - (1 - k_e/E)^T) (uniform routing; real routing is
correlated, so this is an upper bound; ``routing_locality`` lets a sequence's k extra verify tokens
count as k * (1 - locality) independent tokens). KV_read is the context of every sequence, read
once per forward whatever the number of query tokens per sequence. FLOPs are 2 * N_active per
token plus attention (4 * layers * heads * head_dim per token per context token). T_comm is two ring
all-reduces per layer of the token activations, latency plus bytes over NVLink (or the scale-out
link when a replica spans nodes). The form is additive (Vidur-style), matching the published vLLM
Llama-3.1-8B step fit; calibrate.py fits its efficiency terms to measured traces.

Three engine terms default to no effect (the GPU scenarios do not use them; this machine's
calibration does): the hardware's ``verify_s_per_logit`` prices the rejection sampler's work over
the vocabulary at every verified position beyond a plain step's sampling; ``prefill_group``
sequences share one prompt, prefilled once and its cache forked (GRPO groups in specrl's engine;
prefix caching in vLLM); ``draft_coverage`` gives, per draft position, the chance a sequence
drafts there at all (n-gram / suffix drafters propose short or empty drafts), and the verify
forward is as wide as the batch's longest draft, in expectation 1 + sum_i (1 - (1 - c_i)^n)
tokens per sequence for n independent sequences (k+1 replaces this in the formula above).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from specrl.sim.drafters import draft_forward
from specrl.sim.specs import DTYPE_BYTES, DrafterSpec, HardwareSpec, ModelSpec


def expected_experts(experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts touched per layer when ``tokens`` tokens each pick ``top_k``."""
    if experts <= 0 or tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


@dataclass(frozen=True)
class ForwardShape:
    """One forward: ``n_seqs`` sequences, each adding ``tokens_per_seq`` query tokens to a context
    of ``context`` tokens already in the KV cache."""

    n_seqs: float
    tokens_per_seq: float
    context: float

    @property
    def tokens(self) -> float:
        return self.n_seqs * self.tokens_per_seq


@dataclass(frozen=True)
class ForwardCost:
    """Per-term breakdown of one forward; ``total`` is what the simulator charges."""

    memory_s: float
    compute_s: float
    comm_s: float
    overhead_s: float

    @property
    def total(self) -> float:
        return self.memory_s + self.compute_s + self.comm_s + self.overhead_s


def routed_tokens(shape: ForwardShape, locality: float = 0.0) -> float:
    """Independently routed tokens: a sequence's extra query tokens reuse its first token's
    experts with probability ``locality`` (0: uniform independent routing, the upper bound)."""
    return shape.n_seqs * (1.0 + (shape.tokens_per_seq - 1.0) * (1.0 - locality))


def weight_bytes_read(model: ModelSpec, tokens: float) -> float:
    """Bytes of weights a forward over ``tokens`` routed tokens must stream (whole replica)."""
    routed = 0.0
    if model.is_moe:
        distinct = expected_experts(model.experts, model.experts_per_token, tokens)
        routed = model.moe_layers * distinct * model.expert_params
    return (model.dense_params + routed) * DTYPE_BYTES


def kv_bytes_read(model: ModelSpec, shape: ForwardShape) -> float:
    return shape.n_seqs * shape.context * model.kv_bytes


def forward_flops(model: ModelSpec, shape: ForwardShape) -> float:
    """Matmul FLOPs plus attention FLOPs (mean attended length: context + half the new tokens)."""
    attended = shape.context + 0.5 * shape.tokens_per_seq
    attention = 4.0 * model.layers * model.heads * model.head_dim * attended
    return shape.tokens * (2.0 * model.params_active + attention)


def comm_time(model: ModelSpec, hw: HardwareSpec, gpus: int, tokens: float) -> float:
    """Two ring all-reduces per layer of the [tokens, hidden] activations across the replica."""
    if gpus <= 1:
        return 0.0
    bandwidth = hw.intra_node_bandwidth if gpus <= hw.gpus_per_node else hw.scale_out_bandwidth
    ring_bytes = 2.0 * (gpus - 1) / gpus * tokens * model.hidden * DTYPE_BYTES
    return 2 * model.layers * (hw.comm_latency_s + ring_bytes / bandwidth)


def forward_cost(
    model: ModelSpec,
    hw: HardwareSpec,
    gpus: int,
    shape: ForwardShape,
    overhead_s: float = 0.0,
    locality: float = 0.0,
) -> ForwardCost:
    """Price one forward of ``model`` on a replica of ``gpus`` GPUs."""
    routed = routed_tokens(shape, locality)
    mem_bytes = weight_bytes_read(model, routed) + kv_bytes_read(model, shape)
    return ForwardCost(
        memory_s=mem_bytes / (gpus * hw.hbm_bandwidth * hw.eta_mem),
        compute_s=forward_flops(model, shape) / (gpus * hw.peak_flops * hw.eta_compute),
        comm_s=comm_time(model, hw, gpus, shape.tokens),
        overhead_s=overhead_s,
    )


@dataclass(frozen=True)
class StepCostModel:
    """Engine-step costs for one replica: a target model, optionally a drafter, on ``gpus`` GPUs.

    ``tree_width`` draft tokens per sequence per draft step and ``tree_verify_tokens`` verified
    tokens per sequence describe tree speculation (SGLang EAGLE topk / num_draft_tokens); the
    defaults (1, 0) are chain speculation verifying k+1 tokens. ``routing_locality`` is the
    chance that a sequence's extra verify tokens reuse its experts (MoE only; 0 = uniform).
    ``prefill_group`` and ``draft_coverage`` are the engine terms of the module docstring
    (1 and () = every sequence prefills its own prompt and drafts all k positions).
    """

    target: ModelSpec
    hw: HardwareSpec
    gpus: int = 1
    drafter: DrafterSpec | None = None
    tree_width: int = 1
    tree_verify_tokens: int = 0
    routing_locality: float = 0.0
    prefill_group: int = 1
    draft_coverage: tuple[float, ...] = ()

    @cached_property
    def draft_model(self) -> ModelSpec | None:
        return draft_forward(self.drafter, self.target) if self.drafter else None

    def target_forward(self, n_seqs: float, tokens_per_seq: float, context: float) -> float:
        shape = ForwardShape(n_seqs, tokens_per_seq, context)
        return forward_cost(
            self.target, self.hw, self.gpus, shape, 0.0, self.routing_locality
        ).total

    def decode(self, n_seqs: float, context: float) -> float:
        """One plain decode step: overhead plus a one-token forward for every sequence."""
        return self.hw.step_overhead_s + self.target_forward(n_seqs, 1, context)

    def verify_tokens(self, k: int, n_seqs: float = 1.0) -> float:
        """Query tokens per sequence of a verify forward (padded to the batch's longest draft)."""
        if self.tree_verify_tokens or not self.draft_coverage:
            return self.tree_verify_tokens or k + 1
        cov = self.draft_coverage
        return 1.0 + sum(1.0 - (1.0 - cov[min(i, len(cov) - 1)]) ** n_seqs for i in range(k))

    def verify(self, n_seqs: float, k: int, context: float) -> float:
        """Target forward over the k drafts plus one position per sequence, and the rejection
        sampler over their logits (no step overhead)."""
        tokens = self.verify_tokens(k, n_seqs)
        sampler = n_seqs * tokens * self.target.vocab * self.hw.verify_s_per_logit
        return self.target_forward(n_seqs, tokens, context) + sampler

    def draft(self, n_seqs: float, k: int, context: float) -> float:
        """Drafting k positions per sequence: k drafter forwards, or CPU time if model-free."""
        if self.drafter is None or k == 0:
            return 0.0
        model = self.draft_model
        if model is None:
            return self.drafter.cpu_s_per_seq * n_seqs
        shape = ForwardShape(n_seqs, self.tree_width, context)
        one = forward_cost(model, self.hw, self.gpus, shape, self.hw.forward_overhead_s)
        return k * one.total

    def step(self, n_seqs: float, k: int, context: float) -> float:
        """One engine step with k drafts per sequence (k = 0 is plain decoding)."""
        if k == 0 or self.drafter is None:
            return self.decode(n_seqs, context)
        draft = self.draft(n_seqs, k, context)
        return self.hw.step_overhead_s + draft + self.verify(n_seqs, k, context)

    def prefill(self, n_seqs: float, prompt_len: float, context: float = 0.0) -> float:
        """Prefill of ``prompt_len`` new tokens for each of ``n_seqs`` sequences (one forward per
        group of ``prefill_group`` sequences sharing a prompt)."""
        if n_seqs <= 0:
            return 0.0
        prompts = math.ceil(n_seqs / self.prefill_group)
        return self.hw.step_overhead_s + self.target_forward(prompts, prompt_len, context)

    def kv_capacity_tokens(self) -> float:
        """Context tokens that fit in the KV cache after weights (target and drafter)."""
        usable = self.hw.hbm_bytes * self.hw.mem_fraction * self.gpus
        draft = self.draft_model
        weights = self.target.weight_bytes + (draft.weight_bytes if draft else 0.0)
        per_token = self.target.kv_bytes + (draft.kv_bytes if draft else 0)
        return max(usable - weights, 0.0) / per_token
