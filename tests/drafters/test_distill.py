"""Distilled draft model on a tiny target: the loss falls, acceptance beats the undistilled layer
prefix, the saved directory loads unchanged, resume gives the same losses, bad layers refused."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, models
from typer.testing import CliRunner

from specrl.cli import app
from specrl.drafters.distill import distill, init_draft, save_draft_model
from specrl.drafters.train import TrainConfig, acceptance
from specrl.models.checkpoints import load_draft_model, load_model
from specrl.models.tokenizer import TextTokenizer
from tests.conftest import make_tiny
from tests.drafters.test_train import tiny_setup

torch.set_num_threads(1)


def accept(target, draft, prompts) -> dict[float, float]:
    return {t: acceptance(target, draft, prompts, k=3, temperature=t, max_new_tokens=24)
            for t in (0.0, 1.0)}  # fmt: skip


def test_loss_falls_distilled_accepts_more_and_loads_unchanged(tmp_path):
    target, _, examples, held_out = tiny_setup()
    draft = init_draft(target, 2)
    before = accept(target, draft, held_out)
    cfg = TrainConfig(steps=80, lr=1e-2, warmup=5, batch_size=8, bf16=False, ckpt_every=40)
    losses = distill(draft, target, examples, cfg, out=tmp_path / "d", progress=False)
    assert len(losses) == 80
    assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:10]) / 10
    after = accept(target, draft, held_out)
    assert after[0.0] > before[0.0] and after[1.0] > before[1.0], (before, after)
    assert torch.equal(draft.embed.weight, target.embed.weight)  # tied embedding/LM head frozen

    loaded = load_model(tmp_path / "d")
    ids = torch.randint(0, 32, (2, 9))
    positions = torch.arange(9).expand(2, 9)
    assert torch.equal(loaded(ids, positions).logits, draft(ids, positions).logits)
    assert accept(target, loaded, held_out) == after
    assert json.loads((tmp_path / "d" / "config.json").read_text())["num_hidden_layers"] == 2
    spec = json.loads((tmp_path / "d" / "distill.json").read_text())
    assert spec["format"] == "specrl-distilled-draft" and spec["num_layers"] == 2


def test_resume_gives_the_same_losses(tmp_path):
    target, _, examples, _ = tiny_setup()
    cfg = TrainConfig(steps=6, warmup=2, batch_size=4, ckpt_every=3)  # bf16 autocast
    full = distill(init_draft(target, 2), target, examples, cfg, progress=False)
    part = TrainConfig(**{**vars(cfg), "steps": 3})
    distill(init_draft(target, 2), target, examples, part, out=tmp_path / "r", progress=False)
    fresh = init_draft(target, 2)  # undistilled weights: resume must load the saved state
    resumed = distill(fresh, target, examples, cfg, out=tmp_path / "r", progress=False)
    assert len(resumed) == 6
    assert resumed[:3] == full[:3]
    torch.testing.assert_close(torch.tensor(resumed[3:]), torch.tensor(full[3:]))


def word_tokenizer(words: list[str]) -> TextTokenizer:
    vocab = {w: i for i, w in enumerate(words)}
    return TextTokenizer(Tokenizer(models.WordLevel(vocab, unk_token=words[0])), {})


def test_draft_loader_takes_the_directory_and_checks_the_tokenizer(tmp_path):
    target = make_tiny(seed=3, vocab_size=32, num_layers=4)
    tok = word_tokenizer([f"w{i}" for i in range(32)])
    tok.save(tmp_path)
    save_draft_model(init_draft(target, 1), tmp_path / "d", target.config, tokenizer_dir=tmp_path)
    draft = load_draft_model(str(tmp_path / "d"), target, tok)
    assert draft.config.num_layers == 1 and draft.embed.weight.dtype == target.embed.weight.dtype
    with pytest.raises(ValueError, match="different tokenizer"):
        load_draft_model(str(tmp_path / "d"), target, word_tokenizer([f"v{i}" for i in range(32)]))


@pytest.mark.parametrize("layers", [0, 5])
def test_bad_draft_layers_are_refused(tmp_path, layers):
    target = make_tiny(seed=3, vocab_size=32, num_layers=4)
    with pytest.raises(ValueError, match=f"got {layers}"):
        init_draft(target, layers)
    save_draft_model(target, tmp_path / "tiny", target.config)  # a 4-layer model directory
    args = ["train-drafter", "--drafter", "draft", "--set", f"drafter.draft_layers={layers}",
            "--model", str(tmp_path / "tiny"), "--out", str(tmp_path / "d")]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    expected = {
        0: "bad value for drafter.draft_layers: Input should be greater than or equal to 1",
        5: "drafter.draft_layers must be in [1, 4] (the target's layer count), got 5",
    }[layers]
    assert expected in result.output
    assert not (tmp_path / "d").exists()  # refused before any work
