"""Exporting drafters to vLLM (``specrl.drafters.export``) and the EAGLE-3 head layout.

The exported files are read back by an independent reader that applies vLLM's own name mapping
(``Eagle3LlamaForCausalLM.load_weights`` and ``LlamaModel.hf_to_vllm_mapper`` in
``vllm/model_executor/models/llama_eagle3.py``, vLLM 0.32) and run by a plain-torch forward of
vLLM's EAGLE-3 layer (``LlamaDecoderLayer.forward`` there, layer 0); both must equal specrl's
head. With vLLM installed, vLLM's own class loads and runs the export too (a subprocess).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import typer
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from specrl.cli_export import register as register_export
from specrl.drafters.cli import register
from specrl.drafters.distill import init_draft, save_draft_model
from specrl.drafters.export import (
    ExportError,
    export_draft_model,
    export_eagle3,
    import_eagle3,
    is_eagle3_export,
)
from specrl.fsutil import write_manifest
from specrl.models.checkpoints import hf_state_dict, load_model
from specrl.models.head_kinds import load_head
from specrl.models.heads import HEAD_FILES, DraftHead, save_head
from specrl.models.transformer import Transformer
from tests.conftest import ON_SERVER_WORKER, make_tiny

torch.set_num_threads(1)

V, L = 64, 8  # tiny target: vocabulary, layers (default feature layers 1, 3, 4)
D2T = torch.tensor([0, 2, 3, 7, 11, 20, 33, 40, 41, 63])  # a reduced draft vocabulary
FAMILIES = {  # model_type -> tiny-config overrides
    "llama": {},
    "qwen2": {"model_type": "qwen2", "attention_bias": True},
    "qwen3": {"model_type": "qwen3", "qk_norm": True},
}


def target_of(family: str = "llama", **overrides) -> Transformer:
    return make_tiny(seed=1, **({"num_layers": L, "vocab_size": V} | FAMILIES[family] | overrides))


def random_head(target, d2t=D2T, arch: str = "eagle3", kind: str = "eagle3") -> DraftHead:
    torch.manual_seed(3)
    head = DraftHead(target, kind, draft_vocab=d2t, arch=arch)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return head.eval()


def model_dir(model: Transformer, path: Path) -> Path:
    """A Hugging Face model directory of ``model`` (config.json, model.safetensors)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    state = {k: v.contiguous() for k, v in hf_state_dict(model).items()}
    save_file(state, str(path / "model.safetensors"))
    return path


def exported(tmp_path: Path, family: str = "llama", d2t=D2T):
    """(target, head, export dir) for a random eagle3-layout head on a tiny target."""
    target = target_of(family)
    head = random_head(target, d2t)
    out = export_eagle3(save_head(head, tmp_path / "head"), target, tmp_path / "vllm")
    return target, head, out


# ----------------------------------------------------------------- vLLM's side, re-implemented

STACKED = {  # vLLM's stacked parameters: shard name -> (parameter name, position)
    ".q_proj": (".qkv_proj", 0),
    ".k_proj": (".qkv_proj", 1),
    ".v_proj": (".qkv_proj", 2),
    ".gate_proj": (".gate_up_proj", 0),
    ".up_proj": (".gate_up_proj", 1),
}


def vllm_read(out: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, vLLM parameter name -> tensor) as Eagle3LlamaForCausalLM.load_weights maps the
    checkpoint: t2d skipped, d2t -> draft_id_to_target_id, "model." prefixed (not lm_head),
    "midlayer." -> "layers.0.", q/k/v and gate/up stacked in shard order."""
    config = json.loads((out / "config.json").read_text())
    shards: dict[str, dict[int, torch.Tensor]] = {}
    params: dict[str, torch.Tensor] = {}
    for name, w in load_file(str(out / "model.safetensors")).items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name.replace("midlayer.", "layers.0.")
        for shard, (param, pos) in STACKED.items():
            if shard in name:
                shards.setdefault(name.replace(shard, param), {})[pos] = w
                break
        else:
            assert name not in params, name
            params[name] = w
    for name, parts in shards.items():
        params[name] = torch.cat([parts[i] for i in sorted(parts)])
    return config, params


def vllm_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The parameters vLLM's EAGLE-3 class builds from config.json (embedding excluded: shared
    with the target), with their shapes; from config.json alone."""
    h, i = config["hidden_size"], config["intermediate_size"]
    d, heads, kv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    n = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    vd, m = config["draft_vocab_size"], "model.layers.0."
    shapes = {
        "model.fc.weight": (h, config["target_hidden_size"] * n),
        m + "self_attn.qkv_proj.weight": ((heads + 2 * kv) * d, 2 * h),
        m + "self_attn.o_proj.weight": (h, heads * d),
        m + "mlp.gate_up_proj.weight": (2 * i, h),
        m + "mlp.down_proj.weight": (h, i),
        m + "input_layernorm.weight": (h,),
        m + "post_attention_layernorm.weight": (h,),
        m + "hidden_norm.weight": (h,),
        "model.norm.weight": (h,),
        "lm_head.weight": (vd, h),
    }
    if config["attention_bias"]:
        shapes[m + "self_attn.qkv_proj.bias"] = ((heads + 2 * kv) * d,)
        if config["model_type"] != "qwen3":
            shapes[m + "self_attn.o_proj.bias"] = (h,)
    if config["model_type"] == "qwen3":
        shapes |= {m + "self_attn.q_norm.weight": (d,), m + "self_attn.k_norm.weight": (d,)}
    if vd != config["vocab_size"]:
        shapes["draft_id_to_target_id"] = (vd,)
    return shapes


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style (rotate-half) RoPE of x [T, heads, D] at positions 0..T-1."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    f = torch.arange(x.shape[0]).float()[:, None] * inv  # [T, D/2]
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def vllm_forward(config: dict, p: dict, hidden: torch.Tensor, ids: torch.Tensor, embed):
    """vLLM's EAGLE-3 layer 0 + norm + compute_logits on one sequence, causal: hidden [T, H]
    (fc output or fed-back pre-norm output), ids [T] -> (pre-norm g [T, H], logits [T, V])."""
    eps, m, d = config["rms_norm_eps"], "model.layers.0.", config["head_dim"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    z = torch.cat([rms(embed[ids], p[m + "input_layernorm.weight"], eps),
                   rms(hidden, p[m + "hidden_norm.weight"], eps)], -1)  # fmt: skip
    qkv = F.linear(z, p[m + "self_attn.qkv_proj.weight"], p.get(m + "self_attn.qkv_proj.bias"))
    q, k, v = qkv.split([heads * d, kv * d, kv * d], -1)
    q, k, v = q.view(-1, heads, d), k.view(-1, kv, d), v.view(-1, kv, d)
    if config["model_type"] == "qwen3":
        q, k = (
            rms(q, p[m + "self_attn.q_norm.weight"], eps),
            rms(k, p[m + "self_attn.k_norm.weight"], eps),
        )
    q, k = rope(q, config["rope_theta"]), rope(k, config["rope_theta"])
    rep = heads // kv
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    t = q.shape[0]
    scores = torch.einsum("thd,shd->hts", q, k) / d**0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    a = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, -1)
    x = hidden + F.linear(a, p[m + "self_attn.o_proj.weight"], p.get(m + "self_attn.o_proj.bias"))
    gate, up = F.linear(rms(x, p[m + "post_attention_layernorm.weight"], eps),
                        p[m + "mlp.gate_up_proj.weight"]).chunk(2, -1)  # fmt: skip
    g = x + F.linear(F.silu(gate) * up, p[m + "mlp.down_proj.weight"])
    logits = rms(g, p["model.norm.weight"], eps) @ p["lm_head.weight"].T  # [T, Vd]
    if "draft_id_to_target_id" not in p:
        return g, logits
    vd = config["draft_vocab_size"]
    full = logits.new_full((t, config["vocab_size"]), float("-inf"))
    full[:, torch.arange(vd) + p["draft_id_to_target_id"]] = logits
    return g, full


def specrl_drafting(head: DraftHead, feats, ids):
    """specrl's head on the same inputs with its KV cache: g [T+1, H] and logits [T+1, Vd] at
    positions 0..T, position T fed back its own output of T-1 with token ids[T]."""
    t = feats.shape[0]
    cache, zero = head.new_cache(1, 16), torch.zeros(1, dtype=torch.long)
    g = head.step(head.features_in(feats[None]), ids[None, :t], torch.arange(t)[None], cache,
                  torch.zeros(1, t, dtype=torch.long), zero, t)  # fmt: skip
    g2 = head.step(g[:, -1:], ids[None, t:], torch.tensor([[t]]), cache, zero[None], zero, t + 1)
    g = torch.cat([g, g2], 1)[0]
    return g, head.logits(g)


def inputs(target: Transformer, head: DraftHead, t: int = 6):
    """Target features [T, n*H] of a random sequence and the tokens x_{i+1} [T+1]."""
    torch.manual_seed(5)
    seq = torch.randint(0, V, (1, t + 2))
    out = target(seq[:, :t], torch.arange(t)[None], capture=head.feature_layers)
    return torch.cat(out.captured, -1)[0], seq[0, 1:]


# ------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("reduced", [True, False])
def test_export_has_exactly_the_parameters_vllm_builds(tmp_path, family, reduced):
    target, head, out = exported(tmp_path, family, D2T if reduced else None)
    config, params = vllm_read(out)
    want = vllm_shapes(config)
    assert {k: tuple(v.shape) for k, v in params.items()} == want
    arch = "Eagle3Qwen3ForCausalLM" if family == "qwen3" else "LlamaForCausalLMEagle3"
    assert config["architectures"] == [arch] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == (len(D2T) if reduced else V)
    assert config["vocab_size"] == V and config["target_hidden_size"] == 32
    assert config["tie_word_embeddings"] is False and config["norm_before_residual"] is False
    # vLLM's aux id j is the output of target layer j-1; specrl's feature layer l is layer l's
    ids = [x + 1 for x in head.feature_layers]
    assert config["eagle_aux_hidden_state_layer_ids"] == ids == [2, 4, 5]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ids


def test_exported_values_and_vocabulary_mapping(tmp_path):
    target, head, out = exported(tmp_path)
    _, p = vllm_read(out)
    raw = load_file(str(out / "model.safetensors"))
    s, m = head.state_dict(), "model.layers.0."
    assert torch.equal(p["model.fc.weight"], s["fc.weight"])
    assert torch.equal(p[m + "hidden_norm.weight"], s["hnorm.weight"])
    assert torch.equal(p[m + "input_layernorm.weight"], s["enorm.weight"])
    assert torch.equal(p[m + "self_attn.qkv_proj.weight"], s["block.attn.qkv.weight"])
    assert torch.equal(p[m + "mlp.gate_up_proj.weight"], s["block.mlp.gate_up.weight"])
    assert torch.equal(p[m + "post_attention_layernorm.weight"], s["block.mlp_norm.weight"])
    assert torch.equal(p["lm_head.weight"], target.lm_head.weight[D2T])
    # vLLM: draft index i -> target id i + d2t[i]; t2d marks the draft vocabulary
    assert raw["d2t"].dtype == torch.int64
    assert torch.equal(torch.arange(len(D2T)) + raw["d2t"], D2T)
    assert raw["t2d"].dtype == torch.bool and torch.equal(raw["t2d"].nonzero()[:, 0], D2T)
    assert "model.embed_tokens.weight" not in p  # vLLM shares the target's embedding


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("reduced", [True, False])
def test_exported_forward_equals_the_head(tmp_path, family, reduced):
    """vLLM's layer on the exported weights == specrl's head: features in, then one fed-back
    drafting step; logits over the target vocabulary (-inf outside the draft vocabulary)."""
    target, head, out = exported(tmp_path, family, D2T if reduced else None)
    config, p = vllm_read(out)
    feats, ids = inputs(target, head)
    with torch.no_grad():
        g, logits = specrl_drafting(head, feats, ids)
        h = feats @ p["model.fc.weight"].T
        g_ref, _ = vllm_forward(config, p, h, ids[:-1], target.embed.weight)
        h = torch.cat([h, g_ref[-1:]])  # vLLM's proposer feeds the pre-norm output back
        g_ref, logits_ref = vllm_forward(config, p, h, ids, target.embed.weight)
    torch.testing.assert_close(g_ref, g, atol=1e-5, rtol=1e-5)
    want = logits if not reduced else head.to_full(logits).masked_fill(~_in(D2T), float("-inf"))
    torch.testing.assert_close(logits_ref, want, atol=1e-5, rtol=1e-5)


def _in(ids: torch.Tensor) -> torch.Tensor:
    return torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("reduced", [True, False])
def test_import_reads_an_export_back_as_the_same_head(tmp_path, family, reduced):
    """``import_eagle3`` is ``export_eagle3`` backwards: the same head tensors, layers and
    draft vocabulary (what the vLLM backend serves is what its online trainer starts from)."""
    target, head, out = exported(tmp_path, family, D2T if reduced else None)
    back = import_eagle3(out, target)
    assert (back.kind, back.arch, back.feature_layers) == ("eagle3", "eagle3", head.feature_layers)
    want, got = head.state_dict(), back.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert is_eagle3_export(out) and not is_eagle3_export(tmp_path / "head")


def test_import_refuses_what_the_head_cannot_hold(tmp_path):
    target, _, out = exported(tmp_path)
    with pytest.raises(ExportError, match="drafter for another target"):
        import_eagle3(out, target_of(hidden_size=64))
    raw = load_file(str(out / "model.safetensors"))
    save_file(raw | {"embed_tokens.weight": torch.zeros(V, 32)}, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match="model.safetensors: .* the manifest says"):
        import_eagle3(out, target)  # changed after it was written: refused before it is read
    write_manifest(out, ["model.safetensors", "config.json"])  # as if written so
    with pytest.raises(ExportError, match="embed_tokens.weight has no place in specrl's head"):
        import_eagle3(out, target)
    save_file({k: v for k, v in raw.items() if k != "fc.weight"}, str(out / "model.safetensors"))
    write_manifest(out, ["model.safetensors", "config.json"])
    with pytest.raises(ExportError, match="does not fit an eagle3 head: .*fc.weight"):
        import_eagle3(out, target)


def test_export_reads_the_lm_head_from_a_model_directory(tmp_path):
    """A target named by directory: only its LM head is read (tied: the embedding)."""
    for tied in (True, False):
        target = target_of(tie_word_embeddings=tied)
        head = random_head(target)
        src = model_dir(target, tmp_path / f"target-{tied}")
        out = export_eagle3(save_head(head, tmp_path / f"h-{tied}"), src, tmp_path / f"o-{tied}")
        w = load_file(str(out / "model.safetensors"))["lm_head.weight"]
        assert torch.equal(w, target.lm_head.weight[D2T])


def test_export_dtype(tmp_path):
    target = target_of()
    head_dir = save_head(random_head(target), tmp_path / "h")
    out = export_eagle3(head_dir, target, tmp_path / "o", dtype=torch.bfloat16)
    w = load_file(str(out / "model.safetensors"))
    assert w["fc.weight"].dtype == torch.bfloat16 and w["d2t"].dtype == torch.int64
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_what_vllm_cannot_load_is_refused(tmp_path):
    target = target_of()
    proj = save_head(random_head(target, arch="proj"), tmp_path / "proj")
    with pytest.raises(ExportError, match="'proj' layout .* --head-arch eagle3"):
        export_eagle3(proj, target, tmp_path / "o1")
    mtp = save_head(random_head(target, None, "proj", "mtp"), tmp_path / "mtp")
    with pytest.raises(ExportError, match="MTP head: vLLM runs MTP only from"):
        export_eagle3(mtp, target, tmp_path / "o2")
    good = save_head(random_head(target), tmp_path / "good")
    with pytest.raises(ExportError, match="layer count 8, but the target has 6"):
        export_eagle3(good, target_of(num_layers=6), tmp_path / "o3")
    with pytest.raises(ExportError, match="cannot read the head"):
        export_eagle3(tmp_path / "nowhere", target, tmp_path / "o4")
    state = load_file(str(good / "head.safetensors"))
    state["block.attn.qkv.weight"] = state["block.attn.qkv.weight"][:-1].contiguous()
    save_file(state, str(good / "head.safetensors"))
    write_manifest(good, list(HEAD_FILES))  # each damage below as if the head were saved so
    with pytest.raises(ExportError, match=r"block.attn.qkv.weight has shape \(63, 64\)"):
        export_eagle3(good, target, tmp_path / "o5")
    cfg = json.loads((good / "head.json").read_text())
    (good / "head.json").write_text(json.dumps(cfg | {"feature_layers": [1, 3, 99]}))
    write_manifest(good, list(HEAD_FILES))
    with pytest.raises(ExportError, match=r"feature layers \[1, 3, 99\] are not"):
        export_eagle3(good, target, tmp_path / "o6")
    (good / "head.safetensors").write_bytes(b"garbage")
    (good / "head.json").write_text(json.dumps(cfg))
    write_manifest(good, list(HEAD_FILES))
    with pytest.raises(ExportError, match="cannot read .*head.safetensors"):
        export_eagle3(good, target, tmp_path / "o7")
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 8))


# --------------------------------------------------------------------------- the eagle3 layer


def test_eagle3_layer_unroll_equals_cached_drafting():
    """Training-time test of the eagle3 layout == drafting with its KV cache (depth 1, 2)."""
    target = target_of()
    head = random_head(target, None)
    feats, ids = inputs(target, head, t=7)
    with torch.no_grad():
        unrolled = head.unroll(feats[None], ids[None, :7], 3)
        for i in range(2, 7):  # depth 2 at position i: true features to i-2, two own steps
            cache, zero = head.new_cache(1, 16), torch.zeros(1, dtype=torch.long)
            n = i - 1
            g = head.step(head.features_in(feats[None, :n]), ids[None, :n],
                          torch.arange(n)[None], cache, torch.zeros(1, n, dtype=torch.long),
                          zero, n)[:, -1:]  # fmt: skip
            for pos in (n, n + 1):
                g = head.step(g, ids[None, pos : pos + 1], torch.tensor([[pos]]), cache,
                              zero[None], zero, pos + 1)  # fmt: skip
            torch.testing.assert_close(g[0, 0], unrolled[2][0, i], atol=1e-4, rtol=1e-4)


def test_eagle3_layer_checkpoints_and_refusals(tmp_path):
    target = target_of()
    head = random_head(target)
    assert head.proj is None and head.block.attn_norm is None
    assert head.block.attn.qkv.weight.shape == (64, 64)  # q + 2 kv rows, 2H columns
    again = load_head(save_head(head, tmp_path / "h"), target)
    assert again.arch == "eagle3"
    pairs = zip(head.state_dict().values(), again.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    old = json.loads((tmp_path / "h" / "head.json").read_text())
    proj = save_head(random_head(target, arch="proj"), tmp_path / "p")
    cfg = json.loads((proj / "head.json").read_text())
    del cfg["arch"], cfg["checksums"]  # heads saved before the choice existed load as "proj"
    (proj / "head.json").write_text(json.dumps(cfg))
    (proj / "manifest.json").unlink()  # (and before checksums)
    assert load_head(proj, target).arch == "proj"
    (tmp_path / "h" / "head.json").write_text(json.dumps(old | {"arch": "medusa"}))
    write_manifest(tmp_path / "h", list(HEAD_FILES))  # as if saved so
    with pytest.raises(ValueError, match="unknown arch 'medusa'"):
        load_head(tmp_path / "h", target)
    with pytest.raises(ValueError, match="for eagle3 heads, not 'mtp'"):
        DraftHead(target, "mtp", arch="eagle3")


# ------------------------------------------------------------------------------- draft model


def draft_dir(tmp_path: Path, tokenizer: bool = True) -> tuple[Transformer, Path]:
    target = target_of()
    tok = tmp_path / "tok"
    tok.mkdir(exist_ok=True)
    (tok / "tokenizer.json").write_text('{"model": "stub"}')
    (tok / "tokenizer_config.json").write_text("{}")
    draft = init_draft(target, 2)
    src = save_draft_model(draft, tmp_path / "draft", target.config, tok if tokenizer else None)
    return draft, src


def test_export_draft_model_is_an_hf_checkpoint(tmp_path):
    draft, src = draft_dir(tmp_path)
    out = export_draft_model(src, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 2
    names = set(load_file(str(out / "model.safetensors")))
    assert "model.layers.1.self_attn.q_proj.weight" in names and "lm_head.weight" not in names
    assert (out / "tokenizer.json").read_text() == '{"model": "stub"}'
    again = load_model(out)
    for a, b in zip(again.state_dict().values(), draft.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert export_draft_model(src, src) == src  # in place: checked only


def test_export_draft_model_refusals(tmp_path):
    _, src = draft_dir(tmp_path, tokenizer=False)
    with pytest.raises(ExportError, match="no tokenizer.json: name the target model"):
        export_draft_model(src, tmp_path / "out")
    out = export_draft_model(src, tmp_path / "out", tokenizer_dir=tmp_path / "tok")
    assert (out / "tokenizer_config.json").exists()
    with pytest.raises(ExportError, match="is not a model vLLM can load"):
        export_draft_model(tmp_path / "tok", tmp_path / "out2")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(ExportError, match="cannot export the drafter: .*config.json: "):
        export_draft_model(out, out)  # changed after it was written: refused before it is read
    write_manifest(out, [p.name for p in out.iterdir() if p.name != "manifest.json"])
    with pytest.raises(ExportError, match=r"vLLM needs \['LlamaForCausalLM'\]"):
        export_draft_model(out, out)


# ---------------------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer(no_args_is_help=True, rich_markup_mode=None)
    app.callback()(lambda: None)
    register(app)  # train-drafter
    register_export(app)  # export-drafter
    return app


def test_cli_exports_an_eagle3_head(app, tmp_path):
    target = target_of()
    src = model_dir(target, tmp_path / "target")
    head = save_head(random_head(target), tmp_path / "head")
    args = [
        "export-drafter",
        "--from",
        str(head),
        "--model",
        str(src),
        "--out",
        str(tmp_path / "o"),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert 'method "eagle3"' in result.output
    assert (tmp_path / "o" / "model.safetensors").exists()


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--drafter", "mtp"], "vLLM runs MTP only from the MTP layers built into"),
        (["--drafter", "medusa"], "unknown --drafter 'medusa'"),
        (["--dtype", "int8"], "--dtype must be one of float32, bfloat16, float16"),
        (["--from", "{tmp}/missing"], "is not a directory (train one with specrl train-drafter"),
        (["--from", "{tmp}/proj"], "'proj' layout"),
        (["--from", "{tmp}/proj", "--out", "{tmp}/proj"], "--out must differ from --from"),
        (["--from", "{tmp}/proj", "--out", "{tmp}/file/x"], "cannot use --out:"),
        (["--drafter", "draft", "--from", "{tmp}/proj"], "is not a model vLLM can load"),
    ],
)
def test_cli_errors_are_one_line(app, tmp_path, args, match):
    target = target_of()
    src = model_dir(target, tmp_path / "target")
    save_head(random_head(target, arch="proj"), tmp_path / "proj")
    (tmp_path / "file").write_text("x")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "o")]
    result = CliRunner().invoke(app, ["export-drafter", "--model", str(src), *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], lines
    assert not (tmp_path / "o").exists()


def test_cli_requires_out_and_checks_head_arch(app):
    result = CliRunner().invoke(app, ["export-drafter"])
    assert result.exit_code == 2 and "error: --out is required" in result.output
    for args, match in [
        (["--set", "drafter.head_arch=x"], "bad value for drafter.head_arch"),
        (["--drafter", "mtp", "--set", "drafter.head_arch=eagle3"], "needs drafter.kind='eagle3'"),
    ]:
        result = CliRunner().invoke(app, ["train-drafter", *args])
        assert result.exit_code == 2 and match in result.output, result.output


# ------------------------------------------------------------------------------ vLLM's own class


@pytest.mark.slow
@ON_SERVER_WORKER
def test_vllm_loads_and_runs_the_export(tmp_path):
    """vLLM's own EAGLE-3 classes (CPU) load every parameter from the export, exactly as the
    reader above maps them, and their forward equals specrl's head (one subprocess for the
    three target families)."""
    pytest.importorskip("vllm")
    cases, argv = {}, []
    for family in FAMILIES:
        target, head, out = exported(tmp_path / family, family)
        feats, ids = inputs(target, head)
        io = tmp_path / family / "io"
        io.mkdir()
        embed = target.embed.weight.detach()
        save_file({"feats": feats.contiguous(), "ids": ids, "embed": embed},
                  str(io / "inputs.safetensors"))  # fmt: skip
        argv += [str(model_dir(target, tmp_path / family / "target")), str(out), str(io)]
        cases[family] = (head, out, feats, ids, io)
    script = Path(__file__).with_name("vllm_eagle3_check.py")
    env = os.environ | {"GLOO_SOCKET_IFNAME": "lo", "VLLM_HOST_IP": "127.0.0.1",
                        "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # fmt: skip
    run = subprocess.run([sys.executable, str(script), *argv], env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    for family, (head, out, feats, ids, io) in cases.items():
        _check_vllm_run(family, head, out, feats, ids, io)


def _check_vllm_run(family: str, head: DraftHead, out: Path, feats, ids, io: Path) -> None:
    report = json.loads((io / "outputs.json").read_text())
    got = load_file(str(io / "outputs.safetensors"))
    arch = "Eagle3Qwen3ForCausalLM" if family == "qwen3" else "LlamaForCausalLMEagle3"
    assert report["class"] == arch
    assert report["unset"] == ["model.embed_tokens.weight"]  # shared with the target at runtime
    _, want = vllm_read(out)
    loaded = {k.removeprefix("param."): v for k, v in got.items() if k.startswith("param.")}
    assert set(loaded) - set(want) == {"model.embed_tokens.weight"}, family
    for name, w in want.items():  # vLLM pads the LM head's rows; the rest is exact
        assert torch.equal(loaded[name][: len(w)], w), (family, name)
    with torch.no_grad():
        g, logits = specrl_drafting(head, feats, ids)
    torch.testing.assert_close(got["g"], g, atol=1e-5, rtol=1e-5)
    want_logits = head.to_full(logits).masked_fill(~_in(D2T), float("-inf"))
    torch.testing.assert_close(got["logits"], want_logits, atol=1e-5, rtol=1e-5)
