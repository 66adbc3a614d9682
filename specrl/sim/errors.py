"""The simulator's one error type for bad inputs.

Contract: every input the simulator cannot use (an unknown scenario, spec or key, a value of the
wrong type or out of range, inconsistent GPU counts, a model that does not fit its GPUs, an
unreadable file) raises ``SimInputError`` with a message of ONE line (whitespace, newlines
included, collapsed) that names the input, what is wrong and what is valid. It is a
``ValueError``; ``specrl simulate`` prints it as ``error: ...`` and exits with code 2. Errors that
are not the user's input (bugs) are never turned into this type. ``unknown(what, name, choices)``
is the ``SimInputError`` of ``specrl.errors.unknown`` (the did-you-mean hint every specrl
message uses). ``read_text(path, kind)`` is a file's text, or the ``SimInputError`` that says why
it cannot be read (a directory, missing, unreadable, not UTF-8); ``kind`` names what was expected.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from specrl import errors


class SimInputError(ValueError):
    """A bad simulator input; ``str(error)`` is one line meant for the user."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


def unknown(what: str, name: str, choices: Iterable[str]) -> SimInputError:
    """``unknown WHAT 'NAME' (did you mean ...?); valid: a, b, c`` as a ``SimInputError``."""
    return SimInputError(errors.unknown(what, name, choices))


def read_text(path: Path, kind: str) -> str:
    """The UTF-8 text of ``path``, or a ``SimInputError`` naming it and why (``kind``: what the
    file should be, e.g. "a .toml file")."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except IsADirectoryError:
        raise SimInputError(f"{path}: is a directory, not {kind}") from None
    except FileNotFoundError:
        raise SimInputError(f"{path}: no such file") from None
    except OSError as e:
        raise SimInputError(f"{path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise SimInputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
