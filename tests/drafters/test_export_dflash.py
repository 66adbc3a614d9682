"""A block head exported to vLLM's DFlash layout: exactly the tensors and config vLLM's
``DFlashQwen3ForCausalLM`` reads, and a plain-torch forward of that model from the exported
tensors (context keys/values from fc -> hidden_norm -> each layer's K/V projection, k-norm and
RoPE; the block [last token, masks] through the layers, non-causal) equal to the head's own
drafting logits; refusals in one line."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
import typer
from safetensors.torch import load_file
from typer.testing import CliRunner

from specrl.cli_export import register as register_export
from specrl.drafters.export import ExportError
from specrl.drafters.export_dflash import export_dflash, is_dflash_export
from specrl.models.head_kinds import new_head
from specrl.models.heads import save_head
from tests.conftest import ON_SERVER_WORKER, make_tiny
from tests.drafters.test_export import (
    D2T,
    FAMILIES,
    L,
    V,
    model_dir,
    random_head,
    rms,
    rope,
)

torch.set_num_threads(1)
# vLLM's CPU attention takes head_dim 32, 64, 80, 96, 112, 128, 256 (not the tiny model's 8)
VLLM_SHAPE = dict(hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=1,
                  head_dim=64, max_position_embeddings=512)  # fmt: skip


def block_head(target, d2t=D2T, layers: int = 2):
    torch.manual_seed(5)
    head = new_head(target, "block", draft_vocab=d2t, geometry={"layers": layers,
                                                               "block_size": 4})  # fmt: skip
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return head.eval()


def exported(tmp_path, family: str = "llama", d2t=D2T, layers: int = 2, **shape):
    target = make_tiny(seed=1, **({"num_layers": L, "vocab_size": V} | FAMILIES[family] | shape))
    head = block_head(target, d2t, layers)
    out = export_dflash(save_head(head, tmp_path / "head"), target, tmp_path / "dflash")
    return target, head, out


def expected_names(layers: int, reduced: bool, bias: bool) -> set[str]:
    per = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.o_proj.weight",
        *(f"self_attn.{p}_proj.weight" for p in "qkv"),
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    ]
    per += [f"self_attn.{p}_proj.bias" for p in "qkv"] if bias else []
    names = {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight"}
    names |= {f"layers.{i}.{n}" for i in range(layers) for n in per}
    return names | ({"d2t"} if reduced else set())  # fmt: skip


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("reduced", [True, False], ids=["d2t", "full-vocab"])
def test_export_has_the_tensors_and_config_vllm_reads(tmp_path, family, reduced):
    target, head, out = exported(tmp_path, family, D2T if reduced else None)
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == expected_names(2, reduced, target.config.attention_bias)
    c = target.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    assert tensors["fc.weight"].shape == (c.hidden_size, 3 * c.hidden_size)
    assert tensors["layers.1.self_attn.q_proj.weight"].shape == (q, c.hidden_size)
    assert tensors["layers.1.self_attn.k_proj.weight"].shape == (kv, c.hidden_size)
    assert tensors["lm_head.weight"].shape == (len(D2T) if reduced else V, c.hidden_size)
    if reduced:  # offsets: target id = i + d2t[i]
        assert torch.equal(tensors["d2t"] + torch.arange(len(D2T)), D2T)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["num_hidden_layers"] == 2 and config["vocab_size"] == V
    assert config["dflash_config"] == {"mask_token_id": V - 1,
                                       "target_layer_ids": list(head.feature_layers)}  # fmt: skip
    assert is_dflash_export(out) and not is_dflash_export(tmp_path / "head")


def dflash_forward(config: dict, p: dict, feats, last: int, k: int, embed) -> torch.Tensor:
    """vLLM's DFlash draft on one sequence, written from its code: context c = hidden_norm(fc(
    feats)) [T, H] gives each layer's K/V (k-norm, RoPE at 0..T-1); the block [last, mask x k]
    at positions T..T+k runs through the layers over the context's and its own keys, non-causal;
    logits [k, V] of the mask slots (-inf off the draft vocabulary)."""
    eps, d = config["rms_norm_eps"], config["head_dim"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    theta, t = config["rope_theta"], feats.shape[0]
    c = rms(F.linear(feats, p["fc.weight"]), p["hidden_norm.weight"], eps)
    ids = torch.tensor([last] + [config["dflash_config"]["mask_token_id"]] * k)
    x = embed[ids]
    for i in range(config["num_hidden_layers"]):
        m = f"layers.{i}."

        def proj(h, name, m=m):
            return F.linear(h, p[m + f"self_attn.{name}_proj.weight"],
                            p.get(m + f"self_attn.{name}_proj.bias"))  # fmt: skip

        def keys(h, m=m):
            return rms(proj(h, "k").view(-1, kv, d), p[m + "self_attn.k_norm.weight"], eps)

        ctx_k, ctx_v = rope(keys(c), theta), proj(c, "v").view(-1, kv, d)
        a = rms(x, p[m + "input_layernorm.weight"], eps)
        q = rms(proj(a, "q").view(-1, heads, d), p[m + "self_attn.q_norm.weight"], eps)
        shift = torch.zeros(t, 1, d)  # the block's positions follow the context's
        q = rope(torch.cat([shift.expand(t, heads, d), q]), theta)[t:]
        bk = rope(torch.cat([shift.expand(t, kv, d), keys(a)]), theta)[t:]
        ks = torch.cat([ctx_k, bk]).repeat_interleave(heads // kv, 1)
        vs = torch.cat([ctx_v, proj(a, "v").view(-1, kv, d)]).repeat_interleave(heads // kv, 1)
        scores = torch.einsum("thd,shd->hts", q, ks) / d**0.5  # every key: non-causal
        att = torch.einsum("hts,shd->thd", scores.softmax(-1), vs).reshape(k + 1, -1)
        x = x + F.linear(att, p[m + "self_attn.o_proj.weight"])
        h = rms(x, p[m + "post_attention_layernorm.weight"], eps)
        x = x + F.linear(
            F.silu(F.linear(h, p[m + "mlp.gate_proj.weight"]))
            * F.linear(h, p[m + "mlp.up_proj.weight"]),
            p[m + "mlp.down_proj.weight"],
        )
    logits = rms(x[1:], p["norm.weight"], eps) @ p["lm_head.weight"].T  # [k, Vd]
    if "d2t" not in p:
        return logits
    full = logits.new_full((k, config["vocab_size"]), float("-inf"))
    full[:, torch.arange(len(p["d2t"])) + p["d2t"]] = logits
    return full


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("reduced", [True, False], ids=["d2t", "full-vocab"])
def test_exported_forward_equals_the_heads_drafting(tmp_path, family, reduced):
    target, head, out = exported(tmp_path, family, D2T if reduced else None)
    config = json.loads((out / "config.json").read_text())
    p = {
        n: t.float() if t.is_floating_point() else t
        for n, t in load_file(str(out / "model.safetensors")).items()
    }
    torch.manual_seed(0)
    t, k = 6, 4
    ids = torch.randint(0, V, (1, t + 1))
    with torch.no_grad():
        cap = target(ids, torch.arange(t + 1)[None], capture=head.feature_layers).captured
        feats = torch.cat(cap, -1)[0, :t]  # features of positions 0..t-1; the last token: ids[t]
        cache = head.new_cache(1, 16)
        zero = torch.zeros(1, dtype=torch.long)
        head.step(head.features_in(feats[None]), ids[:, 1:], torch.arange(t)[None], cache,
                  torch.zeros(1, t, dtype=torch.long), zero, t)  # fmt: skip
        g = head.block(ids[:, t:], t + torch.arange(k + 1)[None], cache, zero, t + k + 1)
        ours = head.to_full(torch.softmax(head.logits(g[0, 1:]).float(), -1))
        theirs = dflash_forward(config, p, feats, int(ids[0, t]), k, target.embed.weight)
    torch.testing.assert_close(torch.softmax(theirs, -1), ours, atol=1e-5, rtol=1e-4)


def test_refusals_are_one_line(tmp_path):
    target = make_tiny(seed=1, num_layers=L, vocab_size=V)
    eagle = save_head(random_head(target), tmp_path / "eagle")
    with pytest.raises(ExportError, match="holds a 'eagle3' head; vLLM's dflash method serves"):
        export_dflash(eagle, target, tmp_path / "out")
    other = make_tiny(seed=1, num_layers=L + 2, vocab_size=V)
    with pytest.raises(ExportError, match="layer count 10, but the target has 8"):
        export_dflash(save_head(block_head(other), tmp_path / "b"), target, tmp_path / "out2")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()
    app = typer.Typer()
    register_export(app)
    result = CliRunner().invoke(
        app,
        [
            "export-drafter",
            "--drafter",
            "block",
            "--from",
            str(tmp_path / "none"),
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert result.exit_code == 2 and "is not a directory" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.slow
@ON_SERVER_WORKER
def test_vllm_serves_the_export_losslessly(tmp_path, monkeypatch):
    """vLLM (CPU, fp32, eager) serves the export with its ``dflash`` method: it drafts (its
    counters), and its greedy tokens equal specrl's plain greedy decoding of the target."""
    from specrl.backends.vllm import ENV_DEFAULTS, vllm_available
    from specrl.backends.vllm_requests import read_counters
    from specrl.backends.vllm_worker import patch_vllm, process_state_kept
    from tests.pipelines.test_export_model import specrl_greedy

    if not vllm_available():
        pytest.skip("vllm is not installed (specrl[vllm])")
    target, head, out = exported(tmp_path, "llama", None, layers=2, **VLLM_SHAPE)
    served = model_dir(target, tmp_path / "target")
    for key, value in ENV_DEFAULTS.items() | {("VLLM_CPU_KVCACHE_SPACE", "1")}:
        if key not in os.environ:
            monkeypatch.setenv(key, value)
    patch_vllm()
    from vllm import LLM, SamplingParams

    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 7, 8, 9, 7], [10, 11, 12, 13]]
    spec = {"method": "dflash", "model": str(out), "num_speculative_tokens": 3,
            "draft_sample_method": "probabilistic"}  # fmt: skip
    with process_state_kept():
        llm = LLM(model=str(served), dtype="float32", enforce_eager=True, seed=0,
                  max_model_len=128, max_num_seqs=4, skip_tokenizer_init=True,
                  speculative_config=spec, disable_log_stats=False)  # fmt: skip
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        counters = read_counters(llm, llm.llm_engine.model_config.served_model_name)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    assert counters.drafts > 0
    for prompt, got in zip(prompts, outs, strict=True):
        assert list(got.outputs[0].token_ids) == specrl_greedy(target, prompt, 12)[0], prompt
