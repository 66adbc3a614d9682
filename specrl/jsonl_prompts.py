"""Prompt files in JSONL: the format of ``generate --prompts-file`` and ``train-drafter --prompts``.

A leaf (imports nothing from specrl). ``read_capped(path)`` reads a prompts file whole, at most
``MAX_PROMPTS_BYTES`` (256 MiB): a larger file, or an endless one such as /dev/zero, is a
``ValueError`` ("PATH is larger than 256 MiB ...") holding at most one byte more (a regular
file's size is checked first, so nothing of it is read; a stream is read to one byte past the
cap, the buffered read taking at most one buffer more); ``OSError`` as ``open`` raises it.
``numbered_lines(data, path)`` splits UTF-8 bytes into numbered non-blank lines; ``parse_line``
reads one as JSON; ``prompt_of(item, where, chat)`` is the prompt it holds: a string,
``{"prompt": string}`` or (with ``chat``) ``{"messages": [...]}``. Each failure raises
``ValueError`` with one line naming the place and why.
Details: docs/internals.md.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

Messages = list[dict[str, str]]

MIB = 1 << 20
MAX_PROMPTS_BYTES = 256 * MIB  # a prompts file is read whole into memory: at most this much


def read_capped(path: str | Path, cap: int | None = None) -> bytes:
    """The bytes of the file at ``path`` if it holds at most ``cap`` (default
    ``MAX_PROMPTS_BYTES``), reading at most ``cap + 1``; ``ValueError`` if it holds more."""
    cap = MAX_PROMPTS_BYTES if cap is None else cap
    with open(path, "rb") as f:
        info = os.fstat(f.fileno())
        big = stat.S_ISREG(info.st_mode) and info.st_size > cap
        data = b"" if big else f.read(cap + 1)
    if big or len(data) > cap:
        raise ValueError(
            f"{path} is larger than {cap / MIB:g} MiB (prompts files are read whole into "
            "memory): split it"
        )
    return data


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
    """The prompt in one JSONL value (see docs/internals.md)."""
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
