"""The step-cost model's fit: a hardware profile's rates from timed forwards.

A ``Record`` is one timed forward (rows, query tokens per row, context, seconds, kind: decode,
verify, prefill or draft). ``features`` prices it with the cost model's own terms (bytes moved,
FLOPs, verified logits, a verify, prefill FLOPs); ``fit_records`` / ``fit_design`` solve for the
rates by non-negative least squares on relative errors (``relative_nnls``) and turn them into a
profile (``profile_from_coefficients``: the base profile with eta_mem, eta_compute, the step
and verify overheads and the prefill rate refitted) that ``cost.StepCostModel`` prices a step
with as the fit does. The simulator's trace calibration (``specrl.sim.calibrate``) and the
speculation controller (``specrl.spec.controller``) both fit with these.
Details: docs/internals.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from specrl.costmodel.cost import (
    ForwardShape,
    dense_bytes_read,
    expert_bytes_read,
    forward_flops,
    kv_bytes_read,
)
from specrl.costmodel.specs import HardwareSpec, ModelSpec, with_overrides


@dataclass(frozen=True)
class Record:
    """One timed forward: ``batch_size`` rows of ``tokens_per_seq`` query tokens each over
    ``context_len`` cached positions took ``step_time_s`` seconds; ``kind`` is decode, verify,
    prefill or draft; ``config`` labels the run it came from (a trace's held-out runs)."""

    batch_size: int
    tokens_per_seq: int
    context_len: float
    step_time_s: float
    kind: str
    config: str = ""


def features(model: ModelSpec, rec: Record) -> np.ndarray:
    """[1, bytes moved, FLOPs, verified logits, 1 if a verify, FLOPs if a prefill, routed
    experts' bytes] of one record, as the cost model counts them: ``FEATURES`` columns (the
    experts' bytes: the unique experts its tokens are expected to touch under the model's
    measured routing, priced by their own rate; 0 for a dense model)."""
    shape = ForwardShape(rec.batch_size, rec.tokens_per_seq, rec.context_len)
    moved = dense_bytes_read(model) + kv_bytes_read(model, shape)
    verify = float(rec.kind == "verify")
    logits = shape.tokens * model.vocab * verify
    flops = forward_flops(model, shape)
    experts = expert_bytes_read(model, shape.tokens)
    return np.array([1.0, moved, flops, logits, verify, flops * (rec.kind == "prefill"), experts])


FEATURES = 7  # columns of ``features``


def design(model: ModelSpec, records: list[Record]) -> tuple[np.ndarray, np.ndarray]:
    """Features [n, FEATURES] and measured seconds [n] of ``records``."""
    x = np.stack([features(model, r) for r in records])
    return x, np.array([r.step_time_s for r in records])


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 by dropping negative ones and refitting (columns
    scaled to unit norm first: the features span ~11 orders of magnitude)."""
    norm = np.linalg.norm(x, axis=0)
    keep = norm > 0
    while True:
        coef = np.zeros(x.shape[1])
        coef[keep] = np.linalg.lstsq(x[:, keep] / norm[keep], y, rcond=None)[0] / norm[keep]
        if (coef >= 0).all():
            return coef
        keep &= coef > 0


def relative_nnls(x: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """``nnls`` minimising relative errors (each record's row divided by its time): a batch-1
    step of 20 ms counts as much as a batch-64 step of 300 ms, as in the error reported.
    ``weights`` [n] (default 1): each record's squared relative error counts that many times."""
    root = np.ones_like(y) if weights is None else np.sqrt(weights)  # [n]
    return nnls(x / y[:, None] * root[:, None], root)


def profile_from_coefficients(base: HardwareSpec, coef: np.ndarray, name: str) -> HardwareSpec:
    """The profile pricing a step as the fit does: a rate the fit dropped (coefficient 0)
    becomes an infinite efficiency, so that term costs nothing in ``StepCostModel`` either; but
    a dropped routed-expert rate leaves ``eta_expert_mem`` 0 (experts priced at ``eta_mem``, as
    in a profile without the term: the column is all zero for a dense model). The base's fixed
    per-layer floors (``cost.layer_floor``) are zeroed: the fit has no such columns, its c0
    holds every fixed cost of a step."""
    c0, per_byte, per_flop, per_logit, verify_s, prefill_flop, per_expert_byte = (
        float(c) for c in coef
    )
    eta_mem = 1.0 / (per_byte * base.hbm_bandwidth) if per_byte > 0 else math.inf
    eta_compute = 1.0 / (per_flop * base.peak_flops) if per_flop > 0 else math.inf
    eta_expert = 1.0 / (per_expert_byte * base.hbm_bandwidth) if per_expert_byte > 0 else 0.0
    return with_overrides(
        base,
        name=name,
        eta_mem=eta_mem,
        eta_compute=eta_compute,
        eta_expert_mem=eta_expert,
        step_overhead_s=c0,
        verify_s_per_logit=per_logit,
        verify_overhead_s=verify_s,
        prefill_s_per_flop=prefill_flop,
        layer_s=0.0,
        moe_layer_s=0.0,
        expert_s=0.0,
    )


def fit_records(
    model: ModelSpec, records: list[Record], base: HardwareSpec, name: str
) -> HardwareSpec:
    """The profile whose c0, byte, FLOP and verify-logit rates best fit ``records`` (decode,
    verify or prefill records of ``model``; at least one). The speculation controller
    (``specrl.spec.controller``) fits the engine it drives with this (``fit_design``), from a
    start-up measurement and the engine's own steps, so it and the simulator price a step
    alike."""
    x, y = design(model, records)
    return fit_design(x, y, base, name)


def fit_design(
    x: np.ndarray,
    y: np.ndarray,
    base: HardwareSpec,
    name: str,
    weights: np.ndarray | None = None,
) -> HardwareSpec:
    """``fit_records`` from records' ``features`` x [n, FEATURES], seconds y [n] and ``weights`` [n]
    (``relative_nnls``; a caller that refits often computes each record's features once)."""
    return profile_from_coefficients(base, relative_nnls(x, y, weights), name)
