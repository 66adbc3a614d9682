"""benchmarks/gpu_calibrate.py end to end on the CPU (--tiny): its trace feeds the calibrate CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import typer
from typer.testing import CliRunner

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_calibrate.py"


def test_tiny_cpu_trace_is_accepted_by_simulate_calibrate(tmp_path):
    trace = tmp_path / "trace.json"
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--repeats", "1"]
    subprocess.run([*cmd, "--out", str(trace)], check=True, env=env, capture_output=True)
    data = json.loads(trace.read_text())
    kinds = {r["kind"] for r in data["records"]}
    assert kinds == {"decode", "verify", "prefill"}
    assert {r["tokens_per_seq"] for r in data["records"] if r["kind"] == "verify"} == {4}

    from specrl.sim.cli import register

    app = typer.Typer()
    app.command("other")(lambda: None)  # a group needs a sibling command, as in the main app
    register(app)
    prof = tmp_path / "fit.toml"
    res = CliRunner().invoke(
        app, ["simulate", "calibrate", str(trace), "--out", str(prof), "--json"]
    )
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["n_fit"] + report["n_heldout"] == len(data["records"])
    assert report["profile"]["name"] == "cpu-2core-calibrated" and prof.exists()
