"""Validate the simulator: simulated vs published numbers, one table, same constants throughout.

Contract: runs the bundled scenarios with their documented inputs (no per-row tuning), prints a
table of simulated vs published values with the signed error, and writes
benchmarks/results/sim_validate.json with the command, date, machine and versions. Rows marked
"headline" are the paper's claims; "check" rows are independent published measurements.
Usage: .venv/bin/python benchmarks/sim_validate.py
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path

import numpy as np

from specrl.sim.runner import run_scenario, simulate_generation
from specrl.sim.scenario import load_scenario

OUT = Path(__file__).parent / "results" / "sim_validate.json"


def _step(name: str, overrides: list[str] | None = None) -> float:
    return run_scenario(load_scenario(name, overrides)).no_spec.schedule.step_time


def _tok_s(name: str, spec: bool, overrides: list[str] | None = None) -> float:
    return simulate_generation(load_scenario(name, overrides), spec).throughput


def _headline_8b(length: float) -> float:
    acc = f"speculation.acceptance.acceptance_length={length}"
    return run_scenario(load_scenario("paper-8b-sync", [acc])).rollout_speedup


def _headline_235b() -> float:
    return run_scenario(load_scenario("paper-235b-async")).end_to_end_speedup_vs_sync_no_spec


def _generation_share() -> float:
    p = run_scenario(load_scenario("paper-8b-sync")).no_spec.phases
    return p.generation / p.total


ROWS = [
    ("headline", "8B sync rollout speedup, accept 2.05", lambda: _headline_8b(2.05), 1.8, "x"),
    ("headline", "8B sync rollout speedup, accept 2.47", lambda: _headline_8b(2.47), 1.8, "x"),
    ("headline", "235B async+spec e2e vs sync no-spec", _headline_235b, 2.5, "x"),
    ("check", "8B generation share of sync step", _generation_share, 0.685, "frac"),
    (
        "check",
        "SGLang Llama-3.1-8B 1xH100 plain",
        lambda: _tok_s("sglang-llama8b-eagle3-h100", False),
        158.34,
        "tok/s",
    ),
    (
        "check",
        "SGLang ... EAGLE-3 (accept 4.4)",
        lambda: _tok_s("sglang-llama8b-eagle3-h100", True),
        373.25,
        "tok/s",
    ),
    (
        "check",
        "NeMo-RL Llama-3.1-8B 16xH100 sync",
        lambda: _step("nemo-rl-llama8b-16xh100"),
        97.7,
        "s/step",
    ),
    (
        "check",
        "NeMo-RL Llama-3.1-8B 16xH100 1-off",
        lambda: _step("nemo-rl-llama8b-16xh100-async"),
        74.6,
        "s/step",
    ),
    (
        "check",
        "NeMo-RL Qwen3-30B-A3B 32xH100 sync",
        lambda: _step("nemo-rl-qwen3-30b-a3b-32xh100"),
        192.0,
        "s/step",
    ),
    (
        "check",
        "NeMo-RL Qwen3-235B 128xH100 sync",
        lambda: _step("nemo-rl-qwen3-235b-128xh100"),
        395.0,
        "s/step",
    ),
    (
        "check",
        "NeMo-RL Qwen3-235B 256xH100 1-off",
        lambda: _step("nemo-rl-qwen3-235b-256xh100-async"),
        231.0,
        "s/step",
    ),
    (
        "check",
        "NeMo-RL Qwen3-235B 64xGB200 sync",
        lambda: _step("nemo-rl-qwen3-235b-64xgb200"),
        286.0,
        "s/step",
    ),
]


def implied_sglang_acceptance() -> float:
    """Acceptance length at which the simulator would match SGLang's 373.25 tok/s."""
    lengths = np.linspace(2.0, 6.0, 81)
    got = [
        _tok_s(
            "sglang-llama8b-eagle3-h100", True, [f"speculation.acceptance.acceptance_length={x}"]
        )
        for x in lengths
    ]
    return float(np.interp(373.25, got, lengths))


def main() -> None:
    rows = []
    print(f"{'tier':<9} {'quantity':<40} {'simulated':>10} {'published':>10} {'error':>8}  unit")
    for tier, label, fn, published, unit in ROWS:
        sim = float(fn())
        err = (sim - published) / published
        rows.append(
            dict(
                tier=tier, quantity=label, simulated=sim, published=published, error=err, unit=unit
            )
        )
        print(f"{tier:<9} {label:<40} {sim:>10.3g} {published:>10.4g} {err:>+8.1%}  {unit}")
    checks = [abs(r["error"]) for r in rows if r["tier"] == "check"]
    implied = implied_sglang_acceptance()
    print(
        f"mean |error| over checks: {np.mean(checks):.1%}; SGLang implied acceptance {implied:.2f}"
    )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps(
            {
                "command": " ".join([Path(sys.executable).name, *sys.argv]),
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "machine": {
                    "platform": platform.platform(),
                    "processor": platform.processor(),
                    "python": platform.python_version(),
                },
                "versions": {"numpy": np.__version__},
                "rows": rows,
                "mean_abs_error_checks": float(np.mean(checks)),
                "sglang_implied_acceptance_length": implied,
            },
            indent=2,
        )
    )
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
