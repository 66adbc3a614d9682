"""Usage errors anywhere in the ``specrl`` CLI are one ``error:`` line with exit code 2."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from specrl.cli import app


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["generat"], ["No such command 'generat'", "Did you mean 'generate'", "--help)"]),
        (["generate", "--temperature", "abc", "x"], ["'--temperature'", "generate --help"]),
        (["bench", "generate", "--foo"], ["No such option: --foo", "bench generate --help"]),
        (["simulate", "run"], ["Missing argument", "simulate run --help"]),
        (["train", "--set"], ["'--set' requires an argument"]),
        (["report"], ["Missing argument"]),
    ],
)
def test_usage_errors_are_one_line(args, words):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "Usage:" not in result.output
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_help_is_still_help():
    result = CliRunner().invoke(app, ["bench"])  # a group without arguments shows its help
    assert "Usage:" in result.output and "generate" in result.output
    assert CliRunner().invoke(app, ["generate", "--help"]).exit_code == 0
