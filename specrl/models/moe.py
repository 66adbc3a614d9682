"""Mixture-of-experts feed-forward of Qwen3-MoE / Qwen2-MoE / Mixtral decoders.

Contract: ``MoE(config)`` maps [B, T, H] to [B, T, H] as Hugging Face's sparse MoE blocks do: a
router (``gate``, computed in float32) softmaxes over ``num_experts``, each token takes its top-k
experts (weights renormalised when ``norm_topk_prob``), each expert is a SwiGLU MLP, and the
outputs are summed by weight; Qwen2-MoE adds a sigmoid-gated shared expert. Expert weights are
stored stacked (``gate_up`` [E, 2I, H], ``down`` [E, H, I], Hugging Face's row layout per
expert). Tokens are grouped by expert (one stable sort), then multiplied by the first of: bf16
inference on a CPU with the native kernel (``specrl.kernels.gemv``: one packed copy of the
experts, rebuilt when they change, batch-invariant products, as ``models.linear.Linear``), one
per active expert; without autograd where it runs, one grouped GEMM per projection
(``torch._grouped_mm``, no host read); else one GEMM per active expert (the counts read on the
host), or in a static step off the CPU (``host_reads=False``: capturable) every expert on
every token, weighted by a dense [N, E] mix. A ``Routing`` handed in records each token's
experts (routing replay's source) or imposes them (the learner replaying a rollout's routing).
Details: docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from specrl.kernels import gemv
from specrl.kernels.hugepages import huge_zeros
from specrl.models.config import ModelConfig
from specrl.models.linear import Linear

ROUTE_DTYPE = torch.int16  # recorded expert ids: E <= 32767


@dataclass
class Routing:
    """Routing of one forward, shared by its MoE layers (the i-th MoE layer is ``index`` i).

    ``replay`` [N, moe_layers, top_k] (N = the forward's B * T tokens in row order): experts each
    token must use (the router still weighs them; a row of -1 routes that token freely);
    ``record``: keep each layer's chosen experts in ``recorded`` and, with ``statistics``, its
    router statistics in ``load`` (tokens per expert) and ``aux`` (the load-balancing loss
    term)."""

    replay: torch.Tensor | None = None
    record: bool = False
    statistics: bool = True  # with ``record``: ``load`` and ``aux`` too (the learner's)
    recorded: list[torch.Tensor] = field(default_factory=list)  # per MoE layer [N, top_k]
    load: list[torch.Tensor] = field(default_factory=list)  # per MoE layer [E] token counts
    aux: list[torch.Tensor] = field(default_factory=list)  # per MoE layer, a scalar

    @classmethod
    def experts_of(cls, config: ModelConfig) -> Routing | None:
        """A forward's recorder of the experts alone (an engine's), None for a dense model."""
        return cls(record=True, statistics=False) if config.is_moe else None

    def forced(self, index: int) -> torch.Tensor | None:
        """[N, top_k] experts MoE layer ``index`` must use, or None."""
        return None if self.replay is None else self.replay[:, index]

    def keep(self, experts: torch.Tensor, probs: torch.Tensor) -> None:
        """Record a layer's experts [N, top_k] and router probabilities [N, E]."""
        if not self.record:
            return
        self.recorded.append(experts.to(ROUTE_DTYPE))
        if not self.statistics:
            return
        e = probs.shape[-1]
        counts = expert_counts(experts, e)  # [E]
        self.load.append(counts)
        share = counts.float() / max(experts.numel(), 1)  # fraction of routed pairs per expert
        self.aux.append(e * (share.detach() * probs.mean(0)).sum())

    def experts(self) -> torch.Tensor:
        """Every recorded layer's experts stacked: [N, moe_layers, top_k]."""
        return torch.stack(self.recorded, dim=1)

    def summary(self) -> tuple[dict[str, float], torch.Tensor]:
        """The recorded router statistics: the busiest expert's load over the mean load in the
        most unbalanced MoE layer (``moe_load_max``; 1 = balanced) and the load-balancing loss
        averaged over the layers (``moe_aux_loss``, also returned as a tensor with its
        gradient)."""
        loads = torch.stack(self.load).float()  # [moe_layers, E]
        balance = (loads.max(-1).values / loads.mean(-1).clamp(min=1e-9)).max()
        aux = torch.stack(self.aux).mean()
        return {"moe_load_max": float(balance), "moe_aux_loss": float(aux.detach())}, aux


class NativeExperts(NamedTuple):
    """The native kernel with the experts packed for it ([E, ...] each, ``gemv`` layout)."""

    kernel: gemv.GemvKernel
    gate_up: torch.Tensor
    down: torch.Tensor

    def mlp(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s SwiGLU of rows [M, H] bf16 -> [M, H] (batch-invariant products)."""
        kernel, two_i, h = self.kernel, self.gate_up.shape[1] * 16, self.down.shape[1] * 16
        return kernel.matmul(kernel.silu_mul(kernel.matmul(rows, self.gate_up[e], two_i)),
                             self.down[e], h)  # fmt: skip


class MoE(nn.Module):
    """Router + stacked SwiGLU experts (+ an optional gated shared expert); ``native`` (see
    ``models.transformer.set_native_kernels``): the native kernel where it applies."""

    native: bool = True
    _packed: tuple[tuple, NativeExperts] | None = None  # (the experts' key, their packed copy)

    def __init__(self, c: ModelConfig, index: int) -> None:
        super().__init__()
        self.index, self.top_k, self.norm = index, c.num_experts_per_tok, c.norm_topk_prob
        e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.gate = nn.Linear(h, e, bias=False)
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down = nn.Parameter(torch.empty(e, h, i))
        nn.init.normal_(self.gate_up, std=h**-0.5)
        nn.init.normal_(self.down, std=i**-0.5)
        self.shared = c.shared_expert_intermediate_size  # its width; 0: none
        if self.shared:
            self.shared_gate_up = Linear(h, 2 * self.shared, bias=False)
            self.shared_down = Linear(self.shared, h, bias=False)
            self.shared_gate = Linear(h, 1, bias=False)

    def route(self, x: torch.Tensor, routing: Routing | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts [N, top_k] int64 and their weights [N, top_k] (x's dtype) for tokens x [N, H]:
        the router in float32, the top-k of its softmax or the replayed experts."""
        probs = F.linear(x.float(), self.gate.weight.float()).softmax(-1)  # [N, E]
        weights, experts = probs.topk(self.top_k, dim=-1)  # [N, k] each
        forced = routing.forced(self.index) if routing is not None else None
        if forced is not None:  # a row of -1: that token routes freely
            forced = forced.to(device=x.device, dtype=torch.int64)
            experts = torch.where(forced[:, :1] >= 0, forced, experts)
            weights = probs.gather(-1, experts)
        if self.norm:
            weights = weights / weights.sum(-1, keepdim=True)
        if routing is not None:
            routing.keep(experts, probs)
        return experts, weights.to(x.dtype)

    def forward(
        self, x: torch.Tensor, routing: Routing | None = None, host_reads: bool = True
    ) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]; ``host_reads=False`` in static steps (see module)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, H]
        experts, weights = self.route(flat, routing)
        native = self.native_experts(flat)
        out = expert_mlp(flat, experts, weights, self.gate_up, self.down, host_reads, native)
        if self.shared:
            shared = self.shared_down(_swiglu(self.shared_gate_up(flat)))  # [N, H]
            out = out + torch.sigmoid(self.shared_gate(flat)) * shared
        return out.reshape(shape)

    def native_experts(self, x: torch.Tensor) -> NativeExperts | None:
        """The experts packed for the native kernel when it takes x [N, H] (bf16 CPU inference,
        shapes it packs), packed now if they changed since; else None."""
        kernel = gemv.native_bf16(x, self.gate_up, self.down) if self.native else None
        if kernel is None or not (kernel.fits(self.gate_up[0]) and kernel.fits(self.down[0])):
            return None
        key = tuple((w.data_ptr(), w._version) for w in (self.gate_up, self.down))
        if self._packed is None or self._packed[0] != key:
            self._packed = None  # drop the old copy before packing the new one
            packed = [_packed_stack(kernel, w) for w in (self.gate_up, self.down)]
            self._packed = (key, NativeExperts(kernel, *packed))
        return self._packed[1]


def _packed_stack(kernel: gemv.GemvKernel, weights: torch.Tensor) -> torch.Tensor:
    """[E, N, K] -> [E, *packed [N, K]]: the experts packed into one allocation (on huge pages
    where granted: decoding streams them)."""
    out = huge_zeros((weights.shape[0], *kernel.packed_shape(weights[0])), weights.dtype)
    for e, w in enumerate(weights):
        kernel.pack(w, out[e])
    return out


def expert_mlp(
    x: torch.Tensor,  # [N, H]
    experts: torch.Tensor,  # [N, k] int64
    weights: torch.Tensor,  # [N, k]
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
    host_reads: bool = True,
    native: NativeExperts | None = None,
) -> torch.Tensor:
    """sum_j weights[n, j] * SwiGLU_{experts[n, j]}(x[n]) -> [N, H], tokens grouped by expert
    (``host_reads=False``: nothing read on the host off the CPU; ``native``: the experts packed
    for the native kernel; see the module)."""
    if native is not None and experts.shape[0] == 1:  # one token (batch-1 decoding)
        return _one_token_native(x, experts, weights, native)
    grouped = native is None and _grouped_runs(x, gate_up, down)
    if not (grouped or host_reads or x.device.type == "cpu"):
        return _dense(x, experts, weights, gate_up, down)
    k = experts.shape[1]
    flat = experts.reshape(-1)  # [N*k]
    order = flat.argsort(stable=True)  # [N*k] (token, slot) pairs sorted by expert
    token = order // k  # [N*k] the token of each sorted pair
    counts = expert_counts(experts, gate_up.shape[0])  # [E]
    xs = x[token]  # [N*k, H]
    if grouped:
        ys = _grouped(xs, counts, gate_up, down)  # [N*k, H]
    else:
        ys = _per_expert(xs, counts, native.mlp if native else partial(_swiglu_mlp, gate_up, down))
    ys = ys * weights.reshape(-1)[order].unsqueeze(-1)  # [N*k, H]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # each token's k summed
    return out.index_add_(0, token, ys.float()).to(x.dtype)  # in float32, rounded once


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routed (token, slot) pairs per expert [E] int64 from experts [N, k] (no host read,
    unlike ``torch.bincount`` on CUDA)."""
    ones = torch.ones(experts.numel(), dtype=torch.int64, device=experts.device)
    zeros = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    return zeros.scatter_add_(0, experts.reshape(-1).to(torch.int64), ones)


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _grouped_runs(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these: no autograd (its CPU backward fails), rows
    16-byte aligned, on CUDA bf16 only."""
    if torch.is_grad_enabled() and (x.requires_grad or gate_up.requires_grad):
        return False
    if not hasattr(torch, "_grouped_mm") or x.device.type not in ("cpu", "cuda"):
        return False
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    size = x.element_size()
    return all(d * size % 16 == 0 for d in (gate_up.shape[-1], down.shape[-1], down.shape[-2]))


def _grouped(
    xs: torch.Tensor,  # [M, H] sorted by expert
    counts: torch.Tensor,  # [E]
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
) -> torch.Tensor:
    """Both projections as grouped GEMMs over the experts' row ranges (device offsets)."""
    offs = counts.cumsum(0).to(torch.int32)  # [E] end of each expert's rows
    hidden = torch._grouped_mm(xs, gate_up.transpose(-2, -1), offs=offs)  # [M, 2I]
    return torch._grouped_mm(_swiglu(hidden), down.transpose(-2, -1), offs=offs)  # [M, H]


def _one_token_native(
    x: torch.Tensor,  # [1, H] bf16
    experts: torch.Tensor,  # [1, k]
    weights: torch.Tensor,  # [1, k]
    native: NativeExperts,
) -> torch.Tensor:
    """One token through its k experts with the native kernel: bit for bit what the grouped
    path gives it (the same products, summed in float32 in expert order and rounded once),
    without sorting or scattering."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e, j in sorted((e, j) for j, e in enumerate(experts[0].tolist())):
        out += native.mlp(e, x) * weights[:, j : j + 1]  # the bf16 product, summed in float32
    return out.to(x.dtype)


def _dense(
    x: torch.Tensor,  # [N, H]
    experts: torch.Tensor,  # [N, k]
    weights: torch.Tensor,  # [N, k]
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
) -> torch.Tensor:
    """Every expert on every token, mixed by the routing weights: E/k times the work, no host
    read and no data-dependent shape (a captured step's fallback)."""
    mix = torch.zeros(x.shape[0], gate_up.shape[0], dtype=x.dtype, device=x.device)
    mix = mix.scatter_add(1, experts, weights)  # [N, E]
    hidden = torch.einsum("nh,eih->eni", x, gate_up)  # [E, N, 2I]
    ys = torch.einsum("eni,ehi->enh", _swiglu(hidden), down)  # [E, N, H]
    return torch.einsum("enh,ne->nh", ys, mix)


def _per_expert(
    xs: torch.Tensor,  # [M, H] sorted by expert
    counts: torch.Tensor,  # [E]
    mlp: Callable[[int, torch.Tensor], torch.Tensor],  # (expert, rows [m, H]) -> [m, H]
) -> torch.Tensor:
    """``mlp`` of each expert that has tokens over its rows (the counts read on the host)."""
    parts, start = [], 0
    for e, count in enumerate(counts.tolist()):
        if count:
            parts.append(mlp(e, xs[start : start + count]))
            start += count
    return torch.cat(parts) if parts else xs[:0]


def _swiglu_mlp(
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
    e: int,
    rows: torch.Tensor,  # [m, H]
) -> torch.Tensor:
    """Expert ``e``'s SwiGLU of rows through PyTorch's products -> [m, H]."""
    return F.linear(_swiglu(F.linear(rows, gate_up[e])), down[e])
