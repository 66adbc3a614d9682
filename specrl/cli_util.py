"""What every ``specrl`` command shares: the one-line error exit.

``fail(message, code=2)`` prints ``error: <message>`` to stderr and exits (never a traceback);
``refuse_unless_applies`` fails on an option given where it cannot apply; ``OneLineErrors`` (the
root group's class) prints every usage error as one ``error: ... (see specrl CMD --help)`` line,
exit 2, and an OSError of a full disk, a quota, a permission or a read-only file system that a
command did not handle as one ``error: no space left on device: PATH`` line
(``fsutil.disk_problem``), exit 2; ``parse_device`` resolves ``--device`` or fails in one
line. Only CLI modules import this; at import time it imports nothing from specrl. Details:
docs/internals.md.
"""

from __future__ import annotations

from typing import Any, NoReturn

import typer
from typer.core import TyperGroup

# typer 0.29 parses with its own vendored copy of click (the private ``typer._click``), whose
# exceptions are not click's; a typer that uses click itself raises click's. pyproject.toml keeps
# typer within 0.29.x, and tests/test_cli_one_line.py fails if this stops converting.
try:
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
except ImportError:  # no vendored click: typer parses with click
    from click.exceptions import NoArgsIsHelpError, UsageError


def fail(message: str, code: int = 2) -> NoReturn:
    """Print a one-line error and exit."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def given(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` (its parameter name) was given on the command line, whatever
    its value (not left at its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


def refuse_unless_applies(ctx: typer.Context, names: list[str], applies: bool, needs: str) -> None:
    """The one rule for options that apply only with others: an option of ``names`` given
    where it cannot apply (``applies`` False) is one line naming it and ``needs``."""
    if applies:
        return
    for name in names:
        if given(ctx, name):
            fail(f"{_option(ctx, name)} applies only with {needs}")


def _option(ctx: typer.Context, name: str) -> str:
    param = next((p for p in ctx.command.params if p.name == name), None)
    return param.opts[0] if param is not None and param.opts else name


class OneLineUsageError(UsageError):
    """A usage error that shows itself as one ``error:`` line."""

    def show(self, file: Any = None) -> None:
        message = " ".join(self.format_message().split())
        hint = f" (see {self.ctx.command_path} --help)" if self.ctx is not None else ""
        typer.echo(f"error: {message}{hint}", err=True)


def _one_line(e: UsageError) -> UsageError:
    if isinstance(e, NoArgsIsHelpError | OneLineUsageError):
        return e
    return OneLineUsageError(e.format_message(), e.ctx)


class OneLineErrors(TyperGroup):
    """A command group whose usage errors (its own and its subcommands') are one line."""

    def make_context(self, *args: Any, **kwargs: Any) -> typer.Context:
        try:
            return super().make_context(*args, **kwargs)
        except UsageError as e:
            raise _one_line(e) from None

    def invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except UsageError as e:
            raise _one_line(e) from None
        except OSError as e:
            from specrl.fsutil import disk_problem

            if (line := disk_problem(e)) is None:
                raise
            fail(line)


def parse_device(name: str):
    """``--device`` resolved (one ``error:`` line when it cannot be had here)."""
    from specrl.models.device import DeviceError, resolve_device

    try:
        return resolve_device(name)
    except DeviceError as e:
        fail(str(e))
