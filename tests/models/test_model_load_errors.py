"""A model or drafter that cannot be loaded is one ``error:`` line and exit 2, never a traceback.

Through the CLI (``specrl.cli:app``) on a tiny model directory with a word-level tokenizer, so
nothing here needs the real model: ``generate --model DIR`` whose config.json is a list, not
JSON, not UTF-8 or lacks or mistypes a field, and ``generate --spec S --drafter PATH`` for a
path that does not exist or holds no usable drafter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import save_file
from tokenizers import Tokenizer, models
from typer.testing import CliRunner

from specrl.cli import app
from specrl.drafters.cli import register as register_train_drafter
from specrl.models import checkpoints as ck
from specrl.models.tokenizer import TextTokenizer
from tests.conftest import make_tiny

WORDS = [f"w{i}" for i in range(32)]


def save_model_dir(path: Path) -> Path:
    """A loadable tiny model directory (config.json, safetensors, tokenizer)."""
    path.mkdir(parents=True, exist_ok=True)
    model = make_tiny()
    save_file(ck.hf_state_dict(model), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    vocab = {w: i for i, w in enumerate(WORDS)}
    TextTokenizer(Tokenizer(models.WordLevel(vocab, unk_token=WORDS[0])), {}).save(path)
    return path


def one_error_line(result) -> str:
    """The output, checked to be exactly one ``error:`` line (no traceback) with exit code 2."""
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert isinstance(result.exception, SystemExit)  # a clean exit, not an escaped exception
    return lines[0]


def _valid_config() -> dict:
    return make_tiny().config.to_hf_dict()


CONFIGS = {
    "a JSON list": (b"[1, 2]", "expected a JSON object, got list"),
    "not JSON": (b"{model_type: llama", "JSONDecodeError"),
    "not UTF-8": (b"\xff\xfe\x00{", "UnicodeDecodeError"),
    "empty object": (b"{}", "missing field"),
    "missing hidden_size": (
        json.dumps({k: v for k, v in _valid_config().items() if k != "hidden_size"}).encode(),
        "missing field 'hidden_size'",
    ),
    "a string for a number": (
        json.dumps(_valid_config() | {"num_attention_heads": "many"}).encode(),
        "ValueError",
    ),
    "null for a number": (
        json.dumps(_valid_config() | {"vocab_size": None}).encode(),
        "TypeError",
    ),
    "kv heads not dividing heads": (
        json.dumps(_valid_config() | {"num_key_value_heads": 3}).encode(),
        "must be a multiple",
    ),
    "zero heads": (
        json.dumps(_valid_config() | {"num_attention_heads": 0}).encode(),
        "bad config.json",
    ),
    "rope_scaling a list": (
        json.dumps(_valid_config() | {"rope_scaling": [1]}).encode(),
        "bad config.json",
    ),
    "unsupported model_type": (
        json.dumps(_valid_config() | {"model_type": "gpt2"}).encode(),
        "unsupported model_type 'gpt2'",
    ),
}


@pytest.mark.parametrize("case", list(CONFIGS), ids=list(CONFIGS))
def test_generate_with_a_bad_config_json_is_one_error_line(tmp_path, case):
    text, match = CONFIGS[case]
    model_dir = save_model_dir(tmp_path / "model")
    (model_dir / "config.json").write_bytes(text)
    args = ["generate", "--no-chat-template", "--model", str(model_dir), "w1 w2"]
    result = CliRunner().invoke(app, args)
    line = one_error_line(result)
    assert match in line and str(model_dir) in line


def test_the_control_model_directory_generates(tmp_path):
    """Control: the same directory with its own config.json works."""
    model_dir = save_model_dir(tmp_path / "model")
    args = ["generate", "--no-chat-template", "--model", str(model_dir), "--max-new-tokens", "3"]
    result = CliRunner().invoke(app, [*args, "w1 w2"])
    assert result.exit_code == 0, result.output
    assert "3 tokens" in result.output


def _head_dir(tmp_path: Path, head_json: bytes | None) -> Path:
    d = tmp_path / "head"
    d.mkdir()
    if head_json is not None:
        (d / "head.json").write_bytes(head_json)
    return d


def _bad_model_dir(tmp_path: Path) -> Path:
    d = save_model_dir(tmp_path / "draft")
    (d / "config.json").write_text("[1, 2]")
    return d


def _truncated_weights(tmp_path: Path) -> Path:
    d = save_model_dir(tmp_path / "draft")
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    return d


DRAFTERS = {
    "draft, no such path": ("draft", lambda tmp: "/nonexistent", "/nonexistent does not exist"),
    "draft, config.json a list": ("draft", _bad_model_dir, "expected a JSON object"),
    "draft, truncated weights": ("draft", _truncated_weights, "corrupt safetensors"),
    "draft, no model here": ("draft", lambda tmp: str(_head_dir(tmp, None)), "no config.json"),
    "eagle3, no such path": ("eagle3", lambda tmp: "/nonexistent", "is not a directory"),
    "eagle3, no head.json": ("eagle3", lambda tmp: _head_dir(tmp, None), "head.json"),
    "eagle3, head.json a list": ("eagle3", lambda tmp: _head_dir(tmp, b"[]"), "eagle3 drafter"),
    "mtp, head.json not JSON": ("mtp", lambda tmp: _head_dir(tmp, b"{"), "mtp drafter"),
}


@pytest.mark.parametrize("case", list(DRAFTERS), ids=list(DRAFTERS))
def test_generate_with_an_unusable_drafter_is_one_error_line(tmp_path, case):
    method, make, match = DRAFTERS[case]
    drafter = str(make(tmp_path))
    model_dir = save_model_dir(tmp_path / "model")
    args = ["generate", "--no-chat-template", "--model", str(model_dir), "--spec", method]
    args += ["--drafter", drafter]
    line = one_error_line(CliRunner().invoke(app, [*args, "w1 w2"]))
    assert match in line and drafter in line


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_a_learned_drafter_without_a_head_is_refused_or_run_on_request(tmp_path, monkeypatch,
                                                                        method):  # fmt: skip
    """No --drafter and no cached head: one line naming train-drafter (a random head used to run
    silently); --drafter untrained runs it, with a warning; a cached head is taken by default."""
    from specrl.paths import drafter_cache_dir

    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "cache"))
    model_dir = save_model_dir(tmp_path / "model")
    args = ["generate", "--no-chat-template", "--model", str(model_dir), "--spec", method,
            "--num-spec-tokens", "2", "--max-new-tokens", "3", "--temperature", "0"]  # fmt: skip
    line = one_error_line(CliRunner().invoke(app, [*args, "w1 w2"]))
    assert f"specrl train-drafter --drafter {method}" in line and "untrained" in line
    ran = CliRunner().invoke(app, [*args, "--drafter", "untrained", "w1 w2"])
    assert ran.exit_code == 0, ran.output
    assert "warning: --spec" in ran.stderr and "untrained" in ran.stderr
    assert "--- prompt 1, sample 1 (3 tokens" in ran.stdout
    cached = drafter_cache_dir(str(model_dir), method)
    cached.mkdir(parents=True)
    (cached / "head.json").write_text("[]")  # found (so loaded, and refused as damaged)
    line = one_error_line(CliRunner().invoke(app, [*args, "w1 w2"]))
    assert f"cannot load the {method} drafter from {cached}" in line


def test_load_config_errors_are_checkpoint_errors(tmp_path):
    """The library raises ``CheckpointError`` (a ValueError) with one line for each case."""
    for case, (text, match) in CONFIGS.items():
        (tmp_path / "config.json").write_bytes(text)
        with pytest.raises(ck.CheckpointError, match=match) as e:
            ck.load_config(tmp_path)
        assert "\n" not in str(e.value), case


def test_train_drafter_with_a_bad_model_is_one_error_line(tmp_path):
    import typer

    cli = typer.Typer(rich_markup_mode=None)
    cli.callback()(lambda: None)
    register_train_drafter(cli)
    model_dir = save_model_dir(tmp_path / "model")
    (model_dir / "config.json").write_text("[]")
    args = ["train-drafter", "--model", str(model_dir), "--out", str(tmp_path / "out")]
    line = one_error_line(CliRunner().invoke(cli, args))
    assert "expected a JSON object" in line


TOKENIZERS = {
    "tokenizer.json not JSON": ("tokenizer.json", b"{", "cannot read the tokenizer"),
    "tokenizer_config.json a list": ("tokenizer_config.json", b"[]", "not an object"),
    "tokenizer_config.json not JSON": ("tokenizer_config.json", b"{", "JSONDecodeError"),
    "chat template does not compile": (
        "tokenizer_config.json",
        json.dumps({"chat_template": "{% for %}"}).encode(),
        "TemplateSyntaxError",
    ),
}


@pytest.mark.parametrize("case", list(TOKENIZERS), ids=list(TOKENIZERS))
def test_a_damaged_tokenizer_is_one_error_line(tmp_path, case):
    name, data, match = TOKENIZERS[case]
    model_dir = save_model_dir(tmp_path / "model")
    (model_dir / name).write_bytes(data)
    args = ["generate", "--no-chat-template", "--model", str(model_dir), "w1 w2"]
    line = one_error_line(CliRunner().invoke(app, args))
    assert match in line and str(model_dir) in line


def test_a_bug_in_the_tokenizer_is_not_dressed_as_a_damaged_file(tmp_path, monkeypatch):
    """Only the tokenizers library's bare ``Exception`` means a damaged file; a bug (here a
    TypeError) keeps its traceback."""

    def buggy(model_dir):
        raise TypeError("a bug")

    monkeypatch.setattr(TextTokenizer, "load", buggy)
    with pytest.raises(TypeError, match="a bug"):
        ck.load_tokenizer(save_model_dir(tmp_path / "model"))
