"""Bad inputs to `specrl simulate run` and `calibrate`: one `error:` line, exit 2, no simulation.

Every case runs with the simulation and the fit replaced by functions that fail the test, so a
case also proves that its input is rejected before any simulation work.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specrl.costmodel.errors import SimInputError
from specrl.costmodel.specs import data_root
from specrl.sim import runner as sim_runner
from specrl.sim.cli import build_app
from specrl.sim.runner import run_scenario
from specrl.sim.scenario import load_scenario

SYNC = "paper-8b-sync"
ASYNC = "paper-235b-async"
RLZERO = "paper-8b-rlzero-sync"
MOE = "paper-235b-async-512"


def _no_work(*args, **kwargs):
    raise AssertionError("simulation or fit work started before the input was validated")


@pytest.fixture(autouse=True)
def forbid_work(monkeypatch):
    monkeypatch.setattr(sim_runner, "simulate_rollout", _no_work)
    monkeypatch.setattr(sim_runner, "simulate_continuous", _no_work)
    monkeypatch.setattr("specrl.sim.cli.fit_trace", _no_work)


def _invoke(args: list[str]):
    return CliRunner().invoke(build_app(), args)


def _assert_one_error_line(res, expect: str) -> str:
    assert res.exit_code == 2, res.output
    assert isinstance(res.exception, SystemExit), res.exception
    assert "Traceback" not in res.output
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ")
    assert expect in lines[0], lines[0]
    return lines[0]


def _set(scenario: str, *items: str) -> list[str]:
    return [scenario, *[arg for item in items for arg in ("--set", item)]]


RUN_CASES = {
    "unknown-scenario": (["nope"], "valid: nemo-rl-llama8b-16xh100"),
    "scenario-did-you-mean": (["paper-8b-syn"], "did you mean paper-8b-sync?"),
    "run-subcommand": (["run", "nope"], "unknown scenario spec 'nope'"),
    "negative-gpus": (_set(SYNC, "generation.gpus=-1"), "generation.gpus"),
    "zero-gpus": (_set(SYNC, "generation.gpus=0"), "greater than 0"),
    "tp-not-dividing": (_set(SYNC, "generation.gpus_per_replica=3"), "not a multiple"),
    "replica-above-pool": (_set(SYNC, "generation.gpus_per_replica=16"), "8 GPUs would sit"),
    "async-no-training-gpus": (_set(ASYNC, "training.gpus=0"), "training.gpus > 0"),
    "async-baseline-gpus": (_set(ASYNC, "training.gpus=124"), "sync baseline on all 252"),
    "sync-training-gpus": (_set(SYNC, "training.gpus=8"), "set training.gpus=0"),
    "acceptance-zero": (
        _set(SYNC, "speculation.acceptance.acceptance_length=0"),
        "greater than or equal to 1",
    ),
    "acceptance-negative": (
        _set(SYNC, "speculation.acceptance.acceptance_length=-1"),
        "greater than or equal to 1",
    ),
    "acceptance-below-one": (
        _set(SYNC, "speculation.acceptance.acceptance_length=0.5"),
        "greater than or equal to 1",
    ),
    "acceptance-above-k-plus-1": (
        _set(SYNC, "speculation.acceptance.acceptance_length=4.5"),
        "above at_k + 1 = 4",
    ),
    "acceptance-above-at-k": (
        _set(SYNC, "speculation.acceptance.at_k=1", "speculation.acceptance.acceptance_length=3"),
        "above at_k + 1 = 2",
    ),
    "k-zero": (_set(SYNC, "speculation.k=0"), "greater than or equal to 1"),
    "k-not-a-number": (_set(SYNC, "speculation.k=abc"), 'expected an integer (got "abc")'),
    "k-bool": (_set(SYNC, "speculation.k=true"), "expected an integer (got true)"),
    "gpus-float": (_set(SYNC, "generation.gpus=2.5"), "expected an integer"),
    "mean-inf": (_set(SYNC, "workload.mean_response_len=inf"), "finite number"),
    "bool-string": (_set(SYNC, "speculation.enabled=yes"), "expected true or false"),
    "unknown-key": (_set(SYNC, "speculation.kk=3"), "did you mean speculation.k?"),
    "unknown-section": (_set(SYNC, "specualtion.k=3"), "did you mean speculation?"),
    "removed-key-lists-valid": (_set(SYNC, "pipeline.steps=6"), "pipeline.warmup_periods"),
    "not-key-value": (_set(SYNC, "speculation.k"), "expected section.key=value"),
    "empty-key-part": (_set(SYNC, "speculation..k=3"), "expected section.key=value"),
    "key-below-value": (_set(SYNC, "model.x=1"), "model is not a table"),
    "value-for-table": (_set(SYNC, "speculation=3"), "expected a table"),
    "unknown-model": (_set(SYNC, "model=qwen3-8"), "did you mean qwen3-8b?"),
    "unknown-hardware": (_set(SYNC, "hardware=h10"), "valid: b200, cpu-2core"),
    "unknown-drafter": (_set(SYNC, "speculation.drafter=eagle"), "did you mean eagle3?"),
    "missing-spec-file": (_set(SYNC, "hardware=/nonexistent/h.toml"), "not found"),
    "unknown-acceptance-kind": (
        _set(SYNC, "speculation.acceptance.kind=constnat"),
        "did you mean constant?",
    ),
    "unknown-policy": (_set(SYNC, "speculation.policy=cost-optimal"), "cost_optimal"),
    "unknown-mode": (_set(SYNC, "pipeline.mode=asynch"), "did you mean async?"),
    "unknown-async-generation": (
        _set(ASYNC, "pipeline.async_generation=drian"),
        "did you mean drain?",
    ),
    "coverage-not-probability": (_set(SYNC, "speculation.draft_coverage=[1.5]"), "probability"),
    "capped-mean-above-cap": (
        _set(SYNC, "workload.mean_is_after_cap=true", "workload.mean_response_len=1e9"),
        "must be below max_response_len",
    ),
    "warmup-negative": (_set(ASYNC, "pipeline.warmup_periods=-1"), "pipeline.warmup_periods"),
    "seeds-zero": (_set(SYNC, "workload.seeds=0"), "workload.seeds"),
    "fp8-without-fp8-peak": (
        _set(RLZERO, "hardware=cpu-2core", "model=smollm2-135m", "generation.precision=fp8"),
        "no FP8 peak",
    ),
    "unknown-precision": (_set(RLZERO, "generation.precision=fp16"), "valid: bf16, fp8"),
    "expert-parallel-dense": (_set(RLZERO, "generation.ep=2"), "qwen3-8b is dense"),
    "expert-parallel-not-dividing": (_set(MOE, "generation.ep=3"), "must divide"),
    "unknown-measured-over": (
        _set(RLZERO, "speculation.acceptance.measured_over=end"),
        "valid: rollout, start",
    ),
    "rollout-acceptance-unreachable": (
        _set(RLZERO, "speculation.acceptance.acceptance_length=3.99"),
        "outside the reachable",
    ),
    # issue 42: bounded where parsed (the cost grows with GPUs), nothing ignored in sync mode
    "gpus-past-uint64": (
        _set(SYNC, "generation.gpus=18446744073709551616"),
        "less than or equal to 65536",
    ),
    "training-gpus-huge": (_set(ASYNC, f"training.gpus={10**30}"), "training.gpus"),
    "negative-seed": (_set(SYNC, "workload.seed=-1"), "workload.seed"),
    "staleness-in-sync": (
        _set(SYNC, "pipeline.staleness=3"),
        "pipeline.staleness=3 needs pipeline.mode='async'",
    ),
    "warmup-in-sync": (_set(SYNC, "pipeline.warmup_periods=0"), "pipeline.warmup_periods"),
}


@pytest.mark.parametrize("args,expect", list(RUN_CASES.values()), ids=list(RUN_CASES))
def test_bad_run_input_is_one_error_line(args, expect):
    _assert_one_error_line(_invoke(args), expect)


def test_a_bad_extends_is_one_error_line(tmp_path):
    bad = _write(tmp_path / "bad.toml", 'extends = 3\nname = "x"\n')
    _assert_one_error_line(_invoke([str(bad)]), "extends must name a scenario")
    missing = _write(tmp_path / "missing.toml", 'extends = "paper-8b-rlzero-syn"\n')
    _assert_one_error_line(_invoke([str(missing)]), "did you mean paper-8b-rlzero-sync?")


def test_extends_merges_tables_and_the_child_wins():
    child = load_scenario("paper-8b-rlzero-k5-sync")
    base = load_scenario("paper-8b-rlzero-sync")
    assert child.speculation.k == 5 and child.speculation.acceptance.acceptance_length == 4.35
    assert child.speculation.acceptance.position_ratio == base.speculation.acceptance.position_ratio
    assert child.workload == base.workload and child.engine == base.engine


def _scenario_text() -> str:
    return (data_root() / "scenarios" / f"{SYNC}.toml").read_text()


def _write(path: Path, text: str | bytes) -> Path:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def _file_case(name: str, tmp: Path) -> tuple[list[str], str]:
    """(args, expected text) for a scenario or spec file that is wrong in one way."""
    base = _scenario_text()
    if name == "malformed-toml":
        return [str(_write(tmp / "s.toml", base + "\n[workload\n"))], "invalid TOML"
    if name == "directory":
        (tmp / "d.toml").mkdir()
        return [str(tmp / "d.toml")], "is a directory"
    if name == "not-utf8":
        return [str(_write(tmp / "s.toml", b'name = "\xff\xfe"\n'))], "not UTF-8"
    if name == "missing":
        return [str(tmp / "missing.toml")], "not found"
    if name == "unknown-key-in-file":
        text = base.replace("[speculation]\n", "[speculation]\nkk = 3\n")
        return [str(_write(tmp / "s.toml", text))], "did you mean speculation.k?"
    if name == "wrong-type-in-file":
        text = base.replace("[speculation]\n", '[speculation]\ntree_width = "two"\n')
        return [
            str(_write(tmp / "s.toml", text))
        ], "bad value for speculation.tree_width: expected an integer"
    if name == "missing-name":
        text = "\n".join(line for line in base.splitlines() if not line.startswith("name ="))
        return [str(_write(tmp / "s.toml", text))], "missing scenario key 'name'"
    if name == "drafter-kind":
        spec = _write(tmp / "d.toml", 'name = "d"\nkind = "eagle4"\n')
        return _set(SYNC, f"speculation.drafter={spec}"), "did you mean eagle3?"
    if name == "hardware-field":
        text = (data_root() / "hardware" / "h100.toml").read_text() + "\nhbm_byte = 1\n"
        return _set(SYNC, f"hardware={_write(tmp / 'h.toml', text)}"), "did you mean hbm_bytes?"
    if name == "model-field-type":
        text = (data_root() / "models" / "qwen3-8b.toml").read_text()
        text = text.replace("layers = 36", 'layers = "many"')
        return _set(
            SYNC, f"model={_write(tmp / 'm.toml', text)}"
        ), "bad value for layers: expected an integer"
    if name == "out-under-a-file":
        blocker = _write(tmp / "file.txt", "x")
        return [SYNC, "--out", str(blocker / "out")], "--out"
    raise KeyError(name)


FILE_CASES = [
    "malformed-toml",
    "directory",
    "not-utf8",
    "missing",
    "unknown-key-in-file",
    "wrong-type-in-file",
    "missing-name",
    "drafter-kind",
    "hardware-field",
    "model-field-type",
    "out-under-a-file",
]


@pytest.mark.parametrize("name", FILE_CASES)
def test_bad_scenario_or_spec_file_is_one_error_line(name, tmp_path):
    args, expect = _file_case(name, tmp_path)
    _assert_one_error_line(_invoke(args), expect)


def test_model_that_does_not_fit_names_need_have_and_fix():
    line = _assert_one_error_line(
        _invoke(_set(ASYNC, "generation.gpus_per_replica=2")), "does not fit"
    )
    # the model, what it needs (weights + one sequence's KV), what the GPUs have, what to change
    for part in ("qwen3-235b-a22b", "GB of bf16 weights", "KV cache for one 16684-token",
                 "144.0 GB is usable", "gpus_per_replica >= 7, e.g. 8", "FP8"):  # fmt: skip
        assert part in line, part


def test_library_raises_the_same_one_line_error_before_simulating():
    sc = load_scenario(ASYNC, ["generation.gpus_per_replica=2"])  # loads: the schema is fine
    with pytest.raises(SimInputError) as err:
        run_scenario(sc)
    assert "\n" not in str(err.value) and "does not fit" in str(err.value)


def _trace(tmp: Path, **changes) -> Path:
    records = [
        {"kind": "decode", "batch_size": b, "tokens_per_seq": 1, "context_len": 64.0,
         "step_time_s": 0.01 * b, "config": f"b{b}"}
        for b in (1, 2, 4, 8)
    ]  # fmt: skip
    data = {"machine": "test", "model": "smollm2-135m", "records": records, **changes}
    return _write(tmp / "trace.json", json.dumps(data))


def _calibrate_case(name: str, tmp: Path) -> tuple[list[str], str]:
    out = ["--out", str(tmp / "fit.toml")]
    if name == "missing-trace":
        return ["calibrate", str(tmp / "none.json"), *out], "no such file"
    if name == "trace-directory":
        return ["calibrate", str(tmp), *out], "is a directory"
    if name == "malformed-json":
        return ["calibrate", str(_write(tmp / "t.json", "{")), *out], "malformed JSON"
    if name == "not-utf8":
        return ["calibrate", str(_write(tmp / "t.json", b"\xff\xfe")), *out], "not UTF-8"
    if name == "json-list":
        return ["calibrate", str(_write(tmp / "t.json", "[]")), *out], "'records' list"
    if name == "record-missing-field":
        bad = [{"kind": "decode", "batch_size": 1}]
        return ["calibrate", str(_trace(tmp, records=bad)), *out], "tokens_per_seq"
    if name == "record-bad-kind":
        bad = [{"kind": "decod"}]
        return ["calibrate", str(_trace(tmp, records=bad)), *out], "kind 'decod'"
    if name == "unknown-model":
        return ["calibrate", str(_trace(tmp, model="smollm")), *out], "unknown model spec"
    if name == "out-under-a-file":
        blocker = _write(tmp / "file.txt", "x")
        return ["calibrate", str(_trace(tmp)), "--out", str(blocker / "fit.toml")], "--out"
    if name == "drafter-out-under-a-file":
        blocker = _write(tmp / "file.txt", "x")
        args = ["calibrate", str(_trace(tmp)), *out, "--drafter-out", str(blocker / "d.toml")]
        return args, "--drafter-out"
    if name == "out-is-a-directory":
        return ["calibrate", str(_trace(tmp)), "--out", str(tmp)], "is a directory"
    if name == "heldout-out-of-range":
        return ["calibrate", str(_trace(tmp)), *out, "--heldout", "1.5"], "--heldout"
    if name == "unknown-base":
        return ["calibrate", str(_trace(tmp)), *out, "--base", "h1000"], "did you mean h100?"
    raise KeyError(name)


CALIBRATE_CASES = [
    "missing-trace",
    "trace-directory",
    "malformed-json",
    "not-utf8",
    "json-list",
    "record-missing-field",
    "record-bad-kind",
    "unknown-model",
    "out-under-a-file",
    "drafter-out-under-a-file",
    "out-is-a-directory",
    "heldout-out-of-range",
    "unknown-base",
]


@pytest.mark.parametrize("name", CALIBRATE_CASES)
def test_bad_calibrate_input_is_one_error_line(name, tmp_path):
    args, expect = _calibrate_case(name, tmp_path)
    _assert_one_error_line(_invoke(args), expect)
    assert not (tmp_path / "fit.toml").exists()


def test_calibrate_fit_errors_are_one_line(tmp_path, monkeypatch):
    from specrl.sim.calibrate import fit_trace

    monkeypatch.setattr("specrl.sim.cli.fit_trace", fit_trace)  # the real fit, tiny trace
    few = _trace(tmp_path, records=[{"kind": "decode", "batch_size": 1, "tokens_per_seq": 1,
                                     "context_len": 8, "step_time_s": 0.01}])  # fmt: skip
    out = str(tmp_path / "fit.toml")
    _assert_one_error_line(_invoke(["calibrate", str(few), "--out", out]), "at least 3")
    res = _invoke(["calibrate", str(_trace(tmp_path)), "--out", out, "--heldout-configs", "b3"])
    _assert_one_error_line(res, "unknown held-out config 'b3'")


def test_set_and_json_are_documented_in_simulate_help():
    group = _invoke(["--help"]).output
    assert "--set KEY=VALUE" in group and "--json" in group and "--out DIR" in group
    assert "pipeline.staleness" in group and "error: ..." in group
    run = _invoke(["run", "--help"]).output
    assert "--set KEY=VALUE" in run and "--json" in run
