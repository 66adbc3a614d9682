"""Checkpoint errors are one clear line; GGUF conversion and caching behave."""

from __future__ import annotations

import json

import pytest
import torch

from specrl.models import checkpoints as ck
from specrl.models.config import SUPPORTED_TYPES, ModelConfig, tiny_config
from tests.conftest import make_tiny


def save_tiny(tmp_path):
    model = make_tiny()
    from safetensors.torch import save_file

    save_file(ck.hf_state_dict(model), str(tmp_path / "model.safetensors"))
    cfg = model.config.to_hf_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return model


def test_roundtrip_directory(tmp_path):
    model = save_tiny(tmp_path)
    loaded = ck.load_model(tmp_path)
    ids = torch.tensor([[1, 2, 3]])
    pos = torch.arange(3)[None]
    torch.testing.assert_close(loaded(ids, pos).logits, model(ids, pos).logits)


def test_unknown_model_name():
    with pytest.raises(ck.CheckpointError, match="unknown model 'no-such-model'"):
        ck.resolve_model("no-such-model")


def test_directory_without_config(tmp_path):
    with pytest.raises(ck.CheckpointError, match="no config.json"):
        ck.resolve_model(tmp_path)


def test_corrupt_safetensors(tmp_path):
    save_tiny(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(ck.CheckpointError, match="corrupt safetensors"):
        ck.load_model(tmp_path)


def test_missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny(tmp_path)
    f = tmp_path / "model.safetensors"
    sd = load_file(str(f))
    del sd["model.layers.1.mlp.down_proj.weight"]
    save_file(sd, str(f))
    with pytest.raises(ck.CheckpointError, match="missing tensor model.layers.1.mlp.down_proj"):
        ck.load_model(tmp_path)


def test_truncated_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(ck.bundled_gguf().read_bytes()[:5000])
    with pytest.raises(ck.CheckpointError, match="GGUF"):
        ck.resolve_model(bad)
    assert not list((tmp_path / "cache" / "models").glob("broken*"))  # nothing half-written


def test_unsupported_model_type():
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        ModelConfig.from_hf_dict({"model_type": "gpt2"})


def test_unpermute_inverts_llama_cpp_permutation():
    import numpy as np

    heads, rows, cols = 3, 12, 5
    w = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    # llama.cpp's conversion permutation (HF -> GGUF)
    permuted = w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)
    assert np.array_equal(ck._unpermute(permuted, heads), w)


@pytest.mark.parametrize("model_type", SUPPORTED_TYPES)
def test_hf_config_names_the_architecture_of_its_model_type(model_type):
    cfg = ModelConfig.from_hf_dict(tiny_config().to_hf_dict() | {"model_type": model_type})
    arch = cfg.to_hf_dict()["architectures"][0]
    assert arch.lower().startswith(model_type.replace("_", "")) and arch.endswith("ForCausalLM")
