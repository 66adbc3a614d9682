"""``specrl simulate calibrate`` reads its settings as every command does (``cli_util.Shortcuts``
over ``config_commands.CalibrateCfg``).

Contract checked: ``--config FILE`` and ``--set calibrate.key=value`` are applied (seen in the fit
report), defaults <- file <- options <- ``--set``; an option and a ``--set`` of the same key are
refused in one line; an unknown key is one line with a did-you-mean; a bad value, and a field set
where it cannot apply, are one line naming what was given, before any work. The fit is the real
one, on a four-record trace (well under a second).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specrl.cli import app

RECORDS = [
    {"kind": "decode", "batch_size": b, "tokens_per_seq": 1, "context_len": 64.0,
     "step_time_s": 0.01 * b + 0.002, "config": f"b{b}"}
    for b in (1, 2, 4, 8, 16)
]  # fmt: skip


@pytest.fixture
def trace(tmp_path) -> Path:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"machine": "test", "model": "smollm2-135m", "records": RECORDS}))
    return path


def calibrate(*args: object):
    return CliRunner().invoke(app, ["simulate", "calibrate", *map(str, args)])


def report(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_config_options_and_set_are_applied(trace, tmp_path):
    out = tmp_path / "fit.toml"
    cfg = tmp_path / "cal.toml"
    cfg.write_text(f'[calibrate]\nout = "{out}"\nname = "mine"\nheldout_configs = ["b8"]\n'
                   "json_report = true\n")  # fmt: skip
    by_file = report(calibrate(trace, "--config", cfg))
    assert by_file["n_heldout"] == 1 and set(by_file["heldout_configs"]) == {"b8"}
    assert 'name = "mine"' in out.read_text()
    by_option = report(calibrate(trace, "--config", cfg, "--heldout-configs", "b4,b8"))
    assert set(by_option["heldout_configs"]) == {"b4", "b8"}  # an option beats the file
    by_set = report(calibrate(trace, "--config", cfg, "--set", "calibrate.name='theirs'",
                              "--set", 'calibrate.heldout_configs=["b1"]'))  # fmt: skip
    assert set(by_set["heldout_configs"]) == {"b1"} and 'name = "theirs"' in out.read_text()
    fits = report(calibrate(trace, "--out", out, "--json", "--set", "calibrate.fit_configs=['b1',"
                            "'b2','b4']"))  # fmt: skip
    assert set(fits["heldout_configs"]) == {"b8", "b16"}
    text = calibrate(trace, "--set", f"calibrate.out='{out}'")
    assert text.exit_code == 0 and text.stdout.startswith(f"wrote {out}:"), text.output


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--seed", "3", "--set", "calibrate.seed=4"],
         "--seed and --set calibrate.seed both set calibrate.seed: give one"),
        (["--json", "--set", "calibrate.json_report=false"],
         "--json and --set calibrate.json_report both set calibrate.json_report: give one"),
        (["--set", "calibrate.seeed=1"],
         "unknown simulate calibrate key 'calibrate.seeed' (did you mean calibrate.seed?); valid "
         "keys in [calibrate]: calibrate.base, calibrate.out"),
        (["--set", "calibrat.seed=1"], "(did you mean calibrate?)"),
        (["--heldout", "1.5"], "--heldout 1.5 must be in [0, 1)"),
        (["--set", "calibrate.heldout=1.5"], "bad value for calibrate.heldout"),
        (["--set", "calibrate.heldout=nan"], "calibrate.heldout: expected a finite number"),
        (["--set", "calibrate.seed=-1"], "bad value for calibrate.seed"),
        (["--set", "calibrate.fit_configs='b1'"], "bad value for calibrate.fit_configs"),
        (["--fit-configs", "b1", "--set", "calibrate.heldout_configs=['b8']"],
         "--fit-configs and calibrate.heldout_configs: give one"),
        (["--seed", "3", "--heldout-configs", "b8"],
         "--seed applies only with a random held-out split"),
        (["--set", "calibrate.heldout=0.5", "--fit-configs", "b1"],
         "calibrate.heldout=0.5 needs a random held-out split"),
        (["--set", "calibrate.out='{dir}'"], "calibrate.out {dir} is a directory"),
        (["--set", "calibrate.drafter_out='{trace}/d.toml'"], "calibrate.drafter_out: "),
    ],
)  # fmt: skip
def test_bad_settings_are_one_line_before_any_work(args, words, trace, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the fit started")

    monkeypatch.setattr("specrl.sim.cli.fit_trace", boom)
    monkeypatch.chdir(tmp_path)
    args = [a.format(dir=tmp_path, trace=trace) for a in args]
    result = calibrate(trace, *args)
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert words.format(dir=tmp_path) in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]  # nothing written


def test_trace_stays_a_positional_argument():
    result = CliRunner().invoke(app, ["simulate", "calibrate", "--seed", "1"])
    assert result.exit_code == 2 and "Missing argument 'trace'" in result.output
