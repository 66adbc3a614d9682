"""Step cost model: seconds for prefill, decode, draft and verify forwards of one engine replica.

``StepCostModel`` prices a forward of one replica of ``gpus`` GPUs as weight and KV bytes over
effective bandwidth + FLOPs over effective compute + TP/EP communication, for the busiest GPU,
plus the fixed floor of its layers (``layer_floor``);
a speculative step adds the drafter's forwards (or a model-free drafter's CPU time) and the
rejection sampler's per-logit cost. It covers MoE routing and expert parallelism, precision,
CUDA-graph limits and the engine terms ``prefill_group`` and ``draft_coverage``. All times in
seconds. The formulas: docs/internals.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from statistics import NormalDist

from specrl.costmodel.drafters import catches_up, draft_forward, in_one_forward
from specrl.costmodel.specs import DTYPE_BYTES, PRECISIONS, DrafterSpec, HardwareSpec, ModelSpec


def expected_experts(
    experts: int, top_k: int, tokens: float, popularity: Sequence[float] = ()
) -> float:
    """Expected distinct experts touched per layer when ``tokens`` tokens each pick ``top_k``:
    each expert independently, with its ``popularity`` (the chance a token picks it, summing to
    ``top_k``; () = uniform, top_k / experts each)."""
    if experts <= 0 or tokens <= 0:
        return 0.0
    if popularity:
        return sum(1.0 - (1.0 - min(q, 1.0)) ** tokens for q in popularity)
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def expected_max_normal(n: int) -> float:
    """Expected maximum of ``n`` standard normal draws (Blom's approximation; 0 for n = 1)."""
    if n <= 1:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def busiest_rank_experts(experts: int, top_k: int, tokens: float, ep: int) -> float:
    """Expected distinct experts touched on the busiest of ``ep`` ranks holding E/ep experts each
    (each expert touched independently with the uniform-routing probability)."""
    if experts <= 0 or tokens <= 0:
        return 0.0
    per_rank = experts / ep
    p = 1.0 - (1.0 - top_k / experts) ** tokens
    spread = math.sqrt(per_rank * p * (1.0 - p))
    return min(per_rank, per_rank * p + expected_max_normal(ep) * spread)


def busiest_rank_pairs(pairs: float, ep: int, skew: float = 1.0) -> float:
    """Expected token-expert pairs on the busiest of ``ep`` ranks: a binomial share of ``pairs``
    routed uniformly, times ``skew`` (hot experts), at most all of them."""
    if pairs <= 0:
        return 0.0
    share = pairs / ep
    spread = math.sqrt(pairs * (1.0 / ep) * (1.0 - 1.0 / ep))
    return min(pairs, (share + expected_max_normal(ep) * spread) * skew)


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
class Layout:
    """How a replica holds the model: GPUs, expert parallelism, weight precision, routing."""

    gpus: int = 1
    ep: int = 1  # expert-parallel degree (1: experts tensor-parallel over the gpus)
    precision: str = "bf16"
    locality: float = 0.0  # chance a sequence's extra verify tokens reuse its experts
    skew: float = 1.0  # busiest rank's token load over a uniform router's


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


def weight_bytes_read(model: ModelSpec, tokens: float, layout: Layout | None = None) -> float:
    """Bytes of weights the busiest GPU of the replica streams for ``tokens`` routed tokens, times
    the replica's GPUs (so that dividing by gpus gives that GPU's share; the whole replica's
    bytes for balanced sharding): ``dense_bytes_read`` + ``expert_bytes_read``."""
    return dense_bytes_read(model, layout) + expert_bytes_read(model, tokens, layout)


def dense_bytes_read(model: ModelSpec, layout: Layout | None = None) -> float:
    """Bytes of the weights every forward reads whatever its routing."""
    return model.dense_params * PRECISIONS[(layout or Layout()).precision].weight_bytes


def expert_bytes_read(model: ModelSpec, tokens: float, layout: Layout | None = None) -> float:
    """Bytes of the routed experts ``tokens`` routed tokens are expected to touch (the busiest
    rank's under expert parallelism; the model's measured ``expert_popularity`` if any, else
    uniform routing); 0 for a dense model."""
    if not model.is_moe:
        return 0.0
    layout = layout or Layout()
    per_param = PRECISIONS[layout.precision].weight_bytes
    # under expert parallelism the busiest rank's experts, as if every rank read that many
    distinct = touched_experts(model, tokens, layout) * layout.ep
    return model.moe_layers * distinct * model.expert_params * per_param


def touched_experts(model: ModelSpec, tokens: float, layout: Layout | None = None) -> float:
    """Expected routed experts per MoE layer that ``tokens`` routed tokens touch on the busiest
    GPU: all distinct ones under tensor parallelism (each GPU runs a slice of every one), the
    busiest rank's under expert parallelism; 0 for a dense model."""
    if not model.is_moe or tokens <= 0:
        return 0.0
    layout = layout or Layout()
    if layout.ep > 1:
        return busiest_rank_experts(model.experts, model.experts_per_token, tokens, layout.ep)
    return expected_experts(model.experts, model.experts_per_token, tokens,
                            model.expert_popularity)  # fmt: skip


def kv_bytes_read(model: ModelSpec, shape: ForwardShape) -> float:
    return shape.n_seqs * shape.context * model.kv_bytes


def attention_flops(model: ModelSpec, shape: ForwardShape) -> float:
    """Attention FLOPs (QK and PV) over the mean attended length, context + half the new tokens."""
    attended = shape.context + 0.5 * shape.tokens_per_seq
    return shape.tokens * 4.0 * model.layers * model.heads * model.head_dim * attended


def expert_flops_per_pair(model: ModelSpec) -> float:
    """FLOPs of one token through one routed expert in every MoE layer."""
    return 2.0 * model.expert_params * model.moe_layers


def forward_flops(model: ModelSpec, shape: ForwardShape) -> float:
    """Matmul FLOPs plus attention FLOPs of the whole replica."""
    return shape.tokens * 2.0 * model.params_active + attention_flops(model, shape)


def busiest_gpu_flops(model: ModelSpec, shape: ForwardShape, layout: Layout) -> float:
    """FLOPs of the busiest GPU: an even share of the dense part, the busiest rank's experts."""
    total = forward_flops(model, shape)
    if not model.is_moe or layout.ep <= 1:
        return total / layout.gpus
    pairs = shape.tokens * model.experts_per_token
    experts = pairs * expert_flops_per_pair(model)
    busiest = busiest_rank_pairs(pairs, layout.ep, layout.skew) * expert_flops_per_pair(model)
    return (total - experts) / layout.gpus + busiest


def _link(hw: HardwareSpec, gpus: int) -> float:
    return hw.intra_node_bandwidth if gpus <= hw.gpus_per_node else hw.scale_out_bandwidth


def all_reduce_time(hw: HardwareSpec, gpus: int, nbytes: float, span: int = 0) -> float:
    """One ring all-reduce of ``nbytes`` across ``gpus`` GPUs: latency plus the ring's bytes, over
    NVLink unless the GPUs it ``span``s (default: ``gpus``) exceed a node."""
    if gpus <= 1:
        return 0.0
    return hw.comm_latency_s + 2.0 * (gpus - 1) / gpus * nbytes / _link(hw, span or gpus)


def all_to_all_time(hw: HardwareSpec, ep: int, nbytes: float) -> float:
    """One dispatch (or combine) of ``nbytes`` per GPU to the other ``ep`` - 1 ranks: latency
    plus the slower of the share staying on NVLink and the share crossing nodes."""
    if ep <= 1:
        return 0.0
    local = min(ep, hw.gpus_per_node)
    intra = nbytes * (local - 1) / ep
    inter = nbytes * (ep - local) / ep
    wire = max(intra / hw.intra_node_bandwidth, inter / hw.scale_out_bandwidth)
    return hw.a2a_latency_s + wire / hw.a2a_efficiency


def comm_time(model: ModelSpec, hw: HardwareSpec, gpus: int, tokens: float, ep: int = 1) -> float:
    """TP all-reduces (attention and dense MLP outputs) and, with ep > 1, one dispatch and one
    combine all-to-all per MoE layer instead of its MLP all-reduce."""
    activations = tokens * model.hidden * DTYPE_BYTES
    if ep <= 1 or not model.is_moe:
        return 2 * model.layers * all_reduce_time(hw, gpus, activations)
    pairs_per_gpu = tokens / ep * model.experts_per_token * model.hidden * DTYPE_BYTES
    a2a = 2 * all_to_all_time(hw, ep, pairs_per_gpu)
    dense_layers = model.layers - model.moe_layers
    reduce = all_reduce_time(hw, gpus, activations)
    return model.layers * reduce + dense_layers * reduce + model.moe_layers * a2a


def forward_cost(
    model: ModelSpec,
    hw: HardwareSpec,
    gpus: int,
    shape: ForwardShape,
    overhead_s: float = 0.0,
    locality: float = 0.0,
    layout: Layout | None = None,
) -> ForwardCost:
    """Price one forward of ``model`` on a replica of ``gpus`` GPUs (``layout`` adds expert
    parallelism, precision and routing skew; its ``gpus`` and ``locality`` are overridden)."""
    base = layout or Layout()
    layout = Layout(gpus, base.ep, base.precision, locality, base.skew)
    routed = routed_tokens(shape, locality)
    mem_bytes = dense_bytes_read(model, layout) + kv_bytes_read(model, shape)
    experts = expert_bytes_read(model, routed, layout)
    peak = hw.peak(layout.precision)
    bandwidth = gpus * hw.hbm_bandwidth
    return ForwardCost(
        memory_s=mem_bytes / (bandwidth * hw.eta_mem)
        + experts / (bandwidth * (hw.eta_expert_mem or hw.eta_mem)),
        compute_s=busiest_gpu_flops(model, shape, layout) / (peak * hw.eta_compute),
        comm_s=comm_time(model, hw, gpus, shape.tokens, layout.ep),
        overhead_s=overhead_s + layer_floor(model, hw, routed, layout),
    )


def layer_floor(
    model: ModelSpec, hw: HardwareSpec, routed: float = 0.0, layout: Layout | None = None
) -> float:
    """Fixed seconds of one forward beyond its bytes and FLOPs, the same on every GPU of a
    tensor-parallel replica: ``layer_s`` per decoder layer, ``moe_layer_s`` more per MoE layer
    and ``expert_s`` per routed expert the ``routed`` tokens touch in each MoE layer."""
    experts = model.moe_layers * touched_experts(model, routed, layout) * hw.expert_s
    return model.layers * hw.layer_s + model.moe_layers * hw.moe_layer_s + experts


@dataclass(frozen=True)
class StepCostModel:
    """Engine-step costs for one replica: a target model, optionally a drafter, on ``gpus`` GPUs.

    ``tree_width`` draft tokens per sequence per draft step and ``tree_verify_tokens`` verified
    tokens per sequence describe tree speculation (SGLang EAGLE topk / num_draft_tokens); the
    defaults (1, 0) are chain speculation verifying k+1 tokens. ``routing_locality`` is the
    chance that a sequence's extra verify tokens reuse its experts (MoE only; 0 = uniform).
    ``prefill_group`` and ``draft_coverage`` are the engine terms of docs/internals.md
    (1 and () = every sequence prefills its own prompt and drafts all k positions). ``ep``,
    ``precision`` and ``routing_skew`` are the layout terms (1, bf16, 1: tensor-parallel experts,
    bf16 weights, uniform routing).
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
    ep: int = 1
    precision: str = "bf16"
    routing_skew: float = 1.0

    @cached_property
    def draft_model(self) -> ModelSpec | None:
        return draft_forward(self.drafter, self.target) if self.drafter else None

    @cached_property
    def layout(self) -> Layout:
        return Layout(self.gpus, self.ep, self.precision, self.routing_locality, self.routing_skew)

    def eager(self, tokens: float, layers: int) -> float:
        """Host launch time of a forward of ``tokens`` query tokens through ``layers`` decoder
        layers when it is wider than the largest captured graph (0 when graphed)."""
        cap = self.hw.graph_capture_tokens
        return layers * self.hw.eager_s_per_layer if cap and tokens > cap else 0.0

    def target_forward(self, n_seqs: float, tokens_per_seq: float, context: float) -> float:
        shape = ForwardShape(n_seqs, tokens_per_seq, context)
        cost = forward_cost(
            self.target, self.hw, self.gpus, shape, 0.0, self.routing_locality, self.layout
        )
        return cost.total + self.eager(shape.tokens, self.target.layers)

    def decode(self, n_seqs: float, context: float) -> float:
        """One plain decode step: overhead plus a one-token forward for every sequence."""
        return self.hw.step_overhead_s + self.target_forward(n_seqs, 1, context)

    def verify_tokens(self, k: int, n_seqs: float = 1.0) -> float:
        """Query tokens per sequence of a verify forward (padded to the batch's longest draft)."""
        if self.tree_verify_tokens or not self.draft_coverage:
            return self.tree_verify_tokens or k + 1
        cov = self.draft_coverage
        return 1.0 + sum(1.0 - (1.0 - cov[min(i, len(cov) - 1)]) ** n_seqs for i in range(k))

    def sampler(self, n_seqs: float, tokens_per_seq: float) -> float:
        """Rejection sampling and logprobs over the vocabulary at every verified position."""
        return n_seqs * tokens_per_seq * self.target.vocab * self.hw.verify_s_per_logit

    def verify(self, n_seqs: float, k: int, context: float) -> float:
        """Target forward over the k drafts plus one position per sequence, and the rejection
        sampler over their logits (no step overhead)."""
        tokens = self.verify_tokens(k, n_seqs)
        forward = self.target_forward(n_seqs, tokens, context)
        return forward + self.sampler(n_seqs, tokens) + self.hw.verify_overhead_s

    def draft_forward(self, n_seqs: float, tokens_per_seq: float, context: float) -> float:
        """One forward of the draft network (its overhead, weights, own KV cache and FLOPs)."""
        shape = ForwardShape(n_seqs, tokens_per_seq, context)
        model = self.draft_model
        assert model is not None
        cost = forward_cost(model, self.hw, self.gpus, shape, self.hw.forward_overhead_s)
        return cost.total + self.eager(shape.tokens, model.layers)

    def draft(self, n_seqs: float, k: int, context: float) -> float:
        """Drafting k positions per sequence: k drafter forwards (the first over the k + 1
        verified positions for kinds that catch up), one forward of k + 1 tokens (a block
        drafter), or CPU time if model-free."""
        if self.drafter is None or k == 0:
            return 0.0
        if self.draft_model is None:
            per_seq = self.drafter.cpu_s_per_seq + self.drafter.cpu_s_per_ctx_token * context
            return per_seq * n_seqs
        if in_one_forward(self.drafter):  # the block: the last token and k mask slots
            return self.draft_forward(n_seqs, k + 1, context)
        width = self.tree_width
        first = k + 1 if catches_up(self.drafter) else width
        rest = (k - 1) * self.draft_forward(n_seqs, width, context) if k > 1 else 0.0
        return self.draft_forward(n_seqs, first, context) + rest

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
        extra = 0.0
        if self.hw.prefill_s_per_flop:
            shape = ForwardShape(prompts, prompt_len, context)
            extra = self.hw.prefill_s_per_flop * forward_flops(self.target, shape)
        return self.hw.step_overhead_s + self.target_forward(prompts, prompt_len, context) + extra

    def weight_bytes(self) -> float:
        """Bytes of the replica's weights: the target at its precision, the drafter in bf16."""
        draft = self.draft_model
        target = self.target.weight_bytes_at(self.precision)
        return target + (draft.weight_bytes if draft else 0.0)

    def kv_capacity_tokens(self) -> float:
        """Context tokens that fit in the KV cache after weights (target and drafter)."""
        usable = self.hw.hbm_bytes * self.hw.mem_fraction * self.gpus
        draft = self.draft_model
        per_token = self.target.kv_bytes + (draft.kv_bytes if draft else 0)
        return max(usable - self.weight_bytes(), 0.0) / per_token
