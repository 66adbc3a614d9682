"""Checks of a calibration on what it was not fitted to: held-out configs and whole rollouts.

``config_errors(model, coef, records)`` is the error of the fitted cost per held-out config
(``Record.config``: gpu_check's ``bs{B}``): MAPE, the worst error and point, and the count.
``parse_rollouts(rows)`` reads gpu_check's ``engine.rollouts`` (rows that were skipped or
failed are left out, ``left_out`` names them; a malformed row raises ``SimInputError``);
``predict_rollout`` prices a whole rollout as the simulator does, by its replay of a measured
rollout (``machine.replay_seconds``) under the fitted profile: one prefill of the shared
prompt, then the engine's steps, plain or at k drafts accepted i.i.d. at the measured
acceptance length (an oracle drafter costing nothing); ``rollout_report`` sets the predictions
beside the measured seconds. Rollouts are never fitted on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from specrl.costmodel.errors import SimInputError, unknown
from specrl.costmodel.fit import Record, design
from specrl.costmodel.specs import DrafterSpec, HardwareSpec, ModelSpec
from specrl.sim.acceptance import alpha_for_length
from specrl.sim.calibrate import FitReport, Trace
from specrl.sim.machine import MeasuredRollout, replay_seconds

ROLLOUT_FIELDS = ("batch_size", "prompt_tokens", "new_tokens", "k", "plain_s", "spec_s")
ORACLE = DrafterSpec(name="oracle", kind="suffix")  # model-free, cpu_s_per_seq 0: free drafts
EXPECTED_PAIRS = 10**6  # (row, step) pairs the oracle's expected acceptance counts are over


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

    def replayed(self, speculative: bool) -> MeasuredRollout:
        """The rollout as the simulator replays a measured one: its rows share one prompt (one
        prefill), and, speculative, every row drafts k and each draft is accepted at the i.i.d.
        rate giving ``acceptance_length`` (as expected counts over EXPECTED_PAIRS pairs)."""
        n = self.batch_size
        lens = ((self.prompt_tokens,) * n, (self.new_tokens,) * n)
        if not speculative:
            return MeasuredRollout(*lens, 0, (), (), 0, n, n)
        alpha = alpha_for_length(self.acceptance_length, self.k)
        accepted = tuple(round(EXPECTED_PAIRS * alpha ** (i + 1)) for i in range(self.k))
        drafted = (EXPECTED_PAIRS,) * self.k
        return MeasuredRollout(*lens, self.k, accepted, drafted, EXPECTED_PAIRS, n, n)


def _not_run(row: Any) -> bool:
    """A rollout row the run skipped or lost to an error."""
    return isinstance(row, dict) and bool({"skipped", "error"} & set(row))


def parse_rollouts(rows: Any) -> tuple[Rollout, ...]:
    """gpu_check's ``engine.rollouts`` or a trace's ``rollouts`` (None: none); rows holding
    ``skipped`` or ``error`` are left out. The acceptance length is the one the run measured
    (``measured_acceptance_length``), else its target."""
    if rows is None:
        return ()
    if not isinstance(rows, list):
        raise SimInputError(f"engine.rollouts must be a list, got {type(rows).__name__}")
    return tuple(_rollout(i, r) for i, r in enumerate(rows) if not _not_run(r))


def _rollout(index: int, r: Any) -> Rollout:
    if not isinstance(r, dict):
        raise SimInputError(f"rollout {index}: not a JSON object: {r!r}")
    values = {}
    for key in ROLLOUT_FIELDS:
        value = r.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise SimInputError(f"rollout {index}: {key} must be a number > 0, got {value!r}")
        values[key] = value
    length = r.get("measured_acceptance_length", r.get("acceptance_length"))
    if isinstance(length, bool) or not isinstance(length, int | float) or not length >= 1:
        raise SimInputError(f"rollout {index}: acceptance length must be >= 1, got {length!r}")
    if length > values["k"] + 1:
        raise SimInputError(f"rollout {index}: acceptance length {length} is above k + 1")
    ints = {key: int(values[key]) for key in ("batch_size", "prompt_tokens", "new_tokens", "k")}
    return Rollout(str(r.get("config", f"rollout{index}")), **ints,
                   acceptance_length=float(length), plain_s=float(values["plain_s"]),
                   spec_s=float(values["spec_s"]))  # fmt: skip


def left_out(rows: Any) -> tuple[str, ...]:
    """The rollout rows the run skipped or lost to an error, as 'CONFIG (reason)'."""
    rows = rows if isinstance(rows, list) else []
    out = []
    for i, r in enumerate(rows):
        if _not_run(r):
            reason = str(r.get("skipped") or r.get("error")).splitlines() or [""]
            out.append(f"{r.get('config', f'rollout{i}')} ({reason[0]})")
    return tuple(out)


def predict_rollout(model: ModelSpec, profile: HardwareSpec, r: Rollout) -> tuple[float, float]:
    """Predicted (plain, speculative) seconds of rollout ``r`` under ``profile``."""
    return (replay_seconds(r.replayed(False), model, profile, None),
            replay_seconds(r.replayed(True), model, profile, ORACLE))  # fmt: skip


def rollout_report(
    model: ModelSpec,
    profile: HardwareSpec,
    rollouts: tuple[Rollout, ...],
    fitted_batches: frozenset[int] = frozenset(),
    skipped: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Per rollout the predicted and measured seconds (plain, speculative), their relative
    errors (absolute values) and the speedups, and whether the fit saw its batch size
    (``fitted_batches``); overall MAPE, the worst error and which; the ``skipped`` rows."""
    rows, errors = [], []
    for r in rollouts:
        plain, spec = predict_rollout(model, profile, r)
        err = (abs(plain / r.plain_s - 1), abs(spec / r.spec_s - 1))
        errors += [(err[0], f"{r.config} plain"), (err[1], f"{r.config} spec")]
        rows.append({
            "config": r.config, "batch_size": r.batch_size, "k": r.k,
            "acceptance_length": r.acceptance_length,
            "batch_fitted": r.batch_size in fitted_batches,
            "plain_s": r.plain_s, "predicted_plain_s": plain, "plain_error": err[0],
            "spec_s": r.spec_s, "predicted_spec_s": spec, "spec_error": err[1],
            "speedup": r.plain_s / r.spec_s, "predicted_speedup": plain / spec,
        })  # fmt: skip
    worst = max(errors, default=(float("nan"), ""))
    mape = float(np.mean([e for e, _ in errors])) if errors else float("nan")
    return {"rollouts": rows, "mape": mape, "worst": worst[0], "worst_prediction": worst[1],
            "skipped": list(skipped)}  # fmt: skip


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
    skipped: tuple[str, ...] = (),
) -> dict[str, Any]:
    """``heldout_configs`` (``config_errors`` of the held-out configs' records, draft records
    aside) and ``rollouts`` (``rollout_report`` under the fitted profile) of a fit."""
    records = [r for r in trace.records if r.config in held and r.kind != "draft"]
    fitted = frozenset(r.batch_size for r in trace.records if r.config not in held)
    return {
        "heldout_configs": config_errors(model, report.coef, records),
        "rollouts": rollout_report(model, report.profile, rollouts, fitted, skipped),
    }


def config_errors(
    model: ModelSpec, coef: np.ndarray, records: list[Record]
) -> dict[str, dict[str, Any]]:
    """Per config of ``records``: MAPE, worst relative error and count of the fitted cost, and
    the worst point (kind, shape, measured and predicted seconds, signed error)."""
    out: dict[str, dict[str, Any]] = {}
    for config in sorted({r.config for r in records}):
        group = [r for r in records if r.config == config]
        x, y = design(model, group)
        pred = x @ coef  # [n] fitted seconds
        err = np.abs(pred / y - 1)  # [n]
        i = int(np.argmax(err))
        w = group[i]
        point = {"kind": w.kind, "batch_size": w.batch_size, "tokens_per_seq": w.tokens_per_seq,
                 "context_len": w.context_len, "measured_s": float(y[i]),
                 "predicted_s": float(pred[i]), "error": float(pred[i] / y[i] - 1)}  # fmt: skip
        out[config] = {"mape": float(err.mean()), "worst": float(err.max()), "n": len(group),
                       "worst_point": point}  # fmt: skip
    return out
