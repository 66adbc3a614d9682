"""Engine terms of the cost model (prefill groups, draft coverage, verify sampler) and their fit."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import typer
from typer.testing import CliRunner

from specrl.costmodel.cost import ForwardShape, StepCostModel, forward_flops
from specrl.costmodel.specs import (
    list_specs,
    load_drafter,
    load_hardware,
    load_model,
    with_overrides,
)
from specrl.sim.calibrate import fit_trace, parse_trace
from specrl.sim.runner import hardware
from specrl.sim.scenario import load_scenario

SMOL = load_model("smollm2-135m")


def costs(**kw) -> StepCostModel:
    return StepCostModel(SMOL, load_hardware("cpu-2core"), 1, load_drafter("ngram"), **kw)


SAMPLER_BYTES_PER_LOGIT = 40.0  # the GPU profiles' rejection sampler + logprobs traffic


@pytest.mark.parametrize("hw", list_specs("hardware"))
def test_gpu_profiles_price_the_sampler_by_its_bytes_and_the_cpu_base_fits_it(hw):
    spec = load_hardware(hw)
    if hw.startswith("cpu"):
        assert spec.verify_s_per_logit == 0.0  # `specrl simulate calibrate` fits it
        return
    bandwidth = spec.hbm_bandwidth * spec.eta_mem
    assert spec.verify_s_per_logit == pytest.approx(SAMPLER_BYTES_PER_LOGIT / bandwidth, rel=2e-3)


def test_default_terms_change_nothing():
    plain, explicit = costs(), costs(prefill_group=1, draft_coverage=())
    for n, k, ctx in [(1, 3, 100), (16, 2, 500), (64, 3, 40)]:
        assert plain.step(n, k, ctx) == explicit.step(n, k, ctx)
        assert plain.verify_tokens(k, n) == k + 1
        assert plain.prefill(n, ctx) == explicit.prefill(n, ctx)


def test_prefill_group_prefills_each_prompt_once():
    assert costs(prefill_group=4).prefill(8, 100) == costs().prefill(2, 100)
    assert costs(prefill_group=4).prefill(9, 100) == costs().prefill(3, 100)


def test_draft_coverage_pads_verify_to_the_longest_draft():
    assert costs(draft_coverage=(1.0,)).verify_tokens(3, 5) == 4
    assert costs(draft_coverage=(0.0,)).verify_tokens(3, 5) == 1
    assert costs(draft_coverage=(0.3, 0.2, 0.1)).verify_tokens(3, 1) == pytest.approx(1.6)
    # the last given position repeats for longer drafts; n rows: 1 - (1 - c)^n per position
    want = 1 + (1 - 0.5**4) + 2 * (1 - 0.75**4)
    assert costs(draft_coverage=(0.5, 0.25)).verify_tokens(3, 4) == pytest.approx(want)
    assert costs(draft_coverage=(0.2,)).verify_tokens(3, 10_000) == pytest.approx(4)


def test_verify_sampler_prices_every_verified_logit():
    base = costs()
    sampler = replace(base, hw=with_overrides(base.hw, verify_s_per_logit=1e-9))
    extra = sampler.verify(8, 3, 200) - base.verify(8, 3, 200)
    assert extra == pytest.approx(8 * 4 * SMOL.vocab * 1e-9)
    assert sampler.decode(8, 200) == base.decode(8, 200)


def test_prefill_rate_adds_to_prefills_only():
    base = costs()
    own = replace(base, hw=with_overrides(base.hw, prefill_s_per_flop=1e-12))
    flops = forward_flops(SMOL, ForwardShape(3, 100, 0.0))
    assert own.prefill(3, 100) - base.prefill(3, 100) == pytest.approx(flops * 1e-12)
    assert own.decode(8, 200) == base.decode(8, 200)


def test_forwards_wider_than_the_largest_graph_pay_host_launches_per_layer():
    base = costs()
    capped = replace(
        base, hw=with_overrides(base.hw, graph_capture_tokens=32, eager_s_per_layer=1e-4)
    )
    eager = SMOL.layers * 1e-4
    assert capped.decode(32, 200) == base.decode(32, 200)  # 32 tokens: graphed
    assert capped.decode(33, 200) - base.decode(33, 200) == pytest.approx(eager)
    assert capped.verify(8, 3, 200) == base.verify(8, 3, 200)  # 8 x 4 = 32 tokens
    assert capped.verify(8, 4, 200) - base.verify(8, 4, 200) == pytest.approx(eager)
    assert capped.prefill(1, 40) - base.prefill(1, 40) == pytest.approx(eager)
    no_cap = replace(base, hw=with_overrides(base.hw, eager_s_per_layer=1e-4))  # cap 0: no limit
    assert no_cap.step(64, 3, 200) == base.step(64, 3, 200)


def test_a_wide_catch_up_forward_of_the_drafter_pays_for_its_own_layers():
    hw = load_hardware("h100")
    base = StepCostModel(load_model("qwen3-8b"), hw, 1, load_drafter("eagle3"))
    capped = replace(base, hw=with_overrides(hw, graph_capture_tokens=100, eager_s_per_layer=1e-4))
    head = base.draft_model
    assert head is not None and 0 < head.layers < base.target.layers
    # 32 rows at k = 3: the catch-up forward is 128 tokens wide, the next two 32
    assert capped.draft(32, 3, 900) - base.draft(32, 3, 900) == pytest.approx(head.layers * 1e-4)
    extra = capped.step(32, 3, 900) - base.step(32, 3, 900)
    assert extra == pytest.approx((head.layers + base.target.layers) * 1e-4)


def test_scenario_engine_table_sets_the_graph_terms():
    over = ["engine.graph_capture_tokens=1024", "engine.eager_s_per_layer=2e-5"]
    hw = hardware(load_scenario("paper-8b-rlzero-sync", over))
    assert (hw.graph_capture_tokens, hw.eager_s_per_layer) == (1024, 2e-5)
    default = hardware(load_scenario("paper-8b-rlzero-sync"))
    assert (default.graph_capture_tokens, default.eager_s_per_layer) == (0, 0.0)


def _record(kind: str, b: int, t: int, ctx: int, seconds: float, config: str) -> dict:
    return {"kind": kind, "batch_size": b, "tokens_per_seq": t, "context_len": ctx,
            "step_time_s": seconds, "config": config}  # fmt: skip


def _trace(truth: StepCostModel, cpu_s_per_seq: float) -> dict:
    """Records priced exactly by ``truth``: run "small" at batch 1-4, run "big" at 16-64."""
    records = []
    step = truth.hw.step_overhead_s
    for config, batches in (("small", (1, 2, 4)), ("big", (16, 32, 64))):
        for b in batches:
            records.append(_record("prefill", b, 40, 0, truth.prefill(b, 40), config))
            for ctx in (32, 128, 512):
                records += [
                    _record("decode", b, 1, ctx, step + truth.target_forward(b, 1, ctx), config),
                    _record("verify", b, 4, ctx, step + truth.verify(b, 3, ctx), config),
                    _record("draft", b, 3, ctx, cpu_s_per_seq * b, config),
                ]
    meta = {"machine": "synthetic", "model": "smollm2-135m", "hardware": "cpu-2core"}
    return meta | {"drafter": "ngram", "records": records}


def test_calibration_recovers_the_verify_sampler_prefill_and_drafter_cost():
    hw = with_overrides(
        load_hardware("cpu-2core"), verify_s_per_logit=3e-9, prefill_s_per_flop=2e-12
    )
    trace = parse_trace(_trace(StepCostModel(SMOL, hw), cpu_s_per_seq=2e-4))
    report = fit_trace(trace, load_hardware("cpu-2core"), heldout_configs=("big",))
    assert report.profile.verify_s_per_logit == pytest.approx(3e-9, rel=1e-6)
    assert report.profile.prefill_s_per_flop == pytest.approx(2e-12, rel=1e-6)
    assert report.profile.step_overhead_s == pytest.approx(hw.step_overhead_s, rel=1e-6)
    assert report.drafter.cpu_s_per_seq == pytest.approx(2e-4)
    assert report.drafter.kind == "ngram"
    assert report.n_fit == report.n_heldout == 21  # whole runs held out, draft records aside
    assert report.heldout_error == pytest.approx(0.0, abs=1e-9)


def test_cli_calibrate_takes_base_from_trace_and_writes_the_drafter(tmp_path):
    from specrl.sim.cli import register

    app = typer.Typer()
    app.command("other")(lambda: None)  # a group needs a sibling command, as in the main app
    register(app)
    hw = with_overrides(load_hardware("cpu-2core"), verify_s_per_logit=3e-9)
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(_trace(StepCostModel(SMOL, hw), 2e-4)))
    prof = tmp_path / "fit.toml"
    args = ["simulate", "calibrate", str(trace), "--out", str(prof), "--heldout-configs", "big"]
    res = CliRunner().invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["n_heldout"] == 21 and out["drafter"]["cpu_s_per_seq"] == pytest.approx(2e-4)
    assert load_hardware(str(prof)).name == "cpu-2core-calibrated"
    drafter = load_drafter(str(tmp_path / "fit-drafter.toml"))
    assert drafter.cpu_s_per_seq == pytest.approx(2e-4)
