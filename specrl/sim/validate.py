"""Checks across a scenario's fields and specs, run before any simulation work.

``check_scenario(sc)`` returns None for a scenario the simulator can run, else raises a one-line
``SimInputError`` naming the input, what is wrong and what would fix it: specs and registered
names, expert parallelism, acceptance values, GPU counts, inputs that apply only with a kind of
spec (``scenario.COVERAGE.checked``: given where the spec makes them moot, refused) and a
replica's memory (``replica_memory``: weights plus one full-length sequence's KV cache).
Details: docs/internals.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specrl.costmodel.drafters import DRAFTER_KINDS, draft_forward
from specrl.costmodel.errors import SimInputError, unknown
from specrl.costmodel.specs import (
    PRECISIONS,
    DrafterSpec,
    HardwareSpec,
    ModelSpec,
    load_drafter,
    load_hardware,
    load_model,
)
from specrl.sim.acceptance import ACCEPTANCE_KINDS, POLICIES
from specrl.sim.pipeline import ASYNC_GENERATION, PIPELINES
from specrl.sim.scenario import MOE_ENGINE_TERMS, Scenario

GB = 1e9


@dataclass(frozen=True)
class ReplicaMemory:
    """Bytes one generation replica needs at least, and what it has."""

    weights: float
    kv_one_sequence: float
    context: int
    usable: float

    @property
    def needed(self) -> float:
        return self.weights + self.kv_one_sequence


def check_scenario(sc: Scenario) -> None:
    """Raise SimInputError if the scenario cannot be simulated (see module doc)."""
    model, hw = load_model(sc.model), load_hardware(sc.hardware)
    draft = _check_drafter(sc, model)
    _check_names(sc, hw)
    _check_acceptance(sc)
    _check_gpu_counts(sc)
    _check_expert_parallel(sc, model)
    _check_spec_terms(sc, model, hw)
    _check_generation_memory(sc, model, hw, draft)


def _check_drafter(sc: Scenario, model: ModelSpec) -> ModelSpec | None:
    drafter = load_drafter(sc.speculation.drafter)
    if drafter.kind not in DRAFTER_KINDS:
        raise unknown(f"drafter kind (drafter spec {drafter.name})", drafter.kind, DRAFTER_KINDS)
    return draft_forward(drafter, model) if sc.speculation.enabled else None


MEASURED_OVER = ("start", "rollout")


def _check_names(sc: Scenario, hw: HardwareSpec) -> None:
    acc = sc.speculation.acceptance
    if acc.kind not in ACCEPTANCE_KINDS:
        raise unknown("speculation.acceptance.kind", acc.kind, ACCEPTANCE_KINDS)
    if acc.measured_over not in MEASURED_OVER:
        raise unknown("speculation.acceptance.measured_over", acc.measured_over, MEASURED_OVER)
    precision = sc.generation.precision
    if precision not in PRECISIONS:
        raise unknown("generation.precision", precision, PRECISIONS)
    if PRECISIONS[precision].fp8_compute and hw.peak_flops_fp8 <= 0:
        raise SimInputError(
            f"generation.precision={precision}: hardware {hw.name} has no FP8 peak"
            " (peak_flops_fp8 = 0); use bf16 or a profile with FP8 tensor cores"
        )
    policies = [p for p in POLICIES if p != "off"]  # off: speculation.enabled = false
    if sc.speculation.policy not in policies:
        raise unknown("speculation.policy", sc.speculation.policy, policies)
    if sc.pipeline.mode not in PIPELINES:
        raise unknown("pipeline.mode", sc.pipeline.mode, PIPELINES)
    if sc.pipeline.async_generation not in ASYNC_GENERATION:
        raise unknown("pipeline.async_generation", sc.pipeline.async_generation, ASYNC_GENERATION)


def _check_acceptance(sc: Scenario) -> None:
    s = sc.speculation
    acc = s.acceptance
    if acc.acceptance_length > acc.at_k + 1:
        raise SimInputError(
            f"speculation.acceptance.acceptance_length={acc.acceptance_length} is above at_k + 1"
            f" = {acc.at_k + 1}: {acc.at_k} drafts accept at most {acc.at_k} tokens plus the"
            " bonus token"
        )
    _check_probabilities("speculation.acceptance.per_position", acc.per_position)
    _check_probabilities("speculation.draft_coverage", s.draft_coverage)
    w = sc.workload
    if w.mean_is_after_cap and w.mean_response_len >= w.max_response_len:
        raise SimInputError(
            f"workload.mean_response_len={w.mean_response_len} must be below"
            f" max_response_len={w.max_response_len} when mean_is_after_cap is true"
        )
    if any(n < 1 for n in w.length_trace):
        raise SimInputError("workload.length_trace: every response length must be >= 1")


def _check_probabilities(key: str, values: list[float]) -> None:
    bad = [v for v in values if not 0.0 <= v <= 1.0]
    if bad:
        raise SimInputError(f"{key}: {bad[0]} is not a probability in [0, 1]")


def _check_gpu_counts(sc: Scenario) -> None:
    g, t = sc.generation, sc.training
    _whole_replicas("generation.gpus", g.gpus, g.gpus_per_replica)
    if sc.pipeline.mode == "async":
        if t.gpus <= 0:
            raise SimInputError(
                "pipeline.mode=async needs training.gpus > 0 (generation and training run on"
                " separate GPUs)"
            )
        total = g.gpus + t.gpus
        _whole_replicas(
            f"generation.gpus + training.gpus (the sync baseline on all {total} GPUs)",
            total,
            g.gpus_per_replica,
        )
    elif t.gpus:
        raise SimInputError(
            f"training.gpus={t.gpus} with pipeline.mode={sc.pipeline.mode}: sync trains on the"
            " generation.gpus; set training.gpus=0 or pipeline.mode=async"
        )


def _check_expert_parallel(sc: Scenario, model: ModelSpec) -> None:
    ep, per_replica = sc.generation.ep, sc.generation.gpus_per_replica
    if ep == 1:
        return
    if not model.is_moe:
        raise SimInputError(
            f"generation.ep={ep} needs a mixture-of-experts model; {model.name} is dense"
            " (set generation.ep=1)"
        )
    if per_replica % ep or model.experts % ep:
        raise SimInputError(
            f"generation.ep={ep} must divide generation.gpus_per_replica={per_replica} and the"
            f" {model.experts} experts of {model.name}"
        )


def _check_spec_terms(sc: Scenario, model: ModelSpec, hw: HardwareSpec) -> None:
    """Inputs that apply only with a kind of model, hardware profile or drafter, refused where
    the spec makes them moot (the drafter's only while speculation is on)."""
    g, e, problems = sc.generation, sc.engine, []
    if g.routing_locality and not model.is_moe:
        problems.append(
            f"generation.routing_locality={g.routing_locality} needs a "
            f"mixture-of-experts model; {model.name} is dense"
        )
    for key in MOE_ENGINE_TERMS:
        if getattr(e, key) is not None and not model.is_moe:
            problems.append(
                f"engine.{key}={getattr(e, key)} needs a mixture-of-experts model;"
                f" {model.name} is dense"
            )
    cap = hw.graph_capture_tokens if e.graph_capture_tokens is None else e.graph_capture_tokens
    if e.eager_s_per_layer is not None and not cap:
        whose = "it is 0" if e.graph_capture_tokens == 0 else f"hardware profile {hw.name}'s is 0"
        problems.append(
            f"engine.eager_s_per_layer={e.eager_s_per_layer} needs engine.graph_capture_tokens"
            f" > 0 ({whose}: every forward is graphed)"
        )
    if sc.speculation.enabled:
        problems += _drafter_terms(sc, load_drafter(sc.speculation.drafter), model)
    if problems:
        raise SimInputError("; ".join(problems))


def _drafter_terms(sc: Scenario, drafter: DrafterSpec, model: ModelSpec) -> list[str]:
    """The problems of inputs that apply only to a model-free drafter, or only to one with
    weights (``drafter`` drafting for ``model``)."""
    free = draft_forward(drafter, model) is None
    out = []
    if sc.engine.cpu_s_per_ctx_token is not None and not free:
        out.append(
            f"engine.cpu_s_per_ctx_token={sc.engine.cpu_s_per_ctx_token} needs a "
            f"model-free drafter; drafter {drafter.name} ({drafter.kind}) drafts with a forward"
        )
    if sc.training.train_drafter and free:
        out.append(
            f"training.train_drafter=true needs a drafter with weights; drafter "
            f"{drafter.name} is model-free ({drafter.kind})"
        )
    return out


def _whole_replicas(what: str, gpus: int, per_replica: int) -> None:
    if gpus % per_replica:
        raise SimInputError(
            f"{what} = {gpus} is not a multiple of generation.gpus_per_replica = {per_replica}"
            f" (TP x EP of one engine replica): {gpus % per_replica} GPUs would sit idle"
        )


def replica_memory(
    sc: Scenario, model: ModelSpec, hw: HardwareSpec, draft: ModelSpec | None
) -> ReplicaMemory:
    """Weights, one full-length sequence's KV cache, and the usable memory of one replica."""
    w = sc.workload
    longest = max(w.length_trace) if w.length_trace else w.max_response_len
    context = w.prompt_len + longest
    kv_per_token = model.kv_bytes + (draft.kv_bytes if draft else 0)
    precision = sc.generation.precision if sc.generation.precision in PRECISIONS else "bf16"
    return ReplicaMemory(
        weights=model.weight_bytes_at(precision) + (draft.weight_bytes if draft else 0.0),
        kv_one_sequence=float(context * kv_per_token),
        context=context,
        usable=hw.hbm_bytes * hw.mem_fraction * sc.generation.gpus_per_replica,
    )


def _check_generation_memory(
    sc: Scenario, model: ModelSpec, hw: HardwareSpec, draft: ModelSpec | None
) -> None:
    mem = replica_memory(sc, model, hw, draft)
    if mem.needed <= mem.usable:
        return
    g, least = sc.generation.gpus_per_replica, _least_gpus(mem.needed, hw)
    fitting = [d for d in range(least, sc.generation.gpus + 1) if sc.generation.gpus % d == 0]
    example = f", e.g. {fitting[0]}" if fitting and fitting[0] != least else ""
    weights = "weights (target + drafter)" if draft else "weights"
    precision = sc.generation.precision
    fp8 = ", or FP8 weights (generation.precision=fp8: half the bytes)"
    fp8 = "" if precision == "fp8" else fp8
    raise SimInputError(
        f"model {model.name} does not fit one generation replica of {g} x {hw.name}: it needs"
        f" {mem.weights / GB:.1f} GB of {precision} {weights} +"
        f" {mem.kv_one_sequence / GB:.2f} GB of KV cache for one {mem.context}-token sequence"
        " (prompt_len + max_response_len)"
        f" = {mem.needed / GB:.1f} GB, and {g} x {hw.hbm_bytes / GB:.0f} GB x mem_fraction"
        f" {hw.mem_fraction} = {mem.usable / GB:.1f} GB is usable; use more GPUs per replica"
        f" (a larger TP: generation.gpus_per_replica >= {least}{example}),"
        f" GPUs with more memory{fp8}"
    )


def _least_gpus(needed: float, hw: HardwareSpec) -> int:
    return max(1, math.ceil(needed / (hw.hbm_bytes * hw.mem_fraction)))
