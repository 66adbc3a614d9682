"""The free constants of the GPU profiles, fitted on published serving points, and their
leave-one-source-out error.

Everything in a Hopper profile (``h100``, ``h200``) is a datasheet or measured value with its
source in the TOML, except ``FREE``: engine constants no datasheet gives (step and draft-forward
overheads, the per-layer floors, the routed experts' bandwidth efficiency). Both profiles share
them (one engine generation on one GPU generation). ``fit_constants(points)`` chooses them to
minimise the squared log error of ``points`` (robust: ``soft_l1``), each group's acceptance
refitted on its fit row at every trial; ``leave_one_source_out()`` fits on every origin but
one and predicts that one (the headline error), then fits on all. Rows on other hardware take
no part (their profiles are not fitted).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from statistics import median
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from specrl.costmodel.specs import load_hardware, load_model
from specrl.sim.scenario import MOE_ENGINE_TERMS
from specrl.sim.serving import (
    ORIGINS,
    SERVING,
    TARGET_HARDWARE,
    Overrides,
    ServingPoint,
    fit_group_acceptance,
    serving_value,
)


@dataclass(frozen=True)
class FreeConstant:
    """One fitted profile field: its bounds, and the unit it is fitted and reported in."""

    field: str
    low: float
    high: float
    unit: float  # the field's value per fitted unit (1e-3: fitted in ms)
    unit_name: str


FREE: tuple[FreeConstant, ...] = (
    FreeConstant("step_overhead_s", 0.0, 5.0, 1e-3, "ms"),
    FreeConstant("forward_overhead_s", 0.0, 3.0, 1e-3, "ms"),
    FreeConstant("layer_s", 0.0, 100.0, 1e-6, "us"),
    FreeConstant("moe_layer_s", 0.0, 500.0, 1e-6, "us"),
    FreeConstant("expert_s", 0.0, 50.0, 1e-6, "us"),
    FreeConstant("eta_expert_mem", 0.05, 1.0, 1.0, ""),
)
LOSS = "soft_l1"  # squared log error near 0, absolute beyond F_SCALE: one odd source pulls less
F_SCALE = 0.1


def fitted_points(points: Iterable[ServingPoint] = SERVING) -> tuple[ServingPoint, ...]:
    """The held-out rows on the fitted hardware: what the constants are fitted to and judged on."""
    return tuple(p for p in points if p.role == "heldout" and p.hardware in TARGET_HARDWARE)


def overrides_for(point: ServingPoint, values: Sequence[float]) -> Overrides:
    """The scenario overrides setting ``FREE`` to ``values`` (fitted units) for ``point``'s
    simulation (the MoE terms only for a MoE model: elsewhere they are refused)."""
    moe = load_model(point.model).is_moe
    pairs = zip(FREE, values, strict=True)
    return tuple(f"engine.{c.field}={float(v) * c.unit!r}" for c, v in pairs
                 if moe or c.field not in MOE_ENGINE_TERMS)  # fmt: skip


def current_values() -> tuple[float, ...]:
    """The bundled H100 profile's free constants, in fitted units."""
    h100 = load_hardware("h100")
    return tuple(getattr(h100, c.field) / c.unit for c in FREE)


def simulated(points: Sequence[ServingPoint], values: Sequence[float]) -> list[float]:
    """Each point's simulated value with ``FREE`` at ``values`` (each group's acceptance
    fitted once, on its fit row under the same values)."""
    fit_rows = {p.group: p for p in SERVING if p.role == "fit"}
    groups = sorted({p.group for p in points if p.drafter and not p.acceptance_length})
    lengths = {g: fit_group_acceptance(g, overrides_for(fit_rows[g], values)) for g in groups}
    return [serving_value(p, p.acceptance_length or lengths.get(p.group),
                          overrides_for(p, values)) for p in points]  # fmt: skip


def log_errors(points: Sequence[ServingPoint], values: Sequence[float]) -> np.ndarray:
    """log(simulated / published) per point  # [len(points)]"""
    sims = simulated(points, values)
    return np.log(np.array(sims) / np.array([p.published for p in points]))


@dataclass(frozen=True)
class Fit:
    values: tuple[float, ...]  # FREE, in fitted units
    cost: float  # the robust loss at the optimum
    evaluations: int

    def as_dict(self) -> dict[str, float]:
        return {c.field: v * c.unit for c, v in zip(FREE, self.values, strict=True)}


def fit_constants(
    points: Sequence[ServingPoint], start: Sequence[float] | None = None, max_evals: int = 400
) -> Fit:
    """The ``FREE`` values minimising the robust squared log error over ``points``."""
    x0 = np.array(start if start is not None else current_values(), dtype=float)
    low = np.array([c.low for c in FREE])
    high = np.array([c.high for c in FREE])
    res = least_squares(lambda x: log_errors(points, x), np.clip(x0, low, high),
                        bounds=(low, high), loss=LOSS, f_scale=F_SCALE, x_scale="jac",
                        diff_step=1e-3, max_nfev=max_evals)  # fmt: skip
    return Fit(tuple(float(v) for v in res.x), float(res.cost), int(res.nfev))


def errors_under(values: Sequence[float], points: Sequence[ServingPoint]) -> list[dict[str, Any]]:
    """Per point its simulated and published values and relative error under ``values``."""
    sims = simulated(points, values)
    return [{"key": p.key, "label": p.label, "origin": p.origin, "simulated": sim,
             "published": p.published, "error": sim / p.published - 1}
            for p, sim in zip(points, sims, strict=True)]  # fmt: skip


def stats(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    errs = [abs(r["error"]) for r in rows]
    return {"rows": len(errs), "median": median(errs) if errs else float("nan"),
            "max": max(errs, default=float("nan"))}  # fmt: skip


def leave_one_source_out(
    points: Sequence[ServingPoint] | None = None, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Per origin: fit on the others, its rows' errors; the pooled held-out errors (the
    headline); and the fit on all origins with its in-sample errors."""
    points = tuple(points if points is not None else fitted_points())
    origins = [o for o in ORIGINS if any(p.origin == o for p in points)]
    by_origin, pooled = {}, []
    for origin in origins:
        train = [p for p in points if p.origin != origin]
        test = [p for p in points if p.origin == origin]
        fit = fit_constants(train)
        rows = errors_under(fit.values, test)
        pooled += rows
        by_origin[origin] = {**stats(rows), "constants": fit.as_dict(), "rows_detail": rows}
        log(f"  without {origin}: median {by_origin[origin]['median']:.1%},"
            f" max {by_origin[origin]['max']:.1%} ({fit.evaluations} evaluations)")  # fmt: skip
    everything = fit_constants(points)
    in_sample = errors_under(everything.values, points)
    return {
        "free": [c.field for c in FREE],
        "loss": f"{LOSS} on log(simulated / published), f_scale {F_SCALE}",
        "leave_one_source_out": {**stats(pooled), "by_origin": by_origin},
        "all_sources": {
            "constants": everything.as_dict(),
            **stats(in_sample),
            "rows_detail": in_sample,
        },  # fmt: skip
    }
