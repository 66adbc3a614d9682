"""The calibration grid of ``specrl bench gpu --mode calibrate`` (``specrl.gpubench.calibrate``)
on the CPU in smoke: its trace feeds the calibrate CLI."""

from __future__ import annotations

import json

import typer
from typer.testing import CliRunner

from specrl.config_gpubench import load_gpubench
from specrl.gpubench.calibrate import grid_of, run_calibrate
from specrl.gpubench.common import prepare


def test_tiny_cpu_trace_is_accepted_by_simulate_calibrate(tmp_path):
    trace = tmp_path / "trace.json"
    sets = ['run.mode="calibrate"', "run.smoke=true", 'run.device="cpu"', "calibrate.repeats=1",
            f"run.out={json.dumps(str(trace))}"]  # fmt: skip
    cfg = load_gpubench(None, sets)
    run_calibrate(cfg, prepare(cfg))
    data = json.loads(trace.read_text())
    kinds = {r["kind"] for r in data["records"]}
    assert kinds == {"decode", "verify", "prefill"}
    assert {r["tokens_per_seq"] for r in data["records"] if r["kind"] == "verify"} == {4}
    assert len(data["records"]) == len(grid_of(cfg).points())  # the budget stopped none

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


def test_the_default_grid_is_the_documented_one():
    """docs/gpu.md: 40 decode + 39 verify points whose KV cache fits 300k tokens, and 3
    prefills; a smaller --max-kv-tokens keeps fewer."""
    points = grid_of(load_gpubench(None, ['run.mode="calibrate"'])).points()
    count = {k: sum(p.kind == k for p in points) for k in ("decode", "verify", "prefill")}
    assert count == {"decode": 40, "verify": 39, "prefill": 3}
    assert all(p.batch * (p.context + p.tokens) <= 300_000 for p in points)
    fewer = grid_of(load_gpubench(None, ['run.mode="calibrate"', "calibrate.max_kv_tokens=4096"]))
    assert 3 < len(fewer.points()) < len(points)
