"""Prompts in a JSONL file: the one format of ``specrl generate --prompts-file`` and ``specrl
train-drafter --prompts``.

Contract (a leaf: imports nothing from specrl, so library code and CLI modules can share it):
- ``numbered_lines(data, path)`` is the (line number, line) of every non-blank line of the UTF-8
  bytes ``data`` (a leading BOM dropped; split on "\\n" only, since JSON strings may hold U+2028
  and the like); ``ValueError`` ``"PATH: not UTF-8 text (bad byte at offset N)"`` otherwise.
- ``parse_line(line, where)`` is the JSON value of one line; ``ValueError`` ``"WHERE: not JSON
  (why)"`` when it is not JSON (a number too long to convert and nesting too deep included).
- ``prompt_of(item, where, chat)`` is the prompt a JSON value holds: the string of a JSON string
  or of ``{"prompt": string}``; with ``chat``, also the messages of ``{"messages": [{"role":
  string, "content": string}, ...]}`` (a non-empty list; other keys are ignored everywhere).
  Anything else (an object with both "prompt" and "messages" included) raises ``ValueError``
  with one line ``"WHERE: why"`` naming what was found.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

Messages = list[dict[str, str]]


def numbered_lines(data: bytes, path: str | Path) -> list[tuple[int, str]]:
    """The non-blank lines of a UTF-8 JSONL file's bytes, numbered from 1."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (bad byte at offset {e.start})") from None
    return [(n, line) for n, line in enumerate(text.split("\n"), 1) if line.strip()]


def parse_line(line: str, where: str) -> Any:
    """The JSON value of one line (``where``: file:line, for the error)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
    except (ValueError, RecursionError) as e:  # a 5000-digit number, deep nesting
        raise ValueError(f"{where}: not JSON ({type(e).__name__})") from None


def prompt_of(item: Any, where: str, chat: bool) -> str | Messages:
    """The prompt in one JSONL value (see the module docstring)."""
    if isinstance(item, str):
        return item
    if not isinstance(item, dict):
        forms = 'a string, {"prompt": string}' + (' or {"messages": [...]}' if chat else "")
        raise ValueError(f"{where}: expected {forms}, got {json_kind(item)}")
    if "prompt" in item and "messages" in item:
        raise ValueError(f'{where}: object with both "prompt" and "messages"; give one')
    if "messages" in item:
        if not chat:
            raise ValueError(f'{where}: "messages" needs the chat template (--chat-template)')
        return _messages(item["messages"], where)
    if "prompt" not in item:
        keys = 'with neither a "prompt" nor a "messages" key' if chat else 'without a "prompt" key'
        raise ValueError(f"{where}: object {keys}")
    if not isinstance(item["prompt"], str):
        raise ValueError(
            f'{where}: expected "prompt" to be a string, got {json_kind(item["prompt"])}'
        )
    return item["prompt"]


def _messages(messages: Any, where: str) -> Messages:
    """``messages`` if it is a non-empty list of {"role": string, "content": string}."""
    if isinstance(messages, list) and messages:
        if all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        ):
            return messages
        got = "a list with an entry that is not one"
    else:
        got = "an empty list" if messages == [] else json_kind(messages)
    raise ValueError(
        f'{where}: expected "messages" to be a non-empty list of {{"role": string, '
        f'"content": string}}, got {got}'
    )


def json_kind(item: Any) -> str:
    """What a JSON value is, for an error message: null, a boolean, a number (N), a string..."""
    if item is None:
        return "null"
    if isinstance(item, bool):
        return "a boolean"
    if isinstance(item, int | float):
        return f"a number ({item})"
    if isinstance(item, str):
        return "a string"
    return "a list" if isinstance(item, list) else "an object"
