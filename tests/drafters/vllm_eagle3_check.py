"""Load an exported EAGLE-3 drafter with vLLM's own model class and run its forward (CPU).

Run by tests/drafters/test_export.py in a subprocess (vLLM's process-wide distributed state
stays out of the test process), for one or more exports:
``python vllm_eagle3_check.py TARGET_DIR DRAFT_DIR IO_DIR [TARGET_DIR DRAFT_DIR IO_DIR ...]``.
For each, reads ``IO_DIR/inputs.safetensors`` (feats [T, n*H] target features, ids [T+1] the
tokens x_{i+1} of positions 0..T (the last one is a drafted token), embed [V, H] the target's
embedding) and writes ``IO_DIR/outputs.safetensors``: ``param.<vLLM name>`` (each parameter as
loaded, before post-processing), ``g`` [T+1, H] and ``logits`` [T+1, V] of vLLM's draft model
where position T is fed back its own pre-norm output of position T-1 (as vLLM's proposer does),
and ``IO_DIR/outputs.json``: {"class", "unset": parameters load_weights did not write}.
Paged attention is replaced by plain causal attention over the T+1 tokens (what the KV cache
holds while drafting); everything else is vLLM's code.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file


class CausalAttention(torch.nn.Module):
    """Stand-in for vLLM's ``Attention``: q [T, heads*D], k/v [T, kv*D] -> [T, heads*D]."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.scale = heads, kv_heads, head_dim, scale

    def forward(self, q, k, v, *args, **kwargs):
        t, d = q.shape[0], self.head_dim
        q = q.view(t, self.heads, d).transpose(0, 1)[None]
        k = k.view(t, self.kv_heads, d).transpose(0, 1)[None]
        v = v.view(t, self.kv_heads, d).transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True, scale=self.scale
        )
        return out[0].transpose(0, 1).reshape(t, -1)


def build(target_dir: str, draft_dir: str, init: str):
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.registry import ModelRegistry

    mc = ModelConfig(
        model=target_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=64,
        enforce_eager=True,
    )  # fmt: skip
    sc = SpeculativeConfig(
        method="eagle3", model=draft_dir, num_speculative_tokens=2, target_model_config=mc,
        target_parallel_config=ParallelConfig(),
    )  # fmt: skip
    vc = VllmConfig(model_config=mc, speculative_config=sc, device_config=DeviceConfig("cpu"))
    dc = sc.draft_model_config
    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"file://{init}",
        )  # fmt: skip
        ensure_model_parallel_initialized(1, 1)
        cls, arch = ModelRegistry.resolve_model_cls(dc.architectures, dc)
        model = cls(vllm_config=vc)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan") if p.is_floating_point() else -7)
        model.load_weights(load_file(str(Path(draft_dir) / "model.safetensors")).items())
        loaded = {k: v.detach().clone() for k, v in model.named_parameters()}
        process_weights_after_loading(model, dc, torch.device("cpu"))
    return model, arch, loaded


def check(target_dir: str, draft_dir: str, io_dir: str, init: str) -> None:
    io = Path(io_dir)
    inp = load_file(str(io / "inputs.safetensors"))
    model, arch, loaded = build(target_dir, draft_dir, init)
    unset = [
        k for k, v in loaded.items() if (v.isnan() if v.is_floating_point() else v == -7).any()
    ]
    attn = model.model.layers[0].self_attn
    attn.attn = CausalAttention(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scaling)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(inp["embed"])  # vLLM shares the target's
        t = inp["feats"].shape[0]
        h = model.combine_hidden_states(inp["feats"])  # [T, H]
        _, pre = model(inp["ids"][:t], torch.arange(t), h)  # [T, H] pre-norm outputs
        h = torch.cat([h, pre[-1:]])  # position T reads its own output of T-1
        normed, pre = model(inp["ids"], torch.arange(t + 1), h)
        logits = model.compute_logits(normed)  # [T+1, V]
    out = {f"param.{k}": v.contiguous() for k, v in loaded.items()}
    save_file(out | {"g": pre.contiguous(), "logits": logits.contiguous()},
              str(io / "outputs.safetensors"))  # fmt: skip
    (io / "outputs.json").write_text(json.dumps({"class": arch, "unset": unset}))


if __name__ == "__main__":
    args = sys.argv[1:]
    for i in range(0, len(args), 3):  # the process group is made once, by the first
        check(*args[i : i + 3], init=str(Path(args[2]) / "dist-init"))
