"""`specrl bench gpu`'s command line: its settings (``--config``, the options, ``--set``) reach
the run, every bad value is one ``error:`` line with exit code 2 before any work, and the quick
paths run end to end through the CLI (the check's floors alone, the calibration grid in smoke).
The whole smoke check through the CLI: tests/test_gpu_check.py."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from specrl.cli import app
from specrl.cli_bench_gpu import GPU
from specrl.config_gpubench import (
    COVERAGE,
    MAX_SPEC_TOKENS,
    SECTIONS,
    GpuBenchCfg,
    StepGraphs,
    load_gpubench,
)
from specrl.settings import coverage_problems, value_at

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "benchmarks" / "results" / "gpu_check.json"


def run_cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """``specrl bench gpu ARGS`` in a subprocess (the main CLI)."""
    cmd = [sys.executable, "-m", "specrl.cli", "bench", "gpu", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def gpu_app() -> typer.Typer:
    """The main CLI (``bench gpu`` is registered by ``specrl.cli_bench``)."""
    return app


def invoke(*args: str):
    return CliRunner().invoke(gpu_app(), ["bench", "gpu", *args])


def one_error_line(result) -> str:
    """The one ``error:`` line of a refused command line (exit code 2, no traceback)."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "Traceback" not in result.output
    return lines[0]


@pytest.fixture
def never_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused command line must never reach the work."""

    def reached(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr("specrl.gpubench.check.run_check", reached)
    monkeypatch.setattr("specrl.gpubench.calibrate.run_calibrate", reached)


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """The (cfg, target) each run gets; the runs do nothing (the check's summary: a marker)."""
    calls: list[tuple] = []

    def check(cfg, target, command):
        calls.append((cfg, target))
        return {"summary": {"gpu": "captured"}}

    def calibrate(cfg, target, command=None):
        calls.append((cfg, target))

    monkeypatch.setattr("specrl.gpubench.check.run_check", check)
    monkeypatch.setattr("specrl.gpubench.calibrate.run_calibrate", calibrate)
    return calls


BAD = [
    (["--smoke", "--oracle-k", "99"], "bad value for check.oracle_k"),
    (["--smoke", "--oracle-accept", "1.5"], "bad value for check.oracle_accept"),
    (["--smoke", "--budget-s", "nan"], "run.budget_s: expected a finite number (got nan)"),
    (["--smoke", "--set", "run.budget_s=-1"], "bad value for run.budget_s"),
    (["--smoke", "--sections", "floors,bogus"], "bad value for check.sections[1]"),
    (["--smoke", "--sections", "floors,floors"], "a section is listed twice: floors"),
    (["--smoke", "--mode", "calibrate", "--ks", "3,x"], "calibrate.ks[1]: expected an integer"),
    (["--smoke", "--mode", "bogus"], "bad value for run.mode"),
    (["--smoke", "--device", "tpu"], "bad value for run.device"),
    (["--smoke", "--oracle-k", "abc"], "--oracle-k"),  # typer's own, in one line
    (["--smoke", "--mode", "calibrate", "--sections", "floors"],
     "--sections applies only with --mode='check'"),
    (["--smoke", "--sections", "grpo", "--step-graphs", "off"],
     "--step-graphs applies only with --sections to hold 'engine'"),
    (["--smoke", "--mode", "calibrate", "--max-kv-tokens", "1000"],
     "--max-kv-tokens applies only with --smoke=false"),
    (["--set", 'run.mode="calibrate"', "--set", "check.oracle_k=3"],
     "check.oracle_k=3 needs run.mode='check'"),
    (["--smoke", "--set", "run.smoke=false"], "--smoke and --set run.smoke both set run.smoke"),
    (["--config", "/nonexistent/gpu.toml"], "cannot read bench gpu config /nonexistent/gpu.toml"),
    (["--smoke", "--out", str(COMMITTED)], "--smoke does not write the committed GPU result"),
    (["--smoke", "--mode", "calibrate", "--out",
      str(REPO / "benchmarks" / "results" / "gpu_calibrate_trace.json")],
     "--smoke does not write the committed GPU result"),
    (["--smoke", "--out", str(Path(__file__) / "under.json")], "under.json"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "words"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_values_are_one_line_before_any_work(args, words, never_runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_error_line(invoke(*args))
    assert words in line, line
    assert list(tmp_path.iterdir()) == []  # nothing created


@pytest.mark.skipif(torch.cuda.is_available(), reason="the full check runs on this machine")
@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_without_cuda_the_full_check_is_one_line_naming_smoke(device, never_runs, tmp_path):
    out = tmp_path / "gpu_check.json"
    line = one_error_line(invoke("--device", device, "--out", str(out)))
    assert "needs a CUDA GPU" in line and "--smoke" in line
    assert not out.exists()


@pytest.mark.parametrize(
    ("item", "unknown", "close"),
    [
        ("check.oracel_k=3", "check.oracel_k", "check.oracle_k"),
        ("chek.sections=[]", "chek", "check"),
    ],
)
def test_an_unknown_key_is_refused_with_did_you_mean(item, unknown, close, never_runs):
    line = one_error_line(invoke("--smoke", "--set", item))
    assert f"unknown bench gpu key '{unknown}' (did you mean {close}?)" in line
    assert "valid keys" in line


def test_config_then_options_then_set_reach_the_run(captured, tmp_path):
    """--config's values, the options over them, --set over both; the check's summary to
    stdout and ``wrote PATH`` to stderr."""
    config = tmp_path / "gpu.toml"
    config.write_text('[run]\nsmoke = true\ndevice = "cpu"\nbudget_s = 12.5\n\n'
                      '[check]\nsections = ["floors", "grpo"]\noracle_k = 2\n'
                      "oracle_accept = 0.3\n")  # fmt: skip
    out = tmp_path / "sub" / "result.json"
    result = invoke("--config", str(config), "--oracle-accept", "0.5", "--set",
                    "check.oracle_k=4", "--out", str(out))  # fmt: skip
    assert result.exit_code == 0, result.output
    ((cfg, target),) = captured
    assert (cfg.run.smoke, cfg.run.device, cfg.run.budget_s) == (True, "cpu", 12.5)
    assert cfg.check.sections == ["floors", "grpo"]
    assert (cfg.check.oracle_accept, cfg.check.oracle_k) == (0.5, 4)
    assert target.out == out and target.device == torch.device("cpu")
    assert json.loads(result.stdout) == {"gpu": "captured"}
    assert f"wrote {out}" in result.stderr


# One case per option: its command line and the key it sets to what (``GPU.options``).
OPTION_CASES = {
    "mode": (["--mode", "calibrate"], "calibrate"),
    "smoke": (["--smoke"], True),
    "device": (["--device", "cpu"], "cpu"),
    "out": (["--out", "x/r.json"], "x/r.json"),
    "budget_s": (["--budget-s", "7.5"], 7.5),
    "sections": (["--sections", "engine, floors"], ["engine", "floors"]),
    "step_graphs": (["--step-graphs", "off"], "off"),
    "oracle_accept": (["--oracle-accept", "0.25"], 0.25),
    "oracle_k": (["--oracle-k", "3"], 3),
    "ks": (["--mode", "calibrate", "--ks", "3,5"], [3, 5]),
    "max_kv_tokens": (["--mode", "calibrate", "--no-smoke", "--max-kv-tokens", "1000"], 1000),
    "warmup": (["--mode", "calibrate", "--warmup", "0"], 0),
    "repeats": (["--mode", "calibrate", "--repeats", "3"], 3),
}


def test_every_option_has_a_case():
    assert set(OPTION_CASES) == set(GPU.options)


@pytest.mark.parametrize("name", sorted(OPTION_CASES))
def test_each_option_sets_its_key_and_refuses_a_set_of_it(name, captured, monkeypatch, tmp_path):
    """The option sets its key (``the same as --set KEY``); with ``--set KEY`` too it is
    refused in one line naming both."""
    from specrl.gpubench import common

    target = common.Target(torch.device("cpu"), tmp_path / "r.json")
    monkeypatch.setattr(common, "prepare", lambda cfg: target)
    args, want = OPTION_CASES[name]
    key = GPU.key(name)
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    ((cfg, _),) = captured
    assert value_at(cfg, key) == want
    flag = GPU.options[name][0].partition("/")[0]
    line = one_error_line(invoke(*args, "--set", f"{key}=1"))
    assert line == f"error: {flag} and --set {key} both set {key}: give one"


def test_help_explains_every_option():
    result = invoke("--help")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    for decl, key in GPU.options.values():
        assert decl.partition("/")[0] in text
        assert f"the same as --set {key}=..." in text, key
    assert "--config" in text and "--set" in text


def test_the_settings_model_is_complete_and_agrees_with_the_library():
    """Every field is classified (applies-only rules, always, checked); the literals the leaf
    keeps torch-free equal the engine's."""
    from typing import get_args

    from specrl.engine.engine import STEP_GRAPHS
    from specrl.spec.config import MAX_SPEC_TOKENS as ENGINE_MAX_K

    assert coverage_problems(GpuBenchCfg, COVERAGE) == []
    assert set(get_args(StepGraphs)) == set(STEP_GRAPHS)
    assert MAX_SPEC_TOKENS == ENGINE_MAX_K
    assert GpuBenchCfg().check.sections == list(SECTIONS)


@pytest.mark.parametrize(
    "sets",
    [
        [],
        ['run.mode="calibrate"', "run.smoke=true", "calibrate.ks=[3,7]"],
        ['check.sections=["grpo"]', "check.oracle_k=2", 'run.out="x.json"', "run.budget_s=5.0"],
    ],
)
def test_to_toml_reads_back_equal(sets):
    cfg = load_gpubench(None, sets)
    assert load_gpubench(tomllib.loads(cfg.to_toml())) == cfg


def test_the_check_s_floors_alone_through_the_cli(tmp_path):
    """A real check of one section: the JSON holds it alone (the others null, the summary's
    keys all there, None for what was not measured), records its settings as TOML that reads
    back, and the summary goes to stdout."""
    out = tmp_path / "check.json"
    result = invoke("--smoke", "--device", "cpu", "--sections", "floors", "--out", str(out))
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert json.loads(result.stdout.strip().splitlines()[-1]) == data["summary"]
    assert data["meta"]["sections_done"] == ["floors"]
    assert data["floors"]["copy_bandwidth_bytes_s"] > 0 and "error" not in data["floors"]
    assert [k for k in ("engine", "learner", "grpo", "exactness") if data[k] is not None] == []
    assert data["summary"]["exactness_tests_passed"] is None
    assert set(v for k, v in data["summary"].items() if k != "gpu") == {None}
    cfg = load_gpubench(tomllib.loads(data["meta"]["settings"]))
    assert cfg.check.sections == ["floors"] and cfg.run.smoke is True
    assert cfg.run.out == str(out.resolve()) and cfg.run.budget_s == 300.0


def test_the_calibration_grid_through_the_cli(tmp_path):
    """`bench gpu --mode calibrate --smoke`: the tiny grid's trace with its model spec beside
    it and its settings recorded (TOML that reads back); a budget spent stops the grid, keeping
    what was measured (the whole grid: tests/sim/test_sim_gpu_calibrate.py)."""
    from specrl.gpubench.calibrate import grid_of

    out = tmp_path / "trace.json"
    args = ["--smoke", "--mode", "calibrate", "--device", "cpu", "--warmup", "0", "--repeats",
            "1", "--ks", "3,5", "--budget-s", "0.001", "--out", str(out)]  # fmt: skip
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    trace = json.loads(out.read_text())
    cfg = load_gpubench(tomllib.loads(trace["meta"]["settings"]))
    assert (cfg.run.mode, cfg.calibrate.ks, cfg.calibrate.repeats) == ("calibrate", [3, 5], 1)
    assert cfg.run.budget_s == 0.001
    grid = grid_of(cfg).points()
    assert {4, 6} == {p.tokens for p in grid if p.kind == "verify"}
    assert 1 <= len(trace["records"]) < len(grid)
    assert f"{len(grid) - len(trace['records'])} points skipped" in result.stdout
    assert trace["records"][0] == trace["records"][0] | {"kind": "decode", "batch_size": 1}
    assert trace["model"] == str(out.with_suffix(".model.toml").resolve())
    assert out.with_suffix(".model.toml").read_text().startswith('name = "tiny-llama"')
