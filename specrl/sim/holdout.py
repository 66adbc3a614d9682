"""Checks of a calibration on what it was not fitted to: held-out configs and whole rollouts.

``config_errors(model, coef, records)`` is the error of the fitted cost per held-out config
(``Record.config``: gpu_check's ``bs{B}``): MAPE, the worst point and the count.
``parse_rollouts(rows)`` reads gpu_check's ``engine.rollouts`` (rows that were skipped or
failed are left out; a malformed row raises ``SimInputError``); ``predict_rollout`` prices a
whole rollout with the fitted cost model: one shared prefill of the prompt, then one step per
token (plain) or one verify step of k+1 tokens per ``acceptance_length`` tokens (an oracle
drafter costing nothing), the context growing as the tokens do; ``rollout_report`` sets the
predictions beside the measured seconds. Rollouts are never fitted on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from specrl.sim.calibrate import FitReport, Record, Trace, design
from specrl.sim.errors import SimInputError, unknown
from specrl.sim.specs import ModelSpec

ROLLOUT_FIELDS = ("batch_size", "prompt_tokens", "new_tokens", "k", "plain_s", "spec_s")


@dataclass(frozen=True)
class Rollout:
    """One measured rollout: ``batch_size`` rows of one prompt, ``new_tokens`` each, plain and
    with a drafter of ``acceptance_length`` tokens per verify step at ``k``."""

    config: str
    batch_size: int
    prompt_tokens: int
    new_tokens: int
    k: int
    acceptance_length: float
    plain_s: float
    spec_s: float


def parse_rollouts(rows: Any) -> tuple[Rollout, ...]:
    """gpu_check's ``engine.rollouts`` (None: none); rows holding ``skipped`` or ``error``
    are left out."""
    if rows is None:
        return ()
    if not isinstance(rows, list):
        raise SimInputError(f"engine.rollouts must be a list, got {type(rows).__name__}")
    done = [r for r in rows if isinstance(r, dict) and not {"skipped", "error"} & set(r)]
    return tuple(_rollout(i, r) for i, r in enumerate(done))


def _rollout(index: int, r: dict) -> Rollout:
    values = {}
    for key in ROLLOUT_FIELDS:
        value = r.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise SimInputError(f"rollout {index}: {key} must be a number > 0, got {value!r}")
        values[key] = value
    length = r.get("measured_acceptance_length", r.get("acceptance_length"))
    if isinstance(length, bool) or not isinstance(length, int | float) or not length >= 1:
        raise SimInputError(f"rollout {index}: acceptance length must be >= 1, got {length!r}")
    ints = {key: int(values[key]) for key in ("batch_size", "prompt_tokens", "new_tokens", "k")}
    return Rollout(str(r.get("config", f"rollout{index}")), **ints,
                   acceptance_length=float(length), plain_s=float(values["plain_s"]),
                   spec_s=float(values["spec_s"]))  # fmt: skip


def rollout_records(r: Rollout, speculative: bool) -> list[Record]:
    """The engine forwards of rollout ``r``: the prefill, then plain or verify steps."""
    out = [Record(1, r.prompt_tokens, 0.0, 1.0, "prefill")]
    left = r.new_tokens - 1  # the prefill samples the first token
    if not speculative:
        return out + [Record(r.batch_size, 1, r.prompt_tokens + i, 1.0, "decode")
                      for i in range(1, left + 1)]  # fmt: skip
    steps = math.ceil(left / r.acceptance_length)
    return out + [Record(r.batch_size, r.k + 1, r.prompt_tokens + 1 + j * r.acceptance_length,
                         1.0, "verify") for j in range(steps)]  # fmt: skip


def predicted_seconds(model: ModelSpec, coef: np.ndarray, records: list[Record]) -> float:
    """The fitted cost of ``records`` (``calibrate.features`` @ coef, summed)."""
    x, _ = design(model, records)
    return float((x @ coef).sum())


def predict_rollout(model: ModelSpec, coef: np.ndarray, r: Rollout) -> tuple[float, float]:
    """Predicted (plain, speculative) seconds of rollout ``r``."""
    return (predicted_seconds(model, coef, rollout_records(r, False)),
            predicted_seconds(model, coef, rollout_records(r, True)))  # fmt: skip


def rollout_report(
    model: ModelSpec, coef: np.ndarray, rollouts: tuple[Rollout, ...]
) -> dict[str, Any]:
    """Per rollout the predicted and measured seconds (plain, speculative), their relative
    errors and the speedups; overall MAPE and the worst error."""
    rows, errors = [], []
    for r in rollouts:
        plain, spec = predict_rollout(model, coef, r)
        err = (abs(plain / r.plain_s - 1), abs(spec / r.spec_s - 1))
        errors += err
        rows.append({
            "config": r.config, "batch_size": r.batch_size,
            "acceptance_length": r.acceptance_length,
            "plain_s": r.plain_s, "predicted_plain_s": plain, "plain_error": err[0],
            "spec_s": r.spec_s, "predicted_spec_s": spec, "spec_error": err[1],
            "speedup": r.plain_s / r.spec_s, "predicted_speedup": plain / spec,
        })  # fmt: skip
    worst = max(errors, default=float("nan"))
    mape = float(np.mean(errors)) if errors else float("nan")
    return {"rollouts": rows, "mape": mape, "worst": worst}


def complement(trace: Trace, fit: tuple[str, ...]) -> tuple[str, ...]:
    """The configs of ``trace``'s records outside ``fit`` (each of which must be one)."""
    labels = {r.config for r in trace.records}
    for label in fit:
        if label not in labels:
            raise unknown("fit config", label, labels)
    return tuple(sorted(labels - set(fit)))


def held_out_checks(
    model: ModelSpec,
    report: FitReport,
    trace: Trace,
    held: tuple[str, ...],
    rollouts: tuple[Rollout, ...],
) -> dict[str, Any]:
    """``heldout_configs`` (``config_errors`` of the held-out configs' records, draft records
    aside) and ``rollouts`` (``rollout_report``) of a fit."""
    records = [r for r in trace.records if r.config in held and r.kind != "draft"]
    return {"heldout_configs": config_errors(model, report.coef, records),
            "rollouts": rollout_report(model, report.coef, rollouts)}  # fmt: skip


def config_errors(
    model: ModelSpec, coef: np.ndarray, records: list[Record]
) -> dict[str, dict[str, float]]:
    """Per config of ``records``: MAPE, worst relative error and count of the fitted cost."""
    out: dict[str, dict[str, float]] = {}
    for config in sorted({r.config for r in records}):
        group = [r for r in records if r.config == config]
        x, y = design(model, group)
        err = np.abs(x @ coef / y - 1)
        out[config] = {"mape": float(err.mean()), "worst": float(err.max()), "n": len(group)}
    return out
