"""``specrl simulate validate``: the simulator against published measurements, as a command.

Runs the fast sections (fits, heldout, nemo_rl: seconds; the paper's table and the tornado take
minutes and are covered row by row by tests/sim/test_sim_paper.py): the JSON record has the
layout of benchmarks/results/sim_validate.json (which stays the full run's record), the printed
tables and the JSON carry the errors ``specrl.sim.accuracy`` returns, and every bad value is one
``error:`` line with exit code 2 before any work.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specrl.cli import app
from specrl.sim import accuracy

RECORD = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "sim_validate.json"
FAST = ["fits", "heldout", "nemo_rl"]


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> tuple[object, dict, Path]:
    """One run of the fast sections with ``--json`` (result, written record, its path)."""
    path = tmp_path_factory.mktemp("validate") / "sub" / "sim_validate.json"
    result = CliRunner().invoke(
        app, ["simulate", "validate", "--sections", ",".join(FAST), "--json", str(path)]
    )
    assert result.exit_code == 0, result.output
    return result, json.loads(path.read_text()), path


def _keys(d: object) -> object:
    """The layout of a JSON value: dict keys (recursively; a list by its first element)."""
    if isinstance(d, dict):
        return {k: _keys(v) for k, v in d.items()}
    if isinstance(d, list) and d and isinstance(d[0], dict):
        return [_keys(d[0])]
    return None


def test_the_record_has_the_fields_of_sim_validate_json(ran):
    result, record, path = ran
    assert record["command"] == (
        f"specrl simulate validate --sections fits,heldout,nemo_rl --json {path}"
    )
    assert set(record) == {"command", "date", "machine", "versions", *FAST}
    recorded = json.loads(RECORD.read_text())
    assert set(recorded) == {"command", "date", "machine", "versions", *accuracy.SECTIONS}
    for key in ("machine", "versions", "fits", "heldout", "nemo_rl"):
        expected = _keys(recorded[key])
        if key == "fits":  # paper_inputs only with --refit
            expected = {k: v for k, v in expected.items() if k != "paper_inputs"}
        assert _keys(record[key]) == expected, key
    assert f"wrote {path}" in result.output


def test_printed_and_written_errors_are_the_library_s(ran):
    result, record, _ = ran
    for name in ("heldout", "nemo_rl"):
        section = accuracy.run_section(name)
        errors = [r["error"] for r in section["rows"]]
        assert [r["error"] for r in record[name]["rows"]] == pytest.approx(errors, rel=1e-12)
        for line in accuracy.section_lines(name, section):
            assert line in result.output.splitlines(), line
        printed = [ln for ln in result.output.splitlines() if ln.startswith(("fit ", "heldout "))]
        if name == "heldout":
            assert [ln.split()[-1] for ln in printed] == [f"{e:+.1%}" for e in errors]
    assert record["heldout"]["n_heldout"] == accuracy.heldout_section()["n_heldout"]
    for r in record["heldout"]["rows"]:
        assert r["error"] == accuracy.relative_error(r["simulated"], r["published"])


def test_the_library_logs_each_table_and_records_the_command():
    lines: list[str] = []
    out = accuracy.run_validation(["fits"], command="specrl simulate validate", log=lines.append)
    assert out["command"] == "specrl simulate validate" and "paper" not in out
    assert lines == accuracy.section_lines("fits", out["fits"])
    with pytest.raises(ValueError, match="unknown section 'x'"):
        accuracy.run_validation(["x"])


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--sections", "papers"], ["--sections: unknown section 'papers'", "fits,paper"]),
        (["--sections", "fits,,heldout"], ["unknown section ''"]),
        (["--sections", "tornado", "--no-tornado"], ["nothing to run"]),
        (["--sections", "heldout", "--refit"], ["--refit applies only with the fits section"]),
        (["--json", "{dir}"], ["--json", "is a directory"]),
        (["--json", "{file}/under.json"], ["--json", "is a file"]),
        (["--bogus"], ["No such option: --bogus"]),
    ],
)
def test_a_bad_value_is_one_line_before_any_work(args, words, tmp_path, monkeypatch):
    monkeypatch.setattr("specrl.sim.cli.run_validation", _no_work)
    (tmp_path / "f").write_text("")
    args = [a.format(dir=tmp_path, file=tmp_path / "f") for a in args]
    result = CliRunner().invoke(app, ["simulate", "validate", *args])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for w in words:
        assert w in lines[0], (w, lines[0])


def _no_work(*args, **kwargs):
    raise AssertionError("the run started")


def test_an_unwritable_record_is_printed_then_one_line(tmp_path, monkeypatch):
    def refuse(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("specrl.fsutil.atomic_write", refuse)  # cli_util.write_or_print's
    path = tmp_path / "out.json"
    result = CliRunner().invoke(
        app, ["simulate", "validate", "--sections", "fits", "--json", str(path)]
    )
    assert result.exit_code == 2 and not path.exists()
    assert '"all_to_all"' in result.stdout
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert lines == [
        f"error: cannot write --json {path}: No space left on device (the results are printed"
        " above)"
    ]


def test_help_names_the_sections_and_options():
    result = CliRunner().invoke(app, ["simulate", "validate", "--help"])
    assert result.exit_code == 0
    for word in ("--sections", "--refit", "--no-tornado", "--json", *accuracy.SECTIONS):
        assert word in result.output, word
    assert "validate" in CliRunner().invoke(app, ["simulate", "--help"]).output


# --------------------------------------------------------------------------- settings


@pytest.fixture
def calls(monkeypatch) -> list[tuple]:
    """``run_validation`` recorded, not run: (sections, refit, command) of each call."""
    seen: list[tuple] = []

    def record(sections, refit, command, log):
        seen.append((sections, refit, command))
        return {"command": command}

    monkeypatch.setattr("specrl.sim.cli.run_validation", record)
    return seen


def validate(*args: object):
    return CliRunner().invoke(app, ["simulate", "validate", *map(str, args)])


def test_the_sections_are_the_library_s():
    from specrl.config_commands import VALIDATE_SECTIONS

    assert VALIDATE_SECTIONS == accuracy.SECTIONS


def test_config_options_and_set_are_applied_in_that_order(calls, tmp_path):
    cfg = tmp_path / "v.toml"
    cfg.write_text('[validation]\nsections = ["fits", "heldout"]\nrefit = true\n')
    record = tmp_path / "rec.json"
    runs = [
        ([], (list(accuracy.SECTIONS), False)),
        (["--set", 'validation.sections=["fits"]'], (["fits"], False)),
        (["--config", cfg], (["fits", "heldout"], True)),  # the file's
        (["--config", cfg, "--sections", "heldout,fits"], (["fits", "heldout"], True)),
        (["--config", cfg, "--set", 'validation.sections=["nemo_rl","fits"]'],
         (["fits", "nemo_rl"], True)),
        (["--set", "validation.tornado=false"], ([s for s in accuracy.SECTIONS
                                                  if s != "tornado"], False)),
        (["--sections", "fits", "--set", f'validation.out="{record}"'], (["fits"], False)),
    ]  # fmt: skip
    for args, expected in runs:
        result = validate(*args)
        assert result.exit_code == 0, (args, result.output)
        assert calls.pop()[:2] == expected, args
    assert json.loads(record.read_text())["command"] == (
        f"specrl simulate validate --sections fits --json {record}"
    )


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--sections", "fits", "--set", 'validation.sections=["heldout"]'],
         "--sections and --set validation.sections both set validation.sections: give one"),
        (["--no-tornado", "--set", "validation.tornado=true"],
         "--no-tornado and --set validation.tornado both set validation.tornado: give one"),
        (["--json", "x.json", "--set", "validation.out='y.json'"],
         "--json and --set validation.out both set validation.out: give one"),
        (["--set", "validation.sectons=['fits']"],
         "unknown simulate validate key 'validation.sectons' (did you mean validation.sections?);"
         " valid keys in [validation]: validation.sections, validation.refit"),
        (["--set", "validaton.refit=true"], "(did you mean validation?)"),
        (["--set", "validation.sections=['papers']"], "bad value for validation.sections[0]"),
        (["--set", "validation.sections=[]"], "bad value for validation.sections"),
        (["--set", "validation.sections=['heldout']", "--set", "validation.refit=true"],
         "validation.refit=True needs the fits section"),
        (["--set", "validation.sections=['tornado']", "--no-tornado"],
         "validation.sections: nothing to run (only tornado, with --no-tornado)"),
        (["--set", "validation.out='{dir}'"], "validation.out: {dir} is a directory"),
        (["--config", "{dir}/missing.toml"], "cannot read simulate validate config"),
    ],
)  # fmt: skip
def test_bad_settings_are_one_line_before_any_work(args, words, tmp_path, calls):
    args = [a.format(dir=tmp_path) for a in args]
    result = validate(*args)
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert words.format(dir=tmp_path) in lines[0], lines[0]
    assert calls == []


def test_help_names_config_and_set():
    out = CliRunner().invoke(app, ["simulate", "validate", "--help"]).output
    assert "--config" in out and "--set" in out and "validation.sections" in out
