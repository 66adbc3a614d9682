"""The simulator's one error type for bad inputs.

Contract: every input the simulator cannot use (an unknown scenario, spec or key, a value of the
wrong type or out of range, inconsistent GPU counts, a model that does not fit its GPUs, an
unreadable file) raises ``SimInputError`` with a message of ONE line (whitespace, newlines
included, collapsed) that names the input, what is wrong and what is valid. It is a
``ValueError``; ``specrl simulate`` prints it as ``error: ...`` and exits with code 2. Errors that
are not the user's input (bugs) are never turned into this type. ``unknown(what, name, choices)``
is the ``SimInputError`` of ``specrl.errors.unknown`` (the did-you-mean hint every specrl
message uses).
"""

from __future__ import annotations

from collections.abc import Iterable

from specrl import errors


class SimInputError(ValueError):
    """A bad simulator input; ``str(error)`` is one line meant for the user."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


def unknown(what: str, name: str, choices: Iterable[str]) -> SimInputError:
    """``unknown WHAT 'NAME' (did you mean ...?); valid: a, b, c`` as a ``SimInputError``."""
    return SimInputError(errors.unknown(what, name, choices))
