"""Reports: text summary, sensitivity (tornado) analysis, and the Gantt and tornado PNGs.

Contract: ``sensitivity(sc)`` re-runs a scenario with each uncertain input moved to a low and a high
value (``UNCERTAIN_INPUTS``: acceptance, training MFU, length tail, refit bandwidth, MoE routing
locality) and returns the end-to-end speedup at each end. The PNG writers import matplotlib lazily
(Agg backend) so that importing specrl.sim never needs it. No simulation logic lives here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specrl.sim.runner import ScenarioResult, run_scenario
from specrl.sim.scenario import Scenario, apply_overrides
from specrl.sim.specs import load_hardware, load_model


@dataclass(frozen=True)
class Swing:
    label: str
    low_value: float
    high_value: float
    low_speedup: float
    high_speedup: float


def _baseline_mfu(sc: Scenario) -> float:
    return sc.training.mfu or load_hardware(sc.hardware).train_mfu(load_model(sc.model))


def uncertain_inputs(sc: Scenario) -> list[tuple[str, str, float, float]]:
    """(label, dotted key, low, high) for each uncertain input around the scenario's value."""
    acc = sc.speculation.acceptance
    mfu = _baseline_mfu(sc)
    sigma = sc.workload.response_sigma
    bw = sc.pipeline.refit_bandwidth
    loc = sc.generation.routing_locality
    top = float(acc.at_k + 1)
    return [
        (
            "acceptance length",
            "speculation.acceptance.acceptance_length",
            max(1.0, acc.acceptance_length * 0.85),
            min(top, acc.acceptance_length * 1.15),
        ),
        ("training MFU", "training.mfu", mfu * 0.7, min(1.0, mfu * 1.3)),
        ("length tail (sigma)", "workload.response_sigma", sigma * 0.75, sigma * 1.25),
        ("refit bandwidth", "pipeline.refit_bandwidth", bw * 0.5, bw * 2.0),
        ("MoE routing locality", "generation.routing_locality", loc, min(1.0, loc + 0.5)),
    ]


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
