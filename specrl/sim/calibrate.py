"""Calibration: fit the cost model's efficiency terms to a measured engine trace.

``fit_trace`` fits a trace's records with the cost model's own fit (``specrl.costmodel.fit``:
each record priced by the model's features, bytes, FLOPs, verify logits and prefill FLOPs, the
rates solved by non-negative least squares on relative errors), giving a hardware profile (the
base profile with eta_mem, eta_compute, the step and verify overheads, the prefill rate and a
model-free drafter's CPU cost refitted) and its fit and held-out errors. A bad trace raises
``SimInputError`` (one line). The trace format and details: docs/internals.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specrl.costmodel.drafters import draft_forward
from specrl.costmodel.errors import SimInputError, read_text, unknown
from specrl.costmodel.fit import Record, design, profile_from_coefficients, relative_nnls
from specrl.costmodel.specs import (
    DrafterSpec,
    HardwareSpec,
    ModelSpec,
    load_drafter,
    load_model,
    spec_to_toml,
    with_overrides,
)
from specrl.fsutil import atomic_write

KINDS = ("decode", "verify", "prefill", "draft")


@dataclass(frozen=True)
class Trace:
    machine: str
    model: str
    dtype: str
    records: tuple[Record, ...]
    hardware: str = ""
    drafter: str = ""


@dataclass(frozen=True)
class FitReport:
    profile: HardwareSpec
    coefficients: dict[str, float]
    fit_error: float  # mean absolute percentage error on fitted records
    heldout_error: float  # same on held-out records (nan if none)
    n_fit: int
    n_heldout: int
    drafter: DrafterSpec | None = None  # fitted model-free drafter (cpu_s_per_seq)

    @property
    def coef(self) -> np.ndarray:
        """The coefficients [FEATURES] in ``costmodel.fit.features``' order."""
        return np.array(list(self.coefficients.values()))

    def to_json(self) -> dict[str, Any]:
        return {
            "coefficients": self.coefficients,
            "fit_mape": self.fit_error,
            "heldout_mape": self.heldout_error,
            "n_fit": self.n_fit,
            "n_heldout": self.n_heldout,
            "profile": self.profile.__dict__,
            "drafter": self.drafter.__dict__ if self.drafter else None,
        }


def parse_trace(data: dict[str, Any]) -> Trace:
    """A Trace from its JSON object; a missing or mistyped field raises SimInputError."""
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise SimInputError(
            "a trace is a JSON object with a 'records' list, or a gpu_check result with "
            "'engine.trace' (see docs/simulator.md)"
        )
    for key in ("machine", "model"):
        if not isinstance(data.get(key), str):
            raise SimInputError(f"trace field {key!r} must be a string, got {data.get(key)!r}")
    records = tuple(_record(i, r) for i, r in enumerate(data["records"]))
    return Trace(
        str(data["machine"]),
        str(data["model"]),
        str(data.get("dtype", "bf16")),
        records,
        str(data.get("hardware", "")),
        str(data.get("drafter", "")),
    )


def _record(index: int, r: Any) -> Record:
    where = f"trace record {index}"
    if not isinstance(r, dict):
        raise SimInputError(f"{where}: not a JSON object: {r!r}")
    if r.get("kind") not in KINDS:
        raise SimInputError(f"{where}: kind {r.get('kind')!r} not one of {', '.join(KINDS)}")
    numbers = {}
    for key in ("batch_size", "tokens_per_seq", "context_len", "step_time_s"):
        value = r.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise SimInputError(f"{where}: {key} must be a number >= 0, got {value!r}")
        numbers[key] = value
    if numbers["step_time_s"] <= 0 or not math.isfinite(numbers["step_time_s"]):
        raise SimInputError(f"{where}: step_time_s must be > 0, got {numbers['step_time_s']!r}")
    return Record(
        int(numbers["batch_size"]),
        int(numbers["tokens_per_seq"]),
        float(numbers["context_len"]),
        float(numbers["step_time_s"]),
        str(r["kind"]),
        str(r.get("config", "")),
    )


def load_trace(path: Path) -> Trace:
    """Read and parse a trace file, or the trace in a ``specrl bench gpu`` result
    (``engine.trace``); a missing, unreadable or malformed one raises SimInputError naming the
    file."""
    return read_calibration(path)[0]


def read_calibration(path: Path) -> tuple[Trace, Any]:
    """``load_trace``'s trace and the rollouts measured beside it: a gpu_check result's
    ``engine.rollouts``, a trace file's own ``rollouts`` (None when there are none)."""
    path = Path(path)
    text = read_text(path, "a JSON trace file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise SimInputError(f"trace {path}: malformed JSON ({e})") from None
    try:
        if isinstance(data, dict) and "records" not in data and "engine" in data:
            engine = data["engine"] if isinstance(data["engine"], dict) else {}
            if not isinstance(engine.get("trace"), dict):
                raise SimInputError(
                    "a gpu_check result without an engine trace (its 'engine' section did not "
                    "run or failed)"
                )
            return parse_trace(engine["trace"]), engine.get("rollouts")
        return parse_trace(data), data.get("rollouts")
    except SimInputError as e:
        raise SimInputError(f"trace {path}: {e}") from None


def mape(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - y) / y)) if len(y) else float("nan")


def split(n: int, heldout_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    n_out = int(round(n * heldout_fraction)) if n > 3 else 0
    return np.sort(order[n_out:]), np.sort(order[:n_out])


def split_records(
    recs: list[Record], heldout_fraction: float, seed: int, heldout_configs: tuple[str, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """Fit and held-out indices: whole runs named in ``heldout_configs``, else a seeded split."""
    if not heldout_configs:
        return split(len(recs), heldout_fraction, seed)
    labels = {r.config for r in recs}
    for label in heldout_configs:
        if label not in labels:
            raise unknown("held-out config", label, labels)
    out = np.array([r.config in heldout_configs for r in recs], dtype=bool)
    return np.flatnonzero(~out), np.flatnonzero(out)


def fit_drafter(drafter: DrafterSpec, drafts: list[Record]) -> DrafterSpec:
    """A model-free drafter's CPU seconds per sequence: least squares t = c * batch_size."""
    n = np.array([r.batch_size for r in drafts], dtype=float)
    t = np.array([r.step_time_s for r in drafts])
    return with_overrides(
        drafter, name=f"{drafter.name}-calibrated", cpu_s_per_seq=float(n @ t / (n @ n))
    )


def apply_drafts(
    trace: Trace, model: ModelSpec, profile: HardwareSpec, drafts: list[Record]
) -> tuple[HardwareSpec, DrafterSpec | None]:
    """Fold draft records into the profile (model drafters) or a fitted model-free drafter."""
    if not drafts:
        return profile, None
    if trace.drafter:
        spec = load_drafter(trace.drafter)
        if draft_forward(spec, model) is None:
            return profile, fit_drafter(spec, drafts)
    median = float(np.median([r.step_time_s for r in drafts]))
    return with_overrides(profile, forward_overhead_s=median), None


def fit_trace(
    trace: Trace,
    base: HardwareSpec,
    heldout_fraction: float = 0.25,
    seed: int = 0,
    name: str = "",
    heldout_configs: tuple[str, ...] = (),
) -> FitReport:
    """Fit c0, bytes and FLOP rates on one device to a trace; report fit and held-out error."""
    model = load_model(trace.model)
    recs = [r for r in trace.records if r.kind != "draft"]
    if len(recs) < 3:
        raise SimInputError("need at least 3 decode/verify/prefill records to fit")
    x, y = design(model, recs)
    fit_idx, out_idx = split_records(recs, heldout_fraction, seed, heldout_configs)
    if len(fit_idx) < 3:
        raise SimInputError(
            "need at least 3 decode/verify/prefill records outside the held-out runs"
        )
    coef = relative_nnls(x[fit_idx], y[fit_idx])
    profile = profile_from_coefficients(base, coef, name or f"{base.name}-calibrated")
    drafts = [r for r in trace.records if r.kind == "draft" and r.config not in heldout_configs]
    profile, drafter = apply_drafts(trace, model, profile, drafts)
    return FitReport(
        profile=profile,
        coefficients={
            "c0_s": float(coef[0]),
            "s_per_byte": float(coef[1]),
            "s_per_flop": float(coef[2]),
            "s_per_verify_logit": float(coef[3]),
            "verify_overhead_s": float(coef[4]),
            "s_per_prefill_flop": float(coef[5]),
            "s_per_expert_byte": float(coef[6]),
        },
        fit_error=mape(x[fit_idx] @ coef, y[fit_idx]),
        heldout_error=mape(x[out_idx] @ coef, y[out_idx]),
        n_fit=len(fit_idx),
        n_heldout=len(out_idx),
        drafter=drafter,
    )


def _header(report: FitReport, trace: Trace) -> str:
    return (
        f"Fitted by `specrl simulate calibrate` from a trace of {trace.model} ({trace.dtype}) on "
        f"{trace.machine}.\nFit MAPE {report.fit_error:.1%} on {report.n_fit} records, held-out "
        f"MAPE {report.heldout_error:.1%} on {report.n_heldout}."
    )


def write_profile(report: FitReport, path: Path, trace: Trace) -> Path:
    """Write the fitted hardware profile (atomically; missing parent directories created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, spec_to_toml(report.profile, _header(report, trace)))
    return path


def write_drafter(report: FitReport, path: Path, trace: Trace) -> Path | None:
    """Write the fitted model-free drafter spec, if the fit produced one (as ``write_profile``)."""
    if report.drafter is None:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, spec_to_toml(report.drafter, _header(report, trace)))
    return path
