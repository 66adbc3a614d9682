"""Scenarios end to end: headline numbers, overrides, JSON contract, calibration, and the CLI."""

import json

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from specrl.costmodel.cost import StepCostModel
from specrl.costmodel.specs import list_specs, load_hardware, load_model
from specrl.settings import apply_overrides
from specrl.sim.calibrate import fit_trace, parse_trace
from specrl.sim.runner import run_scenario
from specrl.sim.scenario import load_scenario


@pytest.mark.parametrize("length", [2.05, 2.47])
def test_paper_8b_sync_rollout_speedup_near_published(length):
    sc = load_scenario("paper-8b-sync", [f"speculation.acceptance.acceptance_length={length}"])
    res = run_scenario(sc)
    # The 1.8x at acceptance 2.05-2.47 this example was built on is a misattributed summary
    # (the scenario's sources: those were the n-gram's acceptance lengths); the H100 measurements
    # the profile is fitted on (vLLM #20780: 1.64x at 2.36 tokens, batch 1) put k = 3 at 2.05
    # tokens per step lower, and RL batches lower still: speculation must still pay.
    assert 1.2 < res.rollout_speedup < 2.1
    phases = res.no_spec.phases
    assert 0.6 < phases.generation / phases.total < 0.75  # "generation is 65-72% of a step"


def test_rollout_speedup_grows_with_acceptance_and_k5_gains_less_than_k3_at_low_acceptance():
    low = run_scenario(
        load_scenario("paper-8b-sync", ["speculation.acceptance.acceptance_length=2.05"])
    )
    high = run_scenario(
        load_scenario("paper-8b-sync", ["speculation.acceptance.acceptance_length=2.47"])
    )
    assert high.rollout_speedup > low.rollout_speedup
    k5 = run_scenario(
        load_scenario(
            "paper-8b-sync", ["speculation.k=5", "speculation.acceptance.acceptance_length=2.05"]
        )
    )
    assert k5.rollout_speedup < low.rollout_speedup


def test_paper_235b_async_combines_speculation_and_asynchrony():
    res = run_scenario(load_scenario("paper-235b-async", ["workload.seeds=1"]))
    assert res.rollout_speedup > 1.0
    assert res.end_to_end_speedup > 1.0
    spec_sync = run_scenario(
        load_scenario(
            "paper-235b-async",
            ["pipeline.mode=sync", "training.gpus=0", "generation.gpus=256", "workload.seeds=1"],
        )
    )
    assert res.end_to_end_speedup_vs_sync_no_spec > 1.0
    assert spec_sync.end_to_end_speedup > 1.0


def test_json_contract_and_speedups_are_ratios_of_reported_times():
    j = run_scenario(load_scenario("paper-8b-sync")).to_json()
    assert {"rollout_speedup", "end_to_end_speedup", "phases_s", "step_time_s"} <= set(j)
    assert j["end_to_end_speedup"] == pytest.approx(
        j["step_time_s"]["no_spec"] / j["step_time_s"]["speculative"]
    )
    spec_phases = j["phases_s"]["speculative"]
    assert j["step_time_s"]["speculative"] == pytest.approx(sum(spec_phases.values()))
    json.dumps(j)


@pytest.mark.parametrize("name", list_specs("scenarios"))
def test_every_bundled_scenario_runs(name):
    """Every bundled scenario loads, validates and simulates (on a few sequences per replica, so
    that the 2048-GPU projections stay fast; the paper tests run the real batches)."""
    sc = load_scenario(name, ["workload.seeds=1"])
    g = sc.generation
    small = max(8, 4 * (g.gpus // g.gpus_per_replica))
    batch = min(sc.workload.samples_per_step, small)
    overrides = ["workload.seeds=1", f"workload.samples_per_step={batch}"]
    if sc.pipeline.mode == "async":  # the shortest steady-state window
        overrides += ["pipeline.warmup_periods=0", "pipeline.measure_periods=1"]
    res = run_scenario(load_scenario(name, overrides))
    assert res.speculative.schedule.step_time > 0
    assert res.speculative.rollout.tokens > 0


def test_overrides_parse_toml_literals_and_reject_unknown_keys():
    data = apply_overrides({"a": {"b": 1}}, ["a.b=2.5", "a.c=true", "d=eagle3", 'e="x y"'])
    assert data == {"a": {"b": 2.5, "c": True}, "d": "eagle3", "e": "x y"}
    with pytest.raises(ValueError):
        load_scenario("paper-8b-sync", ["workload.no_such_field=1"])


def _synthetic_trace(hw_name="cpu-2core", noise=0.02, seed=0):
    costs = StepCostModel(load_model("smollm2-135m"), load_hardware(hw_name))
    rng = np.random.default_rng(seed)
    records = []
    for b in (1, 2, 4, 8, 16, 32, 64):
        for t, kind in ((1, "decode"), (4, "verify"), (6, "verify")):
            for ctx in (64, 256, 512):
                true = costs.hw.step_overhead_s + costs.target_forward(b, t, ctx)
                records.append(
                    {
                        "batch_size": b,
                        "tokens_per_seq": t,
                        "context_len": ctx,
                        "step_time_s": true * (1 + noise * rng.standard_normal()),
                        "kind": kind,
                    }
                )
    return {"machine": "synthetic", "model": "smollm2-135m", "dtype": "bf16", "records": records}


def test_calibration_recovers_known_efficiencies():
    hw = load_hardware("cpu-2core")
    report = fit_trace(parse_trace(_synthetic_trace(noise=0.0)), hw)
    assert report.profile.eta_mem == pytest.approx(hw.eta_mem, rel=1e-6)
    assert report.profile.eta_compute == pytest.approx(hw.eta_compute, rel=1e-6)
    assert report.profile.step_overhead_s == pytest.approx(hw.step_overhead_s, rel=1e-6)
    noisy = fit_trace(parse_trace(_synthetic_trace(noise=0.03)), hw)
    assert noisy.heldout_error < 0.06 and noisy.n_heldout > 0


def test_cli_simulate_run_json_list_and_calibrate(tmp_path):
    app = typer.Typer()

    @app.command()
    def other() -> None:
        """Another command of the main app."""

    from specrl.sim.cli import register

    register(app)
    runner = CliRunner()
    res = runner.invoke(app, ["simulate", "paper-8b-sync", "--set", "speculation.k=2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["inputs"]["speculation"]["k"] == 2 and out["rollout_speedup"] > 1
    listing = runner.invoke(app, ["simulate", "list"])
    assert "paper-235b-async" in listing.output and "cpu-2core" in listing.output
    helptext = runner.invoke(app, ["simulate", "--help"]).output
    assert "speculation.acceptance.acceptance_length" in helptext
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(_synthetic_trace()))
    prof = tmp_path / "fit.toml"
    res = runner.invoke(app, ["simulate", "calibrate", str(trace), "--out", str(prof), "--json"])
    assert res.exit_code == 0, res.output
    assert load_hardware(str(prof)).name == "cpu-2core-calibrated"
    res = runner.invoke(
        app, ["simulate", "paper-8b-sync", "--out", str(tmp_path / "o"), "--no-tornado"]
    )
    assert res.exit_code == 0 and (tmp_path / "o" / "gantt.png").exists()


def test_sim_package_stands_apart():
    import subprocess
    import sys

    leaves = (
        "specrl.errors",
        "specrl.fsutil",
        "specrl.cli_util",
        "specrl.settings",
        "specrl.config_commands",
    )  # leaves
    code = (  # and the step-cost model it shares with the speculation controller
        "import sys, specrl.sim.cli; bad = [m for m in sys.modules if m == 'torch' or "
        "(m.startswith('specrl.') and not m.startswith(('specrl.sim', 'specrl.costmodel')) "
        f"and m not in {leaves!r})]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
