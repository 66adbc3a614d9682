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
from specrl.sim.specs import load_hardware, load_model

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


def _phase(name: str, phase: str) -> float:
    run = run_scenario(load_scenario(name)).no_spec
    if phase == "total":
        return run.schedule.step_time
    return getattr(run.phases, phase)


# (label, scenario, published s/step): NeMo-RL v0.6 summary (Llama rows: v0.4 summary)
NEMO_RL_STEPS = [
    ("Llama-3.1-8B 16xH100 sync", "nemo-rl-llama8b-16xh100", 97.7),
    ("Llama-3.1-8B 16xH100 1-off", "nemo-rl-llama8b-16xh100-async", 74.6),
    ("Qwen3-30B-A3B 32xH100 sync", "nemo-rl-qwen3-30b-a3b-32xh100", 192.0),
    ("Qwen3-30B-A3B 32xH100 1-off", "nemo-rl-qwen3-30b-a3b-32xh100-async", 152.0),
    ("Qwen3-235B 128xH100 sync", "nemo-rl-qwen3-235b-128xh100", 395.0),
    ("Qwen3-235B 256xH100 sync", "nemo-rl-qwen3-235b-256xh100", 312.0),
    ("Qwen3-235B 256xH100 1-off", "nemo-rl-qwen3-235b-256xh100-async", 231.0),
    ("Qwen3-235B 64xGB200 sync", "nemo-rl-qwen3-235b-64xgb200", 286.0),
]
# NeMo-RL v0.3 blog: published per-phase seconds of one colocated step
NEMO_RL_V03_PHASES = [
    (
        "Llama-8B 8xH100",
        "nemo-rl-v03-llama8b-8xh100",
        {"generation": 58.0, "train": 28.0, "logprobs": 18.0, "refit": 5.0, "total": 112.0},
    ),
    (
        "Qwen3-30B-A3B 64xH100",
        "nemo-rl-v03-qwen3-30b-a3b-64xh100",
        {"generation": 78.0, "train": 50.0, "logprobs": 23.0, "refit": 12.0, "total": 167.0},
    ),
]


def implied_train_mfu(name: str, published: float) -> float | None:
    """Training MFU at which a colocated sync scenario would match its published step time, all
    other phases as simulated (None when the other phases alone already exceed it)."""
    sc = load_scenario(name)
    p = run_scenario(sc).no_spec.phases
    mfu = sc.training.mfu or load_hardware(sc.hardware).train_mfu(load_model(sc.model))
    flops_s_at_full = (p.logprobs + p.train) * mfu
    rest = p.total - p.logprobs - p.train
    return flops_s_at_full / (published - rest) if published > rest else None


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
    *[
        ("check", f"NeMo-RL {label}", (lambda n=name: _step(n)), pub, "s/step")
        for label, name, pub in NEMO_RL_STEPS
    ],
    *[
        (
            "phase",
            f"NeMo-RL v0.3 {label} {phase}",
            (lambda n=name, ph=phase: _phase(n, ph)),
            pub,
            "s",
        )
        for label, name, published in NEMO_RL_V03_PHASES
        for phase, pub in published.items()
    ],
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
    mfus = {
        label: implied_train_mfu(name, pub)
        for label, name, pub in NEMO_RL_STEPS
        if load_scenario(name).pipeline.mode == "sync"
    }
    mfus.update(
        {
            f"v0.3 {label}": implied_train_mfu(name, published["total"])
            for label, name, published in NEMO_RL_V03_PHASES
        }
    )
    print("implied training MFU (sync rows):", {k: v and round(v, 3) for k, v in mfus.items()})
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
                "implied_train_mfu_sync_rows": mfus,
            },
            indent=2,
        )
    )
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
