"""specrl.jsonl_prompts: the one JSONL prompt format of ``generate`` and ``train-drafter``."""

from __future__ import annotations

import pytest

from specrl.jsonl_prompts import numbered_lines, parse_line, prompt_of

CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("chat", [True, False])
def test_strings_and_prompt_objects_are_prompts(chat):
    assert prompt_of("hi", "f:1", chat) == "hi"
    assert prompt_of({"prompt": "hi", "answer": "x"}, "f:1", chat) == "hi"  # other keys ignored


def test_messages_are_prompts_with_chat_only():
    assert prompt_of({"messages": CHAT}, "f:1", chat=True) == CHAT
    with pytest.raises(ValueError, match=r'^f:1: "messages" needs the chat template'):
        prompt_of({"messages": CHAT}, "f:1", chat=False)


@pytest.mark.parametrize(
    ("item", "why"),
    [
        (42, 'expected a string, {"prompt": string} or {"messages": [...]}, got a number (42)'),
        (None, "got null"),
        ([1], "got a list"),
        ({"prompt": True}, 'expected "prompt" to be a string, got a boolean'),
        ({"text": "hi"}, 'object with neither a "prompt" nor a "messages" key'),
        ({"prompt": "a", "messages": CHAT}, 'both "prompt" and "messages"'),
        ({"messages": []}, "got an empty list"),
        ({"messages": "hi"}, "got a string"),
        ({"messages": [{"role": "user", "content": 1}]}, "an entry that is not one"),
    ],
)
def test_anything_else_is_one_line_naming_where(item, why):
    with pytest.raises(ValueError) as e:
        prompt_of(item, "p.jsonl:3", chat=True)
    assert str(e.value).startswith("p.jsonl:3: ") and why in str(e.value)
    assert "\n" not in str(e.value)


def test_lines_and_json():
    data = '\ufeff"a"\n\n  \n{"prompt": "b\u2028c"}\n'.encode()
    assert numbered_lines(data, "p") == [(1, '"a"'), (4, '{"prompt": "b\u2028c"}')]
    with pytest.raises(ValueError, match=r"^p: not UTF-8 text \(bad byte at offset 1\)"):
        numbered_lines(b'"\xff"', "p")
    with pytest.raises(ValueError, match=r"^p:2: not JSON \("):
        parse_line("{", "p:2")
    with pytest.raises(ValueError, match=r"^p:2: not JSON \(RecursionError\)"):
        parse_line("[" * 100_000, "p:2")
