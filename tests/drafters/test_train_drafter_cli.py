"""``specrl train-drafter`` refuses bad values with one ``error:`` line before any work."""

from __future__ import annotations

import errno
import json

import pytest
import typer
from typer.testing import CliRunner

from specrl.drafters import data
from specrl.drafters.cli import register


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer(no_args_is_help=True, rich_markup_mode=None)
    app.callback()(lambda: None)  # a group, as in ``specrl``, even with one command
    register(app)
    return app


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--draft-vocab", "-1"], "--draft-vocab must be >= 0 (0 = full vocabulary), got -1"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--tv-steps", "-5"], "--tv-steps must be >= 0, got -5"),
        (["--temperature", "1,x"], "--temperature must be a comma list of numbers"),
        (["--temperature", "-1"], "in [0, 10], got '-1'"),
        (["--drafter", "medusa"], "unknown --drafter 'medusa'"),
        (["--seed", str(2**63)], "--seed must be in [0, 2**63 - 1], got 9223372036854775808"),
        (["--seed", "-1"], "--seed must be in [0, 2**63 - 1], got -1"),
        # issue 42: every option bounded, learning rates finite and > 0, the task checked
        (["--tv-lr", "inf"], "--tv-lr must be a finite number in (0, 1], got inf"),
        (["--lr", "nan"], "--lr must be a finite number in (0, 1], got nan"),
        (["--lr", "-1"], "--lr must be a finite number in (0, 1], got -1.0"),
        (["--batch-size", "0"], "--batch-size must be in [1, 4096], got 0"),
        (["--threads", "-1"], "--threads must be in [0, 1024], got -1"),
        (["--num-prompts", str(10**30)], f"--num-prompts must be in [1, 1000000], got {10**30}"),
        (["--ckpt-every", "0"], "--ckpt-every must be in [1, 1000000], got 0"),
        (["--task", "no_such_task"], "--task: unknown reasoning-gym task 'no_such_task'"),
        (["--task", "basic_arithmetc"], "did you mean basic_arithmetic"),
        (["--draft-layers", "2"], "--draft-layers applies only with --drafter draft, not eagle3"),
    ],
)
def test_bad_values_fail_before_work(app, tmp_path, args, match):
    result = CliRunner().invoke(app, ["train-drafter", "--out", str(tmp_path / "d"), *args])
    assert result.exit_code == 2, result.output
    assert match in result.output
    assert not (tmp_path / "d").exists()  # nothing was written


def test_a_prompts_directory_fails_before_work(app, tmp_path):
    args = ["train-drafter", "--out", str(tmp_path / "d"), "--prompts", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "is not a file" in result.output and not (tmp_path / "d").exists()


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_out_that_cannot_be_a_directory_fails_before_work(app, tmp_path, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    out = blocker if where == "a file" else blocker / "d"
    result = CliRunner().invoke(app, ["train-drafter", "--out", str(out)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot use --out: "), lines
    assert blocker.read_text() == "x"


def test_an_os_error_during_the_work_is_one_line(app, tmp_path, monkeypatch):
    """A full disk (here while loading the model, after --out was made): one ``error:`` line."""
    from specrl.models import checkpoints

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "d" / "x"))

    monkeypatch.setattr(checkpoints, "load_model", full)
    result = CliRunner().invoke(app, ["train-drafter", "--out", str(tmp_path / "d")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: No space left on device: ")


class WordTokenizer:
    """Just what ``jsonl_prompt_ids`` uses of a tokenizer."""

    def chat_prompt(self, messages: list[dict]) -> str:
        return " ".join(m["content"] for m in messages)

    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("{not json", "not JSON"),
        ("42", "expected"),
        ('{"prompt": 42}', "expected"),
        ('{"messages": "hi"}', "expected"),
        ('{"messages": [{"role": "user"}]}', "expected"),
        ('{"messages": []}', "expected"),
    ],
)
def test_a_bad_prompts_line_is_one_value_error_naming_it(tmp_path, line, match):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "one two"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=f"{path}:3: {match}"):
        data.jsonl_prompt_ids(WordTokenizer(), path)


def test_prompts_files_that_are_fine(tmp_path):
    """The format ``specrl generate --prompts-file`` reads too (``specrl.jsonl_prompts``)."""
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "one two"}, {"messages": [{"role": "user", "content": "three"}]}, "four"]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert data.jsonl_prompt_ids(WordTokenizer(), path) == [[3, 3], [5], [4]]
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="not UTF-8"):
        data.jsonl_prompt_ids(WordTokenizer(), path)


def test_a_prompts_file_over_the_cap_is_refused_unread(tmp_path, monkeypatch):
    """``train-drafter --prompts`` reads through ``jsonl_prompts.read_capped`` as ``generate``
    does (it read without bound before)."""
    from specrl import jsonl_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "one two"}\n' * 64)
    monkeypatch.setattr(jsonl_prompts, "MAX_PROMPTS_BYTES", 100)
    with pytest.raises(ValueError, match=f"{path} is larger than"):
        data.jsonl_prompt_ids(WordTokenizer(), path)
    monkeypatch.setattr(jsonl_prompts, "MAX_PROMPTS_BYTES", 1 << 20)
    assert len(data.jsonl_prompt_ids(WordTokenizer(), path)) == 64
