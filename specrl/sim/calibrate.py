"""Calibration: fit the cost model's efficiency terms to measured engine step times.

Trace JSON format (written by the engine's benchmarks, read here)::

    {"machine": str,                  # free text, e.g. "cpu-2core" or "1xH100"
     "model": str,                    # a model spec name, e.g. "smollm2-135m"
     "dtype": str,                    # e.g. "bf16" (informational; priced at 2 B/param)
     "records": [{"batch_size": int,        # sequences in the forward
                  "tokens_per_seq": int,    # 1 for plain decode, k+1 for verify, prompt for prefill
                  "context_len": int,       # mean tokens already in the KV cache per sequence
                  "step_time_s": float,     # measured seconds of the whole engine step
                  "kind": "decode" | "verify" | "prefill" | "draft"}]}

Contract: every non-draft record is priced by the cost model's own features, bytes moved and FLOPs
(cost.weight_bytes_read, kv_bytes_read, forward_flops on one device), and the fit solves
``step_time = c0 + bytes / B_eff + flops / F_eff`` by non-negative least squares (numpy; a feature
whose coefficient goes negative is dropped and the rest refitted). The result is written as a
hardware profile: eta_mem = B_eff / hbm_bandwidth, eta_compute = F_eff / peak_flops,
step_overhead_s = c0, keeping every other field of the base profile. Draft records, when
present, set forward_overhead_s to their median time. Records are split into fit and held-out
sets by a seeded permutation; the report gives the mean absolute percentage error on both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from specrl.sim.cost import ForwardShape, forward_flops, kv_bytes_read, weight_bytes_read
from specrl.sim.specs import HardwareSpec, ModelSpec, hardware_to_toml, load_model

KINDS = ("decode", "verify", "prefill", "draft")


@dataclass(frozen=True)
class Record:
    batch_size: int
    tokens_per_seq: int
    context_len: float
    step_time_s: float
    kind: str


@dataclass(frozen=True)
class Trace:
    machine: str
    model: str
    dtype: str
    records: tuple[Record, ...]


@dataclass(frozen=True)
class FitReport:
    profile: HardwareSpec
    coefficients: dict[str, float]
    fit_error: float  # mean absolute percentage error on fitted records
    heldout_error: float  # same on held-out records (nan if none)
    n_fit: int
    n_heldout: int

    def to_json(self) -> dict[str, Any]:
        return {
            "coefficients": self.coefficients,
            "fit_mape": self.fit_error,
            "heldout_mape": self.heldout_error,
            "n_fit": self.n_fit,
            "n_heldout": self.n_heldout,
            "profile": self.profile.__dict__,
        }


def parse_trace(data: dict[str, Any]) -> Trace:
    records = []
    for r in data["records"]:
        if r["kind"] not in KINDS:
            raise ValueError(f"record kind {r['kind']!r} not in {KINDS}")
        records.append(
            Record(
                int(r["batch_size"]),
                int(r["tokens_per_seq"]),
                float(r["context_len"]),
                float(r["step_time_s"]),
                str(r["kind"]),
            )
        )
    return Trace(
        str(data["machine"]), str(data["model"]), str(data.get("dtype", "bf16")), tuple(records)
    )


def load_trace(path: Path) -> Trace:
    return parse_trace(json.loads(Path(path).read_text()))


def features(model: ModelSpec, rec: Record) -> np.ndarray:
    """[1, bytes moved, FLOPs] of one record's forward, as the cost model counts them."""
    shape = ForwardShape(rec.batch_size, rec.tokens_per_seq, rec.context_len)
    moved = weight_bytes_read(model, shape.tokens) + kv_bytes_read(model, shape)
    return np.array([1.0, moved, forward_flops(model, shape)])


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 by dropping negative ones and refitting."""
    keep = np.ones(x.shape[1], dtype=bool)
    while True:
        coef = np.zeros(x.shape[1])
        coef[keep] = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (coef >= 0).all():
            return coef
        keep &= coef > 0


def mape(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - y) / y)) if len(y) else float("nan")


def split(n: int, heldout_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    n_out = int(round(n * heldout_fraction)) if n > 3 else 0
    return np.sort(order[n_out:]), np.sort(order[:n_out])


def profile_from_coefficients(base: HardwareSpec, coef: np.ndarray, name: str) -> HardwareSpec:
    c0, per_byte, per_flop = (float(c) for c in coef)
    eta_mem = 1.0 / (per_byte * base.hbm_bandwidth) if per_byte > 0 else base.eta_mem
    eta_compute = 1.0 / (per_flop * base.peak_flops) if per_flop > 0 else base.eta_compute
    return replace(base, name=name, eta_mem=eta_mem, eta_compute=eta_compute, step_overhead_s=c0)


def fit_trace(
    trace: Trace, base: HardwareSpec, heldout_fraction: float = 0.25, seed: int = 0, name: str = ""
) -> FitReport:
    """Fit c0, bytes and FLOP rates on one device to a trace; report fit and held-out error."""
    model = load_model(trace.model)
    recs = [r for r in trace.records if r.kind != "draft"]
    if len(recs) < 3:
        raise ValueError("need at least 3 decode/verify/prefill records to fit")
    x = np.stack([features(model, r) for r in recs])
    y = np.array([r.step_time_s for r in recs])
    fit_idx, out_idx = split(len(recs), heldout_fraction, seed)
    coef = nnls(x[fit_idx], y[fit_idx])
    profile = profile_from_coefficients(base, coef, name or f"{base.name}-calibrated")
    drafts = [r.step_time_s for r in trace.records if r.kind == "draft"]
    if drafts:
        profile = replace(profile, forward_overhead_s=float(np.median(drafts)))
    return FitReport(
        profile=profile,
        coefficients={
            "c0_s": float(coef[0]),
            "s_per_byte": float(coef[1]),
            "s_per_flop": float(coef[2]),
        },
        fit_error=mape(x[fit_idx] @ coef, y[fit_idx]),
        heldout_error=mape(x[out_idx] @ coef, y[out_idx]),
        n_fit=len(fit_idx),
        n_heldout=len(out_idx),
    )


def write_profile(report: FitReport, path: Path, trace: Trace) -> Path:
    header = (
        f"Fitted by `specrl simulate calibrate` from a trace of {trace.model} ({trace.dtype}) on "
        f"{trace.machine}.\nFit MAPE {report.fit_error:.1%} on {report.n_fit} records, held-out "
        f"MAPE {report.heldout_error:.1%} on {report.n_heldout}."
    )
    path = Path(path)
    path.write_text(hardware_to_toml(report.profile, header))
    return path
