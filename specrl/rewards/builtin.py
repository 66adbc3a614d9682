"""The built-in rewards: ``math``, ``exact`` and ``regex``, in TRL's convention.

Contract: each is ``fn(prompts, completions, **columns) -> list[float | None]``, batch in, batch
out: ``columns`` are the dataset's other columns, each a list aligned with the batch (a single
value, as bound by ``functools.partial``, stands for every row); keywords a reward does not use
are ignored. ``None`` means "does not apply to this sample" (no gold answer to compare with).

- ``math``: the completion's LAST answer (the last ``\\boxed{}``, ``Answer: X`` line, "answer is
  X" or, failing those, the last LaTeX / number in it) against the ``answer`` column (a str or a
  number: ``34``, ``"0.5"``, ``"\\frac{1}{2}"``), by ``math-verify``: 1.0 when equal, 0.0 when not
  or when nothing parses, None when the gold answer itself does not parse. math-verify's own
  timeouts use ``signal.alarm`` (main thread only), so they are turned off here
  (``parsing_timeout=None``, ``timeout_seconds=None``) and the function runs in any thread or
  process; bounding its time (sympy can run unbounded on a hostile ``9**9**9**9``) is the
  caller's job (``specrl.rewards.pool``: worker processes with a timeout).
- ``exact``: the completion's stated answer (the last ``Answer: X`` / ``answer is X``, else its
  last non-empty line after its last ``=``) equals ``str(answer)``, both stripped of
  whitespace, markdown bold, quotes and a trailing period and case-folded: 1.0, else 0.0.
- ``regex``: the ``pattern`` keyword (a column or bound with ``functools.partial``); the last
  match's group 1 (the whole match when the pattern has no group), compared like ``exact`` with
  ``answer``; where there is no answer, 1.0 when the pattern matches at all.

``BUILTIN`` maps each name to its function (read-only). Torch-free; math-verify (sympy) is
imported on the first ``math`` call, not with this module.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

RewardFn = Callable[..., Sequence[float | None]]

# --------------------------------------------------------------------------- row values


def _per_row(value: Any, n: int, what: str) -> list[Any]:
    """A column as one value per row: a list/tuple of length ``n``, or one value for all."""
    if isinstance(value, list | tuple):
        if len(value) != n:
            raise ValueError(f"column {what!r} has {len(value)} values for {n} completions")
        return list(value)
    return [value] * n


# --------------------------------------------------------------------------- text answers

_LINE = re.compile(r"answer\s*(?:is)?\s*[:=]\s*\**\s*(.+)", re.IGNORECASE)
_IS = re.compile(r"answer\s+is\s*:?\s*\**\s*(.+?)\s*(?:[.,;!](?:\s|$)|$)", re.IGNORECASE | re.M)


def _clean(value: str) -> str:
    """Strip markdown bold, quotes, trailing periods and whitespace."""
    value = value.strip().lstrip("*").rstrip("*. ").strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'`":
        value = value[1:-1].rstrip(".").strip()
    return value


def stated_answer(text: str) -> str | None:
    """X of the last ``Answer: X`` / ``answer is X`` in ``text``, else its last non-empty line
    after the line's last ``=`` (``5 - 3 = 2`` -> ``2``); None for an empty text. (What
    ``specrl.envs.reasoning_gym_env.extract_last_line`` reads, kept here so that this package
    imports nothing above it.)"""
    matches = _LINE.findall(text) or _IS.findall(text)
    if matches:
        return _clean(matches[-1]) or None
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return _clean(lines[-1].rsplit("=", 1)[-1]) or None if lines else None


def _same(got: str | None, want: Any) -> bool:
    """``got`` equals ``str(want)`` once both are cleaned and case-folded."""
    return got is not None and _clean(got).casefold() == _clean(str(want)).casefold()


def exact(
    prompts: list[str], completions: list[str], *, answer: Any, **kwargs: Any
) -> list[float | None]:
    """1.0 where the completion's stated answer equals ``answer``, else 0.0 (None: no answer)."""
    golds = _per_row(answer, len(completions), "answer")
    return [
        None if gold is None else float(_same(stated_answer(text), gold))
        for text, gold in zip(completions, golds, strict=True)
    ]


def _last_match(pattern: str | re.Pattern[str], text: str) -> str | None:
    """The last match's group 1 (the whole match without groups); None when none matches."""
    last = None
    for last in re.finditer(pattern, text):  # noqa: B007 - the loop keeps the last match
        pass
    if last is None:
        return None
    return (last.group(1) or "") if last.re.groups else last.group(0)


def regex(
    prompts: list[str],
    completions: list[str],
    *,
    pattern: str | re.Pattern[str] | Sequence[str],
    answer: Any = None,
    **kwargs: Any,
) -> list[float | None]:
    """1.0 where the last match of ``pattern`` equals ``answer`` (no answer: where it matches)."""
    n = len(completions)
    patterns = _per_row(pattern, n, "pattern")
    golds = _per_row(answer, n, "answer")
    out: list[float | None] = []
    for text, pat, gold in zip(completions, patterns, golds, strict=True):
        got = _last_match(pat, text)
        out.append(float(got is not None if gold is None else _same(got, gold)))
    return out


# --------------------------------------------------------------------------- math

# Where an answer starts: the last of these begins the text math-verify reads first.
_MARKER = re.compile(r"\\boxed|\\fbox|answer", re.IGNORECASE)
_MAX_TAILS = 4  # markers tried, last first, before the whole text
_ANSWER_LINE = re.compile(r"answer\b(?:\s*is\b)?\W{0,4}?\s*[:=]?\s*(.+)", re.IGNORECASE)
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}")  # a word, not a LaTeX command


def _no_timeout_notice(record: logging.LogRecord) -> bool:
    """A logging filter: math-verify's warning that its timeout is off (ours is the reward
    worker's) is dropped; everything else passes."""
    return not record.getMessage().startswith("Timeout is disabled")


def _quiet_math_verify() -> None:
    """Add ``_no_timeout_notice`` to math-verify's loggers (once: idempotent)."""
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if _no_timeout_notice not in logger.filters:
            logger.addFilter(_no_timeout_notice)


def _parse(text: str) -> list[Any]:
    """math-verify's parse, without its signal-based timeout (safe in any thread)."""
    from math_verify import parse

    _quiet_math_verify()
    return parse(text, parsing_timeout=None)


def _parse_gold(gold: str) -> list[Any]:
    """The gold answer parsed; bare LaTeX (``\\sqrt{2}``) is read as math, in ``$...$``."""
    if "$" in gold or "\\boxed" in gold:
        return _parse(gold)
    return _parse(f"${gold}$") or _parse(gold)


def _bare_line(tail: str) -> str | None:
    """The X of an ``Answer: X`` tail when X is bare math (no ``$``, no words), else None."""
    found = _ANSWER_LINE.match(tail.split("\n", 1)[0])
    if found is None:
        return None
    value = found.group(1).strip().strip("*").rstrip(".").strip()
    if not value or "$" in value or "\\boxed" in value or _WORD.search(value):
        return None
    return value


def _parse_answer(text: str) -> list[Any]:
    """The completion's last answer parsed: from its last answer marker on (the last few tried
    in turn), else math-verify's choice in the whole text; [] when nothing parses."""
    starts = [m.start() for m in _MARKER.finditer(text)][-_MAX_TAILS:]
    for start in reversed(starts):
        tail = text[start:]
        bare = _bare_line(tail)
        parsed = (bare is not None and _parse(f"${bare}$")) or _parse(tail)
        if parsed:
            return parsed
    return _parse(text)


def _verified(gold: list[Any], text: str) -> float:
    from math_verify import verify

    answer = _parse_answer(text)
    return float(bool(answer) and verify(gold, answer, timeout_seconds=None))


def math(
    prompts: list[str], completions: list[str], *, answer: Any, **kwargs: Any
) -> list[float | None]:
    """1.0 where the completion's last answer equals ``answer`` mathematically, else 0.0 (None
    where the gold answer is missing or does not parse)."""
    golds = _per_row(answer, len(completions), "answer")
    parsed: dict[str, list[Any]] = {}  # each distinct gold parsed once per call
    out: list[float | None] = []
    for text, gold in zip(completions, golds, strict=True):
        if gold is None:
            out.append(None)
            continue
        key = str(gold).strip()
        if key not in parsed:
            parsed[key] = _parse_gold(key) if key else []
        out.append(_verified(parsed[key], text) if parsed[key] else None)
    return out


BUILTIN: Mapping[str, RewardFn] = MappingProxyType({"math": math, "exact": exact, "regex": regex})
