"""``specrl train-drafter`` refuses bad values with one ``error:`` line before any work."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from specrl.drafters.cli import register


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer(no_args_is_help=True, rich_markup_mode=None)
    app.callback()(lambda: None)  # a group, as in ``specrl``, even with one command
    register(app)
    return app


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--draft-vocab", "-1"], "--draft-vocab must be >= 0 (0 = full vocabulary), got -1"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--tv-steps", "-5"], "--tv-steps must be >= 0, got -5"),
        (["--temperature", "1,x"], "--temperature must be a comma list of numbers"),
        (["--temperature", "-1"], "in [0, 10], got '-1'"),
        (["--drafter", "medusa"], "unknown --drafter 'medusa'"),
    ],
)
def test_bad_values_fail_before_work(app, tmp_path, args, match):
    result = CliRunner().invoke(app, ["train-drafter", "--out", str(tmp_path / "d"), *args])
    assert result.exit_code == 2, result.output
    assert match in result.output
    assert not (tmp_path / "d").exists()  # nothing was written
