"""The cost model's and the simulator's one error type for bad inputs.

Every input the cost model or the simulator cannot use raises ``SimInputError`` (a
``ValueError``) with ONE line naming the input, what is wrong and what is valid; ``specrl
simulate`` prints it and exits 2. Bugs are never turned into it. ``unknown`` and ``key_hint``
add specrl's did-you-mean hint; ``read_text(path, kind)`` is a file's text, or the error that
says why it cannot be read.
Details: docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from pydantic import BaseModel

from specrl import errors, settings


class SimInputError(ValueError):
    """A bad simulator input; ``str(error)`` is one line meant for the user."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


def unknown(what: str, name: str, choices: Iterable[str]) -> SimInputError:
    """``unknown WHAT 'NAME' (did you mean ...?); valid: a, b, c`` as a ``SimInputError``."""
    return SimInputError(errors.unknown(what, name, choices))


def key_hint(model: type[BaseModel]) -> Callable[[str], str]:
    """For an unknown dotted key of ``model``: `` (did you mean X?); valid keys in [TABLE]: ...``
    (``settings.key_hint`` with specrl's did-you-mean)."""
    return settings.key_hint(model, errors.did_you_mean)


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
