"""A checkpoint's tensors must be exactly those its config uses: tensors no parameter is built
from (a 3-layer checkpoint under a 2-layer config.json loaded silently before, the third
layer unused) or tensors it lacks are refused in one line naming the first few and the count;
the legitimate extras of Hugging Face checkpoints (rotary ``inv_freq`` buffers, an
``lm_head.weight`` beside tied embeddings) load. A GGUF file is checked the same way before it
is converted. Tiny random models; the bundled SmolLM2 conversion is the slow control."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from specrl.cli import app
from specrl.models import checkpoints as ck
from tests.conftest import make_tiny
from tests.models.test_model_load_errors import one_error_line, save_model_dir

LAYER_PARTS = 9  # Hugging Face tensors per layer of a llama model without biases


def edit_weights(model_dir: Path, edit) -> Path:
    """Rewrite ``model.safetensors`` with ``edit(tensors)`` applied."""
    f = model_dir / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f))
    return model_dir


def set_config(model_dir: Path, **changes) -> Path:
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | changes))
    return model_dir


def three_layer_dir(path: Path) -> Path:
    """A tiny model directory (tokenizer too) whose config.json says 2 layers over the weights
    of 3."""
    model_dir = save_model_dir(path)
    save_file(ck.hf_state_dict(make_tiny(num_layers=3)), str(model_dir / "model.safetensors"))
    return model_dir


def test_a_checkpoint_with_more_layers_than_its_config_is_refused(tmp_path):
    model_dir = three_layer_dir(tmp_path / "model")
    with pytest.raises(ck.CheckpointError) as e:
        ck.load_model(model_dir)
    assert str(e.value) == (
        f"model {model_dir}: checkpoint has {LAYER_PARTS} tensors the config does not use (the "
        "config has 2 layers, the checkpoint 3): model.layers.2.input_layernorm.weight, "
        "model.layers.2.mlp.down_proj.weight, model.layers.2.mlp.gate_proj.weight, ..."
    )


def test_generate_over_more_layers_than_the_config_is_one_error_line(tmp_path):
    model_dir = three_layer_dir(tmp_path / "model")
    args = ["generate", "--no-chat-template", "--model", str(model_dir), "w1 w2"]
    line = one_error_line(CliRunner().invoke(app, args))
    assert line.startswith(f"error: model {model_dir}: checkpoint has {LAYER_PARTS} tensors")
    assert "model.layers.2.input_layernorm.weight" in line


def test_a_checkpoint_with_fewer_layers_than_its_config_names_all_it_lacks(tmp_path):
    model_dir = set_config(save_model_dir(tmp_path / "model"), num_hidden_layers=4)
    with pytest.raises(ck.CheckpointError) as e:
        ck.load_model(model_dir)
    assert f"checkpoint is missing {2 * LAYER_PARTS} tensors: model.layers.2." in str(e.value)


def test_a_stray_tensor_is_named(tmp_path):
    """A bias the config turns off (attention_bias false) would be silently dropped."""
    model_dir = edit_weights(
        save_model_dir(tmp_path / "model"),
        lambda t: t.update({"model.layers.1.self_attn.q_proj.bias": torch.zeros(32)}),
    )
    with pytest.raises(ck.CheckpointError) as e:
        ck.load_model(model_dir)
    assert str(e.value) == (
        f"model {model_dir}: checkpoint has tensor model.layers.1.self_attn.q_proj.bias the "
        "config does not use"
    )


def test_an_untied_config_without_lm_head_is_refused(tmp_path):
    model_dir = set_config(save_model_dir(tmp_path / "model"), tie_word_embeddings=False)
    with pytest.raises(ck.CheckpointError, match="is missing tensor lm_head.weight$"):
        ck.load_model(model_dir)


def test_the_legitimate_extras_of_hf_checkpoints_load(tmp_path):
    """Rotary inv_freq buffers (saved by older transformers versions) and an lm_head.weight
    beside tied embeddings are not used and not refused."""
    model_dir = save_model_dir(tmp_path / "model")
    want = ck.load_model(model_dir)

    def add_extras(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
        t["model.rotary_emb.inv_freq"] = torch.ones(4)
        for i in range(2):
            t[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(4)

    got = ck.load_model(edit_weights(model_dir, add_extras))
    for (name, a), (_, b) in zip(want.named_parameters(), got.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_only_the_weights_files_are_read_not_what_lies_beside_them(tmp_path):
    """``train-drafter --drafter draft`` keeps examples.safetensors beside its model; sharded
    weights are the files their index maps."""
    model_dir = save_model_dir(tmp_path / "m")
    save_file({"hidden": torch.zeros(2, 3)}, str(model_dir / "examples.safetensors"))
    assert ck.weight_files(model_dir) == [model_dir / "model.safetensors"]
    ck.load_model(model_dir)  # the stray file is not the model's: nothing unused
    tensors = load_file(str(model_dir / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(model_dir / file))
    (model_dir / "model.safetensors").unlink()
    weight_map = {n: file for file, part in shards.items() for n in part}
    index = {"metadata": {}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    assert ck.weight_files(model_dir) == [model_dir / "a.safetensors", model_dir / "b.safetensors"]
    assert sorted(ck.read_safetensors(model_dir)) == names


def test_a_run_checkpoint_is_checked_the_same_way(tiny):
    """``load_state`` (a resume's policy tensors too) refuses what the model has no place for."""
    tensors = ck.hf_state_dict(tiny) | {"model.layers.7.mlp.up_proj.weight": torch.zeros(1)}
    with pytest.raises(ck.CheckpointError) as e:
        ck.load_state(make_tiny(seed=1), tensors)
    assert str(e.value) == (
        "checkpoint has tensor model.layers.7.mlp.up_proj.weight the config does not use "
        "(the config has 2 layers, the checkpoint 8)"
    )


# --------------------------------------------------------------------------- GGUF

GGUF_PARTS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate",
              "ffn_up", "ffn_down")  # fmt: skip


def write_gguf(path: Path, block_count: int, blocks: int, extra: tuple[str, ...] = ()) -> Path:
    """A llama GGUF whose metadata says ``block_count`` layers over tensors of ``blocks``
    (placeholder values: the names are checked before any tensor is dequantised)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(block_count)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_vocab_size(32)
    w.add_token_list([f"w{i}" for i in range(32)])
    names = ["token_embd.weight", "output_norm.weight", *extra]
    names += [f"blk.{i}.{part}.weight" for i in range(blocks) for part in GGUF_PARTS]
    for name in names:
        w.add_tensor(name, np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gguf_with_more_blocks_than_its_metadata_is_refused_before_conversion(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "three.gguf", block_count=2, blocks=3)
    with pytest.raises(ck.CheckpointError) as e:
        ck.resolve_model(path)
    assert str(e.value).startswith(
        f"GGUF {path} has {LAYER_PARTS} tensors the config does not use (the config has 2 "
        "layers, the checkpoint 3): model.layers.2.input_layernorm.weight, "
    )
    assert not list((tmp_path / "cache" / "models").glob("three*"))  # nothing converted


def test_a_gguf_missing_blocks_or_with_an_unknown_tensor_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "cache"))
    short = write_gguf(tmp_path / "short.gguf", block_count=2, blocks=1)
    with pytest.raises(ck.CheckpointError, match=f"is missing {LAYER_PARTS} tensors: model."):
        ck.resolve_model(short)
    odd = write_gguf(tmp_path / "odd.gguf", block_count=1, blocks=1, extra=("rope_freqs.weight",))
    with pytest.raises(ck.CheckpointError) as e:
        ck.resolve_model(odd)
    assert str(e.value) == f"GGUF {odd}: tensor rope_freqs.weight has no place in a llama model"


@pytest.mark.slow
def test_the_bundled_gguf_converts_and_loads_in_a_fresh_cache(tmp_path, monkeypatch):
    """Control: the bundled SmolLM2 (tied embeddings, no lm_head) passes the check."""
    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "cache"))
    model = ck.load_model()
    assert model.config.num_layers == 30 and model.config.tie_word_embeddings
