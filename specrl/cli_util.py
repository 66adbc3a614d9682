"""What every ``specrl`` command shares: the one-line error exit.

Contract: ``fail(message, code=2)`` prints ``error: <message>`` to stderr and exits with
``code`` (never a traceback). Only CLI modules (``specrl/cli.py``, ``specrl/*/cli.py``) import
this; it imports nothing from specrl, so each CLI module can use it without importing another.
"""

from __future__ import annotations

from typing import NoReturn

import typer


def fail(message: str, code: int = 2) -> NoReturn:
    """Print a one-line error and exit."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)
