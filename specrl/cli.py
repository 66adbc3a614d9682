"""The ``specrl`` command line: generate | bench | train | report | export | train-drafter |
export-drafter | simulate.

Contract: every command validates its inputs before doing work and reports a bad value as one
line (``error: ...``) with exit code 2, never a traceback. Commands are thin: they parse options
and call library functions. Each group registers itself on ``app``: ``generate``
(``specrl.cli_generate``), ``bench`` (``specrl.cli_bench``), ``train``/``report``
(``specrl.pipelines.cli``), ``export`` and ``export-drafter`` (``specrl.cli_export``),
``train-drafter`` (``specrl.drafters.cli``) and ``simulate`` (``specrl.sim.cli``). Every command
reads its settings alike: defaults <- ``--config FILE`` <- its options <- ``--set key=value``
(``specrl.cli_util.Shortcuts``). Ctrl-C ends any command but
``train`` (whose pipeline handles signals itself) with the line ``error: interrupted by Ctrl-C``
and exit code 130.
"""

from __future__ import annotations

import sys

import typer

from specrl.cli_bench import register as register_bench
from specrl.cli_export import register as register_export
from specrl.cli_generate import register as register_generate
from specrl.cli_util import OneLineErrors
from specrl.drafters.cli import register as register_drafters
from specrl.pipelines.cli import register as register_pipelines
from specrl.sim.cli import register as register_simulate

app = typer.Typer(
    cls=OneLineErrors,
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    help="specrl: RL post-training with lossless speculative rollouts.",
)
register_bench(app)
register_pipelines(app)
register_export(app)
register_drafters(app)
register_simulate(app)
register_generate(app)


INTERRUPTED = 130  # the shell's exit code for a command stopped by SIGINT


def main() -> None:
    """The ``specrl`` entry point: ``app()``, plus one line when Ctrl-C stops a command."""
    try:
        app()
    except SystemExit as e:
        if e.code == INTERRUPTED and by_ctrl_c(e) and command_name(sys.argv[1:]) != "train":
            typer.echo("error: interrupted by Ctrl-C", err=True)
        raise
    except KeyboardInterrupt:  # outside typer's own handling (it turns one into exit 130)
        typer.echo("error: interrupted by Ctrl-C", err=True)
        raise SystemExit(INTERRUPTED) from None


def by_ctrl_c(exc: BaseException) -> bool:
    """Whether a KeyboardInterrupt is among the causes of ``exc`` (typer raises Exit(130) from
    it, and the SystemExit comes while handling that)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, KeyboardInterrupt):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def command_name(args: list[str]) -> str | None:
    """The subcommand in a command line (its first word that is not an option)."""
    return next((a for a in args if not a.startswith("-")), None)


if __name__ == "__main__":
    main()
