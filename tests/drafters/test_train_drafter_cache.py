"""``train-drafter``'s cached rollouts and examples are keyed by what made them (issue 56).

Examples made for another task or length (or by an older specrl, with no key) are never
reused: the command says why in one ``notice:`` line and builds them again (and drops the
training states made from the old ones). On a tiny model directory with a word-level tokenizer
and a one-line chat template, tiny options (2 prompts, 3 new tokens, 1 step).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import typer
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from typer.testing import CliRunner

from specrl.drafters import data
from specrl.drafters.cli import register
from specrl.models import checkpoints as ck
from specrl.models.tokenizer import TextTokenizer
from tests.conftest import make_tiny

torch.set_num_threads(1)

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
TINY = ["--drafter", "mtp", "--set", "data.num_prompts=2", "--set", "data.samples_per_prompt=1",
        "--set", "data.temperatures=[0]", "--set", "train.steps=1", "--set", "train.tv_steps=0",
        "--set", "train.batch_size=2", "--set", "eval.prompts=1",
        "--set", "eval.num_spec_tokens=1", "--set", "drafter.draft_vocab=0"]  # fmt: skip


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer(no_args_is_help=True, rich_markup_mode=None)
    app.callback()(lambda: None)
    register(app)
    return app


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A tiny model directory whose tokenizer has a chat template."""
    path = tmp_path_factory.mktemp("model")
    net = make_tiny()
    save_file(ck.hf_state_dict(net), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(net.config.to_hf_dict()))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(32)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    TextTokenizer(tok, {"chat_template": TEMPLATE}).save(path)
    return path


def train(app, model: Path, out: Path, task: str, new_tokens: int):
    args = ["train-drafter", "--model", str(model), "--out", str(out), "--task", task,
            "--set", f"data.max_new_tokens={new_tokens}", *TINY]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return result


def made_by(path: Path) -> dict:
    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()[data.MADE_BY])


def notices(result) -> list[str]:
    return [ln for ln in result.stderr.splitlines() if ln.startswith("notice: ")]


def test_examples_for_another_task_and_length_are_made_again(app, model, tmp_path):
    out = tmp_path / "h"
    first = train(app, model, out, "basic_arithmetic", 3)
    assert "loaded" not in first.output and not notices(first)
    key = made_by(out / "examples.safetensors")
    assert key["source"] == "task basic_arithmetic" and key["max_new_tokens"] == "3"
    again = train(app, model, out, "basic_arithmetic", 3)  # the same: reused
    assert "loaded 2 examples from" in again.output and not notices(again)

    other = train(app, model, out, "leg_counting", 4)
    assert "loaded" not in other.output, other.output
    ex, seqs = out / "examples.safetensors", out / "rollouts.json"
    assert notices(other) == [
        f"notice: not using {ex}: {ex} was made with source 'task basic_arithmetic', not "
        "'task leg_counting'; building the examples again",
        "notice: removed train_state.safetensors (trained on other examples); training from step 0",
        f"notice: not using {seqs}: {seqs} was made with source 'task basic_arithmetic', not "
        "'task leg_counting'; generating the rollouts again",
    ]
    key = made_by(ex)
    assert key["source"] == "task leg_counting" and key["max_new_tokens"] == "4"
    assert all(len(e.tokens) - e.prompt_len <= 4 for e in data.load_examples(ex))
    assert json.loads(seqs.read_text())[data.MADE_BY]["source"] == "task leg_counting"


def test_examples_without_a_key_are_made_again(app, model, tmp_path):
    """An older specrl's files (no key): rebuilt, with a notice saying so."""
    out = tmp_path / "h"
    train(app, model, out, "basic_arithmetic", 3)
    ex, seqs = out / "examples.safetensors", out / "rollouts.json"
    data.save_examples(data.load_examples(ex), ex)  # no made_by
    rows = json.loads(seqs.read_text())["rollouts"]
    seqs.write_text(json.dumps(rows))  # the old format: a bare list
    result = train(app, model, out, "basic_arithmetic", 3)
    lines = notices(result)
    assert lines[0] == (
        f"notice: not using {ex}: {ex} records no key of what made it (made before keys); "
        "building the examples again"
    )
    assert f"not using {seqs}: {seqs} records no key" in lines[-1]
    assert made_by(ex)["source"] == "task basic_arithmetic"


def test_a_stale_key_names_the_first_field_that_differs(tmp_path):
    ex = [data.Example(torch.arange(4), 2, torch.zeros(4, 3), torch.zeros(4, 5))]
    path = tmp_path / "e.safetensors"
    data.save_examples(ex, path, {"source": "task a", "seed": "0"})
    assert len(data.load_examples(path, {"source": "task a", "seed": "0"})) == 1
    assert len(data.load_examples(path)) == 1  # no key asked for: any
    with pytest.raises(data.StaleData, match="made with seed '0', not '1'"):
        data.load_examples(path, {"source": "task a", "seed": "1"})
    with pytest.raises(data.StaleData, match="made with model None, not 'x'"):
        data.load_examples(path, {"model": "x"})
    rollouts = tmp_path / "r.json"
    data.save_rollouts([data.Sequence([1, 2, 3], 1)], rollouts, {"source": "task a"})
    assert data.load_rollouts(rollouts, {"source": "task a"})[0].tokens == [1, 2, 3]
    with pytest.raises(data.StaleData, match="made with source 'task a', not 'task b'"):
        data.load_rollouts(rollouts, {"source": "task b"})
