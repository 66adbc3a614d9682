"""``specrl report`` on run directories it did not write: every input is checked before the
first file is written (a bad one is one ``error:`` line and nothing is written, not even an
empty --out directory); a metrics.jsonl with a step logged twice (two writers) or missing (a
gap) is reported with one ``warning:`` line per run, on stderr and in summary.md, the last row
of a step winning. Synthetic logs: no model, no training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from specrl.pipelines.cli import register
from specrl.pipelines.report import (
    describe_steps,
    gaps,
    read_run,
    step_warning,
    write_comparison,
    write_report,
)

PLOTS = {"reward_accuracy.png", "rollout_throughput.png", "acceptance_length.png",
         "step_time.png", "pipeline.png"}  # fmt: skip


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer(no_args_is_help=True, rich_markup_mode=None)
    register(app)
    return app


def row(step: int, reward: float = 0.5, **extra) -> dict:
    return {"step": step, "reward_mean": reward, "accuracy": reward, "response_length": 4.0,
            "gen_tokens": 64, "rollout_tokens_per_s": 100.0, "acceptance_length": 1.5,
            "step_time_s": 2.0, "gen_time_s": 1.0, "train_time_s": 0.5} | extra  # fmt: skip


def make_run(path: Path, steps: list[int], rows: list[dict] | None = None) -> Path:
    path.mkdir(parents=True)
    rows = rows if rows is not None else [row(s, reward=float(i)) for i, s in enumerate(steps)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def files_under(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


def one_error_line(result) -> str:
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


# --------------------------------------------------------------------------- steps twice / missing


def test_a_step_logged_twice_is_one_warning_and_the_last_row_wins(app, tmp_path):
    run = make_run(tmp_path / "run", [0, 1, 1])
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    want = (f"warning: {run / 'metrics.jsonl'}: step 1 logged more than once (a second "
            "writer?): the last row of each is used")  # fmt: skip
    assert result.stderr.splitlines() == [want]
    md = (run / "summary.md").read_text()
    assert f"> {want}" in md
    assert "| steps | 2 |" in md and "| reward_last | 2 |" in md  # the last row of step 1


def test_a_missing_step_is_one_warning(app, tmp_path):
    run = make_run(tmp_path / "run", [0, 2])
    result = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    want = f"warning: {run / 'metrics.jsonl'}: step 1 missing"
    assert result.stderr.splitlines() == [want]
    assert f"> {want}" in (tmp_path / "out" / "summary.md").read_text()


def test_each_run_compared_gets_its_own_warning(app, tmp_path):
    run = make_run(tmp_path / "run", [0, 1, 1, 2])
    other = make_run(tmp_path / "other", [0, 3, 3])
    result = CliRunner().invoke(app, ["report", str(run), "--compare", str(other)])
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert lines == [
        f"warning: {run / 'metrics.jsonl'}: step 1 logged more than once (a second writer?): "
        "the last row of each is used",
        f"warning: {other / 'metrics.jsonl'}: step 3 logged more than once (a second writer?): "
        "the last row of each is used; steps 1-2 missing",
    ]
    md = (run / "summary.md").read_text()
    assert all(f"> {line}" in md for line in lines)
    assert (run / "compare.png").read_bytes()[:4] == b"\x89PNG"


def test_a_clean_run_has_no_warning(app, tmp_path):
    run = make_run(tmp_path / "run", [0, 1, 2])
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    assert "warning" not in (run / "summary.md").read_text()
    assert read_run(run).warning is None


def test_rows_are_reported_in_step_order(tmp_path):
    run = make_run(tmp_path / "run", [], rows=[row(1), row(0), row(2), row(0, reward=9.0)])
    logs = read_run(run)
    assert [r["step"] for r in logs.rows] == [0, 1, 2] and logs.rows[0]["reward_mean"] == 9.0
    assert "step 0 logged more than once" in logs.warning and "missing" not in logs.warning


@pytest.mark.parametrize(
    ("steps", "want"),
    [
        ([0, 1, 2], None),
        ([0, 1, 1], "step 1 logged more than once"),
        ([0, 2], "step 1 missing"),
        ([3, 4], "steps 0-2 missing"),
        ([0, 2, 4], "steps 1, 3 missing"),
        ([0, 5, 7, 9, 11, 13, 15], "steps 1-4, 6, 8, 10, 12, ... (9 steps) missing"),
        ([0, 0, 1, 1], "steps 0-1 logged more than once"),
    ],
)
def test_step_warning_names_the_steps(steps, want):
    line = step_warning(steps, Path("m.jsonl"))
    if want is None:
        assert line is None
    else:
        assert line.startswith("warning: m.jsonl: ") and want in line and "\n" not in line


def test_a_huge_gap_is_counted_not_listed():
    assert gaps([0, 10**12]) == [(1, 10**12 - 1)]
    assert describe_steps(gaps([0, 10**12])) == f"steps 1-{10**12 - 1}"


# --------------------------------------------------------------------------- every input first


def test_a_bad_compare_writes_nothing_and_makes_no_out_dir(app, tmp_path):
    """Was: five PNGs and summary.md in --out, then the error."""
    run = make_run(tmp_path / "run", [0, 1, 2])
    out = tmp_path / "out"
    args = ["report", str(run), "--compare", str(tmp_path / "empty"), "--out", str(out)]
    line = one_error_line(CliRunner().invoke(app, args))
    assert line.startswith("error: no metrics in") and str(tmp_path / "empty") in line
    assert not out.exists()


def test_a_bad_compare_writes_nothing_into_the_run_dir(app, tmp_path):
    run = make_run(tmp_path / "run", [0, 1, 2])
    before = files_under(run)
    bad = make_run(tmp_path / "bad", [], rows=[row(0)])
    with (bad / "metrics.jsonl").open("a") as f:
        f.write("garbage\n" + json.dumps(row(1)) + "\n")
    args = ["report", str(run), "--compare", str(tmp_path / "other"), "--compare", str(bad)]
    make_run(tmp_path / "other", [0, 1])
    line = one_error_line(CliRunner().invoke(app, args))
    assert line == f"error: {bad / 'metrics.jsonl'}: line 2 is not a JSON row with a 'step'"
    assert files_under(run) == before


BAD_INPUTS = {
    "a row without step_time_s": (
        lambda run: make_run(run, [], rows=[row(0), {"step": 1, "reward_mean": 0.0}]),
        "the row of step 1 has no 'step_time_s'",
    ),
    "a string for a number": (
        lambda run: make_run(run, [], rows=[row(0, acceptance_length="fast")]),
        "the row of step 0 has a non-numeric (\"fast\") 'acceptance_length'",
    ),
    "summary.json not JSON": (
        lambda run: (make_run(run, [0]) / "summary.json").write_text("{"),
        "summary.json: not JSON (JSONDecodeError)",
    ),
    "summary.json a list": (
        lambda run: (make_run(run, [0]) / "summary.json").write_text("[]"),
        "summary.json: not a JSON object",
    ),
    "an eval row with a string accuracy": (
        lambda run: (make_run(run, [0]) / "eval.jsonl").write_text(
            json.dumps({"step": 0, "greedy_accuracy": "high"}) + "\n"
        ),
        "eval.jsonl: the row of step 0 has a non-numeric",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
@pytest.mark.parametrize("where", ["main", "compared"])
def test_a_damaged_run_is_one_line_and_nothing_is_written(app, tmp_path, case, where):
    make, match = BAD_INPUTS[case]
    good = make_run(tmp_path / "good", [0, 1])
    bad = tmp_path / "bad"
    make(bad)
    out = tmp_path / "out"
    first, second = (bad, good) if where == "main" else (good, bad)
    args = ["report", str(first), "--compare", str(second), "--out", str(out)]
    line = one_error_line(CliRunner().invoke(app, args))
    assert match in line and str(bad) in line, line
    assert not out.exists()


def test_a_config_toml_that_is_not_toml_only_loses_the_label(tmp_path):
    run = make_run(tmp_path / "run", [0, 1])
    (run / "config.toml").write_text("[pipeline\n")
    assert read_run(run).mode == "?"
    (run / "config.toml").write_text('[pipeline]\nmode = "async"\n')
    assert read_run(run).mode == "async"


def test_the_library_reads_every_run_before_writing(tmp_path):
    run = make_run(tmp_path / "run", [0, 1, 2])
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="no metrics"):
        write_report(run, out, compare=[tmp_path / "missing"])
    assert not out.exists()
    with pytest.raises(ValueError, match="no metrics"):
        write_comparison([run, tmp_path / "missing"], out / "compare.png")
    assert not out.exists()
    paths = write_report(run, out, compare=[run])
    assert {p.name for p in paths} == PLOTS | {"summary.md", "compare.png"}
    assert {p.name for p in out.iterdir()} == PLOTS | {"summary.md", "compare.png"}
