"""Reports: text summary, sensitivity (tornado) analysis, and the Gantt and tornado PNGs.

Contract: ``sensitivity(sc)`` re-runs a scenario with each uncertain input moved to a low and a high
value (``uncertain_inputs``: acceptance length, training MFU, length tail, refit bandwidth, and
where they act the acceptance decay, the drafter's forward overhead or CPU cost, the fixed
per-layer costs, MoE routing locality and skew) and returns the end-to-end speedup (vs sync
without speculation) at each end. The PNG writers import matplotlib lazily (Agg backend) so
that importing specrl.sim never needs it. No simulation logic lives here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrl.costmodel.drafters import draft_forward
from specrl.costmodel.specs import HardwareSpec, ModelSpec, load_hardware, load_model
from specrl.settings import apply_overrides
from specrl.sim.runner import ScenarioResult, hardware, run_scenario
from specrl.sim.runner import drafter as scenario_drafter
from specrl.sim.scenario import Scenario
from specrl.sim.training import load_efficiency


@dataclass(frozen=True)
class Swing:
    label: str
    low_value: float
    high_value: float
    low_speedup: float
    high_speedup: float


def _baseline_mfu(sc: Scenario) -> float:
    return sc.training.mfu or load_efficiency(load_model(sc.model)).train_mfu


def _scaled(label: str, key: str, value: float, low: float, high: float, top: float = np.inf):
    return (label, key, value * low, min(top, value * high))


def uncertain_inputs(sc: Scenario) -> list[tuple[str, str, float, float]]:
    """(label, dotted key, low, high) for each uncertain input around the scenario's value; only
    inputs that act on the scenario (drift, a model drafter's overhead, a model-free drafter's
    CPU cost, MoE routing) are listed."""
    acc, spec = sc.speculation.acceptance, sc.speculation
    hw, drafter = hardware(sc), scenario_drafter(sc)
    model = load_model(sc.model)
    out = [
        _scaled(
            "acceptance length", "speculation.acceptance.acceptance_length",
            acc.acceptance_length, 0.85, 1.15, float(acc.at_k + 1),
        ),
        _scaled("training MFU", "training.mfu", _baseline_mfu(sc), 0.7, 1.3, 1.0),
        _scaled("length tail (sigma)", "workload.response_sigma", sc.workload.response_sigma,
                0.75, 1.25),
        _scaled("refit bandwidth", "pipeline.refit_bandwidth", sc.pipeline.refit_bandwidth,
                0.5, 2.0),
    ]  # fmt: skip
    if acc.kind == "drift" and acc.decay_per_1k_tokens > 0:
        out.append(
            _scaled("acceptance decay", "speculation.acceptance.decay_per_1k_tokens",
                    acc.decay_per_1k_tokens, 0.5, 1.5)
        )  # fmt: skip
    if spec.enabled and draft_forward(drafter, model) is not None:
        out.append(
            _scaled("draft forward overhead", "engine.forward_overhead_s",
                    hw.forward_overhead_s, 0.5, 2.0)
        )  # fmt: skip
    elif spec.enabled and drafter.cpu_s_per_ctx_token > 0:
        out.append(
            _scaled("drafter CPU per context token", "engine.cpu_s_per_ctx_token",
                    drafter.cpu_s_per_ctx_token, 0.5, 2.0)
        )  # fmt: skip
    out += _floor_inputs(hw, model)
    if model.is_moe:
        loc = sc.generation.routing_locality
        key = "generation.routing_locality"
        out.append(("MoE routing locality", key, loc, min(1.0, loc + 0.5)))
    if model.is_moe and sc.generation.ep > 1:
        out.append(_scaled("MoE routing skew", "generation.routing_skew",
                           sc.generation.routing_skew, 1.0, 1.5))  # fmt: skip
    return out


FLOOR_REFERENCE = "h100"  # the profile whose floors were fitted (specrl.sim.fidelity)


def _floor_inputs(hw: HardwareSpec, model: ModelSpec) -> list[tuple[str, str, float, float]]:
    """The fixed per-layer costs (``cost.layer_floor``; the MoE ones for a MoE model): half to
    twice the profile's, or 0 to the fitted Hopper profile's where the profile has none."""
    hopper = load_hardware(FLOOR_REFERENCE)
    terms = [("per-layer floor", "layer_s")]
    if model.is_moe:
        terms += [("MoE layer floor", "moe_layer_s"), ("per-expert floor", "expert_s")]
    out = []
    for label, field in terms:
        value = getattr(hw, field)
        low, high = (0.5 * value, 2.0 * value) if value else (0.0, getattr(hopper, field))
        if high > 0:
            out.append((label, f"engine.{field}", low, high))
    return out


def _speedup_with(sc: Scenario, key: str, value: float) -> float:
    data = apply_overrides(sc.model_dump(), [f"{key}={value!r}"])
    return run_scenario(Scenario.model_validate(data)).end_to_end_speedup_vs_sync_no_spec


def sensitivity(sc: Scenario) -> list[Swing]:
    """End-to-end speedup (vs sync, no speculation) at the low and high end of each input."""
    swings = []
    for label, key, low, high in uncertain_inputs(sc):
        swings.append(
            Swing(label, low, high, _speedup_with(sc, key, low), _speedup_with(sc, key, high))
        )
    return sorted(swings, key=lambda s: abs(s.high_speedup - s.low_speedup), reverse=True)


def _speedup_line(label: str, value: float, spread: dict, note: str = "") -> str:
    lo, hi = spread["min"], spread["max"]
    seeds = f" (seeds {lo:.2f}-{hi:.2f}x)" if len(spread["per_seed"]) > 1 else ""
    return f"  {label:<26} {value:.2f}x{seeds}{note}"


def _steps_header(mode: str, conv: dict) -> str:
    if mode != "async":
        return "  seconds per step (mean over seeds):"
    return (
        f"  seconds per step (mean over seeds; steady state: {conv['measured_steps']} steps"
        f" measured after {conv['warmup_steps']} warm-up, {conv['steps_simulated']} simulated):"
    )


def text_summary(res: ScenarioResult) -> str:
    """Speedups (with their spread over length seeds), steady-state seconds per step, warnings."""
    j = res.to_json()
    sp, conv = j["spread"], j["convergence"]["speculative"]
    staleness = f" (staleness {res.scenario.pipeline.staleness})" if j["mode"] == "async" else ""
    lines = [
        f"scenario {j['scenario']}: {j['model']} on {j['hardware']}, {j['mode']} pipeline"
        f"{staleness}, {len(j['seeds'])} length seed(s)",
        _speedup_line("rollout speedup", j["rollout_speedup"], sp["rollout_speedup"]),
        _speedup_line(
            "end-to-end speedup",
            j["end_to_end_speedup"],
            sp["end_to_end_speedup"],
            " (same pipeline, no spec)",
        ),
        _speedup_line(
            "vs sync without spec",
            j["end_to_end_speedup_vs_sync_no_spec"],
            sp["end_to_end_speedup_vs_sync_no_spec"],
        ),
        _steps_header(j["mode"], conv),
    ]
    for run, phases in j["phases_s"].items():
        parts = "  ".join(f"{k}={v:.1f}" for k, v in phases.items())
        lines.append(f"    {run:<12} step={j['step_time_s'][run]:.1f}  {parts}")
    lines += [f"  warning: {w}" for w in j["warnings"]]
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


PHASE_COLORS = {
    "generation": "tab:blue",
    "logprobs": "tab:orange",
    "train": "tab:green",
    "drafter_train": "tab:purple",
    "overhead": "tab:gray",
    "refit": "tab:red",
}


def gantt_png(res: ScenarioResult, path: Path) -> Path:
    """Timeline of the speculative pipeline and its baselines, one row per resource."""
    plt = _pyplot()
    runs = {"speculative": res.speculative, "no_spec": res.no_spec}
    if res.sync_no_spec is not res.no_spec:
        runs["sync_no_spec"] = res.sync_no_spec
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.6 + 1.3 * len(runs)), sharex=True)
    for ax, (name, run) in zip(list(axes) if len(runs) > 1 else [axes], runs.items(), strict=True):
        resources = sorted({i.resource for i in run.schedule.intervals})
        for iv in run.schedule.intervals:
            y = resources.index(iv.resource)
            ax.barh(y, iv.end_s - iv.start_s, left=iv.start_s, color=PHASE_COLORS[iv.phase])
        ax.set_yticks(range(len(resources)), resources)
        ax.set_title(f"{name}: {run.schedule.step_time:.1f} s/step", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in PHASE_COLORS.values()]
    fig.legend(handles, list(PHASE_COLORS), loc="lower center", ncol=6, fontsize=8)
    fig.supxlabel("seconds")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def tornado_png(swings: list[Swing], center: float, path: Path, title: str = "") -> Path:
    """Horizontal bars of the speedup range each uncertain input spans."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.5 * len(swings)))
    for y, s in enumerate(reversed(swings)):
        lo, hi = sorted((s.low_speedup, s.high_speedup))
        ax.barh(y, hi - lo, left=lo, color="tab:blue")
        ax.text(hi, y, f" {s.low_value:.3g} .. {s.high_value:.3g}", va="center", fontsize=7)
    ax.set_yticks(range(len(swings)), [s.label for s in reversed(swings)])
    ax.axvline(center, color="black", lw=1)
    ax.set_xlabel("end-to-end speedup vs sync without speculation")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
