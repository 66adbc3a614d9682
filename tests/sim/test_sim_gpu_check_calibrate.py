"""`specrl simulate calibrate` on a gpu_check result: fit on some batch sizes, predict the others
and whole rollouts. A synthetic result made from known cost coefficients (the cost model's own
features, 0.5% noise) is recovered; its rollouts are timed by the simulator's rollout model
under those coefficients' profile, built here from its parts (not through ``holdout``), so a
wrong replay of a rollout (acceptance, k, batch, prefill, lengths) shows; a rollout whose
measured time is wrong shows its error."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from specrl.costmodel.cost import StepCostModel
from specrl.costmodel.errors import SimInputError
from specrl.costmodel.fit import Record, features, profile_from_coefficients
from specrl.costmodel.specs import DrafterSpec, load_hardware, load_model
from specrl.sim.acceptance import AcceptanceModel, AcceptanceParams, alpha_for_length
from specrl.sim.calibrate import fit_trace, parse_trace
from specrl.sim.holdout import (
    Rollout,
    complement,
    config_errors,
    left_out,
    parse_rollouts,
    predict_rollout,
    rollout_report,
)
from specrl.sim.rollout import EngineConfig, simulate_rollout

MODEL = load_model("llama-3.1-8b")
# c0, s/byte, s/FLOP, s/verified logit, verify overhead, s/prefill FLOP: an H200-like truth
TRUTH = np.array([3e-4, 1 / 3.8e12, 1 / 6.5e14, 2e-12, 1e-4, 0.0, 0.0])
TRUE_PROFILE = profile_from_coefficients(load_hardware("h200"), TRUTH, "truth")
PROMPT, NEW, K = 512, 256, 5


def records(seed: int = 0) -> list[dict]:
    """Decode at batch 1/8/64/256 and verify k = 3/5/7 at 1/64/256, at three contexts each."""
    rng = np.random.default_rng(seed)
    shapes = [("decode", b, 1) for b in (1, 8, 64, 256)]
    shapes += [("verify", b, k + 1) for b in (1, 64, 256) for k in (3, 5, 7)]
    out = []
    for kind, b, t in shapes:
        for context in (PROMPT + 20, PROMPT + 120, PROMPT + 240):
            rec = Record(b, t, float(context), 1.0, kind, f"bs{b}")
            seconds = float(features(MODEL, rec) @ TRUTH) * (1 + 0.005 * rng.standard_normal())
            out.append({**rec.__dict__, "step_time_s": seconds})
    return out


def rollout_seconds(batch: int, k: int, acceptance_length: float) -> float:
    """Seconds of a rollout of ``batch`` rows of one PROMPT-token prompt, NEW tokens each, under
    the truth: one prefill (it samples the first token), NEW - 1 tokens per row decoded, drafts
    free and accepted i.i.d. at the acceptance length (k = 0: plain)."""
    drafter = DrafterSpec(name="free", kind="ngram") if k else None
    costs = StepCostModel(MODEL, TRUE_PROFILE, drafter=drafter, prefill_group=batch)
    alpha = alpha_for_length(acceptance_length, k) if k else 0.0
    acceptance = AcceptanceModel("constant", AcceptanceParams(alpha))
    cfg = EngineConfig(costs, acceptance, "fixed" if k else "off", k, max_num_seqs=batch)
    prompts, decoded = np.full(batch, PROMPT), np.full(batch, NEW - 1)
    return simulate_rollout(prompts, decoded, cfg, replicas=1).time_s


def rollout_row(batch: int, target: float, measured: float | None = None) -> dict:
    """A gpu_check rollout row, timed by the truth at the measured acceptance length."""
    r = Rollout(f"al{target}_bs{batch}", batch, PROMPT, NEW, K, target, 1.0, 1.0)
    plain, spec = rollout_seconds(batch, 0, 1.0), rollout_seconds(batch, K, measured or target)
    return r.__dict__ | {"plain_s": plain, "spec_s": spec,
                         "measured_acceptance_length": measured or target}  # fmt: skip


def rollouts() -> list[dict]:
    """Rollouts of 256 tokens at batch 1, 8 and 64, plain and at three acceptance lengths, timed
    by the truth; plus a skipped row (left out)."""
    rows = [rollout_row(b, length) for b in (1, 8, 64) for length in (2.0, 2.8, 3.3)]
    return [*rows, {"config": "al2.0_bs256", "batch_size": 256, "skipped": "deadline"}]


def result() -> dict:
    """A gpu_check result's shape: the engine section's trace and rollouts."""
    trace = {"machine": "synthetic H200", "model": "llama-3.1-8b", "dtype": "bf16",
             "hardware": "h200", "records": records()}  # fmt: skip
    return {"summary": {}, "engine": {"trace": trace, "rollouts": rollouts()}}


def fitted(fit: tuple[str, ...] = ("bs1", "bs64")):
    trace = parse_trace(result()["engine"]["trace"])
    held = complement(trace, fit)
    report = fit_trace(trace, load_hardware("h200"), heldout_configs=held)
    return trace, held, report


def test_fit_on_two_batch_sizes_predicts_the_others_and_whole_rollouts() -> None:
    trace, held, report = fitted()
    assert held == ("bs256", "bs8")
    errors = config_errors(MODEL, report.coef, [r for r in trace.records if r.config in held])
    assert set(errors) == {"bs256", "bs8"}
    assert all(e["mape"] < 0.02 and e["worst"] < 0.04 for e in errors.values()), errors
    worst = errors["bs256"]["worst_point"]
    assert abs(worst["predicted_s"] / worst["measured_s"] - 1) == errors["bs256"]["worst"]
    rows = parse_rollouts(result()["engine"]["rollouts"])
    assert len(rows) == 9  # the skipped one left out
    report_rollouts = rollout_report(MODEL, report.profile, rows, frozenset({1, 64}))
    assert report_rollouts["worst"] < 0.03, report_rollouts
    assert [r["batch_fitted"] for r in report_rollouts["rollouts"]] == [True] * 3 + [False] * 3 + [
        True
    ] * 3
    speedups = [(r["speedup"], r["predicted_speedup"]) for r in report_rollouts["rollouts"]]
    assert all(p == pytest.approx(m, rel=0.03) for m, p in speedups)


def test_under_the_truth_every_rollout_is_predicted_exactly() -> None:
    """No fit: each rollout's plain and speculative seconds come back to 1e-6, at the length
    the run measured (2.3 tokens per step against a target of 2.8; the target's would be ~15%
    off)."""
    rows = parse_rollouts([rollout_row(b, 2.8, measured=2.3) for b in (1, 8, 64, 256)])
    assert {r.acceptance_length for r in rows} == {2.3}
    for r in rows:
        plain, spec = predict_rollout(MODEL, TRUE_PROFILE, r)
        assert plain == pytest.approx(r.plain_s, rel=1e-6)
        assert spec == pytest.approx(r.spec_s, rel=1e-6)
    assert rollout_seconds(1, K, 2.8) / rows[0].spec_s - 1 < -0.1


def test_the_replayed_rollout_is_the_measured_one() -> None:
    r = Rollout("x", 4, 100, 65, 5, 3.2, 1.0, 1.0)
    plain, spec = r.replayed(False), r.replayed(True)
    assert plain.k == 0 and plain.prompt_lens == (100,) * 4 and plain.response_lens == (65,) * 4
    assert spec.k == 5 and spec.group == spec.max_seqs == 4  # one prefill, the batch at once
    assert spec.acceptance_length == pytest.approx(3.2, abs=1e-5)
    rates = spec.acceptance()
    assert max(rates) - min(rates) < 1e-5 and spec.coverage() == (1.0,) * 5


def test_a_wrong_rollout_shows_its_error() -> None:
    _, _, report = fitted()
    good = parse_rollouts(result()["engine"]["rollouts"])[2]
    bad = replace(good, spec_s=2 * good.spec_s)  # measured twice as slow as it was
    slow = replace(good, config="slow", plain_s=2 * good.plain_s)
    out = rollout_report(MODEL, report.profile, (bad, slow))
    row = out["rollouts"][0]
    assert row["spec_error"] == pytest.approx(0.5, abs=0.03)
    assert row["plain_error"] < 0.03
    assert out["rollouts"][1]["plain_error"] == pytest.approx(0.5, abs=0.03)
    assert out["worst"] == pytest.approx(0.5, abs=0.03)
    assert out["worst_prediction"] in (f"{good.config} spec", "slow plain")


def test_malformed_rollouts_and_unknown_fit_configs_are_one_line_errors() -> None:
    with pytest.raises(SimInputError, match="rollout 0: spec_s must be a number > 0"):
        parse_rollouts([{**rollouts()[0], "spec_s": "slow"}])
    with pytest.raises(SimInputError, match="rollout 0: acceptance length 7.0 is above k"):
        parse_rollouts([{**rollouts()[0], "measured_acceptance_length": 7.0}])
    with pytest.raises(SimInputError, match="engine.rollouts must be a list"):
        parse_rollouts({"a": 1})
    with pytest.raises(SimInputError, match="unknown fit config 'bs3'"):
        fitted(("bs1", "bs3"))
    failed = {"config": "bs8", "batch_size": 8, "error": "RuntimeError: boom\nTraceback"}
    assert left_out([*rollouts(), failed]) == ("al2.0_bs256 (deadline)", "bs8 (RuntimeError: boom)")


def app() -> typer.Typer:
    from specrl.sim.cli import register

    a = typer.Typer()
    a.command("other")(lambda: None)  # a group needs a sibling command, as in the main app
    register(a)
    return a


def test_cli_calibrates_from_a_gpu_check_result(tmp_path) -> None:
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(result()))
    args = ["simulate", "calibrate", str(path), "--out", str(tmp_path / "fit.toml")]
    res = CliRunner().invoke(app(), [*args, "--fit-configs", "bs1,bs64", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert (
        set(out["heldout_configs"]) == {"bs8", "bs256"} and out["n_heldout"] == 3 + 12
    )  # bs8: 3 decode; bs256: 3 + 9
    assert len(out["rollouts"]["rollouts"]) == 9 and out["rollouts"]["worst"] < 0.03
    assert out["rollouts"]["skipped"] == ["al2.0_bs256 (deadline)"]
    same = CliRunner().invoke(app(), [*args, "--heldout-configs", "bs8,bs256", "--json"])
    assert json.loads(same.output) == out  # the two options are complements
    text = CliRunner().invoke(app(), [*args, "--fit-configs", "bs1,bs64"]).output
    assert "held-out bs256: MAPE" in text and "rollout al3.3_bs1: plain" in text
    held_line = next(line for line in text.splitlines() if line.startswith("held-out bs256"))
    assert "(12 records; worst " in held_line and " B=256 " in held_line  # the worst point
    assert "(a batch not fitted)" in text
    assert "rollouts not measured: al2.0_bs256 (deadline)" in text


def test_a_trace_may_carry_its_rollouts(tmp_path) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(result()["engine"]["trace"] | {"rollouts": rollouts()[:2]}))
    args = ["simulate", "calibrate", str(path), "--out", str(tmp_path / "fit.toml"), "--json"]
    res = CliRunner().invoke(app(), args)
    assert res.exit_code == 0, res.output
    assert [r["config"] for r in json.loads(res.output)["rollouts"]["rollouts"]] == [
        "al2.0_bs1",
        "al2.8_bs1",
    ]


@pytest.mark.parametrize(
    ("content", "options", "message"),
    [
        ({"engine": {"error": "boom"}}, [], "a gpu_check result without an engine trace"),
        ({"summary": {}}, [], "or a gpu_check result with 'engine.trace'"),
        (None, ["--fit-configs", "bs1", "--heldout-configs", "bs8"], "give one"),
    ],
)
def test_cli_refuses_in_one_line(tmp_path, content, options, message) -> None:
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(content if content is not None else result()))
    args = ["simulate", "calibrate", str(path), "--out", str(tmp_path / "fit.toml"), *options]
    res = CliRunner().invoke(app(), args)
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], res.output
