"""How errors read: one line, with a suggestion for a misspelt name.

Contract (a leaf: imports nothing from specrl; the simulator may use it too):
- ``one_line(exc)`` is ``"<Type>: <first line of the message>"`` with whitespace collapsed
  (``"<Type>"`` for an empty message): what a user sees of an exception from a library that
  formats its own messages (jinja, safetensors, json).
- ``did_you_mean(name, choices)`` is ``" (did you mean X?)"`` for the closest choice, or ``""``.
- ``unknown(what, name, choices)`` is ``"unknown WHAT 'NAME' (did you mean X?); valid: a, b"``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def one_line(exc: BaseException) -> str:
    """The exception's type and the first line of its message, whitespace collapsed."""
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    first = " ".join(lines[0].split()) if lines else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean X?)`` for the closest choice, or ``""`` when none is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def unknown(what: str, name: str, choices: Iterable[str]) -> str:
    """One line naming an unknown ``name`` of kind ``what``, a suggestion and the valid ones."""
    valid = sorted(choices)
    return f"unknown {what} {name!r}{did_you_mean(name, valid)}; valid: {', '.join(valid)}"
