"""`specrl simulate calibrate` on a gpu_check result: fit on some batch sizes, predict the others
and whole rollouts. A synthetic result made from known cost coefficients (the cost model's own
features, 0.5% noise) is recovered; a rollout whose measured time is wrong shows its error."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from specrl.sim.calibrate import Record, fit_trace, parse_trace
from specrl.sim.errors import SimInputError
from specrl.sim.holdout import (
    Rollout,
    complement,
    config_errors,
    parse_rollouts,
    predicted_seconds,
    rollout_records,
    rollout_report,
)
from specrl.sim.specs import load_hardware, load_model

MODEL = load_model("llama-3.1-8b")
# c0, s/byte, s/FLOP, s/verified logit, verify overhead, s/prefill FLOP: an H200-like truth
TRUTH = np.array([3e-4, 1 / 3.8e12, 1 / 6.5e14, 2e-12, 1e-4, 0.0])
PROMPT = 512


def records(seed: int = 0) -> list[dict]:
    """Decode at batch 1/8/64/256 and verify k = 3/5/7 at 1/64/256, at three contexts each."""
    rng = np.random.default_rng(seed)
    shapes = [("decode", b, 1) for b in (1, 8, 64, 256)]
    shapes += [("verify", b, k + 1) for b in (1, 64, 256) for k in (3, 5, 7)]
    out = []
    for kind, b, t in shapes:
        for context in (PROMPT + 20, PROMPT + 120, PROMPT + 240):
            rec = Record(b, t, float(context), 1.0, kind, f"bs{b}")
            seconds = predicted_seconds(MODEL, TRUTH, [rec]) * (1 + 0.005 * rng.standard_normal())
            out.append({**rec.__dict__, "step_time_s": seconds})
    return out


def rollouts() -> list[dict]:
    """Rollouts of 256 tokens at batch 1 and 64, plain and at three acceptance lengths, timed
    by the truth; plus a skipped row (left out)."""
    rows = []
    for b in (1, 64):
        for length in (2.0, 2.8, 3.3):
            r = Rollout(f"al{length}_bs{b}", b, PROMPT, 256, 5, length, 1.0, 1.0)
            plain = predicted_seconds(MODEL, TRUTH, rollout_records(r, False))
            spec = predicted_seconds(MODEL, TRUTH, rollout_records(r, True))
            rows.append(r.__dict__ | {"plain_s": plain, "spec_s": spec,
                                      "measured_acceptance_length": length})  # fmt: skip
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
    rows = parse_rollouts(result()["engine"]["rollouts"])
    assert len(rows) == 6  # the skipped one left out
    report_rollouts = rollout_report(MODEL, report.coef, rows)
    assert report_rollouts["worst"] < 0.03, report_rollouts
    speedups = [(r["speedup"], r["predicted_speedup"]) for r in report_rollouts["rollouts"]]
    assert all(p == pytest.approx(m, rel=0.03) for m, p in speedups)


def test_a_wrong_rollout_shows_its_error() -> None:
    _, _, report = fitted()
    good = parse_rollouts(result()["engine"]["rollouts"])[2]
    bad = replace(good, spec_s=2 * good.spec_s)  # measured twice as slow as it was
    row = rollout_report(MODEL, report.coef, (bad,))["rollouts"][0]
    assert row["spec_error"] == pytest.approx(0.5, abs=0.03)
    assert row["plain_error"] < 0.03


def test_rollout_steps_follow_the_acceptance_length() -> None:
    r = Rollout("x", 4, 100, 65, 5, 3.2, 1.0, 1.0)
    plain, spec = rollout_records(r, False), rollout_records(r, True)
    assert [x.kind for x in plain[:2]] == ["prefill", "decode"] and len(plain) == 65
    assert len(spec) == 1 + 20 and {x.tokens_per_seq for x in spec[1:]} == {6}  # ceil(64/3.2)
    assert spec[-1].context_len == pytest.approx(101 + 19 * 3.2)


def test_malformed_rollouts_and_unknown_fit_configs_are_one_line_errors() -> None:
    with pytest.raises(SimInputError, match="rollout 0: spec_s must be a number > 0"):
        parse_rollouts([{**rollouts()[0], "spec_s": "slow"}])
    with pytest.raises(SimInputError, match="engine.rollouts must be a list"):
        parse_rollouts({"a": 1})
    with pytest.raises(SimInputError, match="unknown fit config 'bs3'"):
        fitted(("bs1", "bs3"))


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
    assert len(out["rollouts"]["rollouts"]) == 6 and out["rollouts"]["worst"] < 0.03
    text = CliRunner().invoke(app(), [*args, "--fit-configs", "bs1,bs64"]).output
    assert "held-out bs256: MAPE" in text and "rollout al3.3_bs1: plain" in text


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
