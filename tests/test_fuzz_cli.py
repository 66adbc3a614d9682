"""Fuzz the whole ``specrl`` command line: every command, every option, hostile values.

Contract checked (issue 20): any command line ends in success, in the start of real work (the
inputs were all accepted: here the first expensive call raises ``ReachedWork``), or in exactly one
``error: ...`` line with exit code 2 - never a traceback, never a usage block. The options are
read from the CLI itself, so an option added later is fuzzed too. Values mix numbers at and past
every bound (huge, negative, inf, nan), words the options know, junk text (NUL bytes, lone
surrogates) and paths that are files, directories, missing, or under a regular file.
Every number past its bound, and every pair of options that cannot apply together, is checked
case by case (and must be refused, not just not crash) in ``tests/test_fuzz_bounds.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from specrl.cli import app

ROOT = typer.main.get_command(app)


class ReachedWork(BaseException):  # noqa: N818 - not an error: the inputs were all accepted
    """Raised by the first expensive call: every input was accepted."""


def _reached(*args, **kwargs):
    raise ReachedWork


WORK = [  # the first expensive call of each command (all looked up at call time)
    "specrl.models.checkpoints.load_model",
    "specrl.bench.run_generate_bench",
    "specrl.gpubench.check.run_check",
    "specrl.gpubench.calibrate.run_calibrate",
    "specrl.sim.cli.run_scenario",
    "specrl.sim.cli.fit_trace",
    "specrl.sim.cli.run_validation",
]


def leaf_commands(
    group=ROOT, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], object]]:
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            yield from leaf_commands(cmd, (*path, name))
        else:
            yield (*path, name), cmd


COMMANDS = dict(leaf_commands())
WORDS = ["", " ", "0", "1", "-1", "3", "auto", "none", "ngram", "suffix", "draft", "eagle3", "mtp",
         "self", "hf", "vllm", "hf,vllm", "1,8", "1,,x", "fp32", "bf16", "float16", "true", "a=b",
         "run.steps=true", "rollout.spec=eagle3", "rollout.temperature=inf", "x.y=1", "[",
         "smollm2-135m-instruct", "paper-8b-sync", "paper-235b-async", "basic_arithmetic",
         "prefix:2", "prefix:-1", "\x00", "\ud800", "é" * 3]  # fmt: skip


def values(paths: list[str]) -> st.SearchStrategy[str]:
    return st.one_of(
        st.integers(-(2**70), 2**70).map(str),
        st.sampled_from(
            [
                "2147483648",
                "9223372036854775807",
                "9223372036854775808",
                "1e400",
                str(10**30),
                str(-(10**30)),
                "nan",
                "inf",
                "-inf",
            ]
        ),  # fmt: skip
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
        st.sampled_from(WORDS),
        st.text(max_size=8),
        st.sampled_from(paths),
    )


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> list[str]:
    base = tmp_path_factory.mktemp("fuzz_paths")
    (base / "file.toml").write_bytes(b"\xff\xfe garbage [[[\n")
    (base / "empty.json").write_text("")
    (base / "list.json").write_text("[1, 2]")
    (base / "dir").mkdir()
    return [str(base / n) for n in ("file.toml", "empty.json", "list.json", "dir", "missing",
                                    "file.toml/under")]  # fmt: skip


def argv(draw, command: tuple[str, ...], paths: list[str]) -> list[str]:
    """A command line for ``command``: its positional arguments and a random subset of its
    options, each with a hostile value (flags on or off)."""
    cmd, out = COMMANDS[command], list(command)
    value = values(paths)
    for p in cmd.params:
        if p.param_type_name == "argument" and (p.required or draw(st.booleans())):
            out.append(draw(st.sampled_from(["hi", "paper-8b-sync"]) | value))
    options = [p for p in cmd.params if p.param_type_name == "option" and p.name != "help"]
    chosen = st.lists(st.sampled_from(options), max_size=4, unique_by=lambda p: p.name)
    for p in draw(chosen) if options else []:  # ``simulate list`` takes no option
        if p.is_flag:
            out.append(draw(st.sampled_from([*p.opts, *p.secondary_opts])))
        else:
            out += [p.opts[0], draw(value)]
    return out


def assert_contract(result, args: list[str]) -> None:
    """Success, or one ``error:`` line with exit code 2 (never a traceback)."""
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        args, repr(result.exception))  # fmt: skip
    assert "Traceback" not in result.output and "Usage:" not in result.output, (args, result.output)
    if result.exit_code == 0:
        return
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert result.exit_code == 2 and len(errors) == 1, (args, result.exit_code, lines)


def run(args: list[str], cwd: Path) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)  # relative paths (default run dirs, "0" as --out) land in a temp dir
        mp.setenv("SPECRL_CACHE", str(cwd / "cache"))
        for target in WORK:
            mp.setattr(target, _reached)
        try:
            result = CliRunner().invoke(app, args)
        except ReachedWork:
            return
    assert_contract(result, args)


@pytest.mark.parametrize("command", sorted(COMMANDS), ids=" ".join)
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzz_command_line(command, paths, tmp_path_factory, data):
    args = argv(data.draw, command, paths)
    run(args, tmp_path_factory.mktemp("cwd"))
