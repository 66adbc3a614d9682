"""``write_upcycled``: a dense model's sparse upcycling written as a Hugging Face model directory.

Contract: ``write_upcycled(model, out, experts, top_k, seed, router_std, dtype)`` checks OUT
(absent or empty, writable, room for the weights) and the MoE shape before any work, builds the
MoE with ``models.upcycle.upcycle`` (the dense model read in float32) and writes OUT atomically
as ``pipelines.export`` writes an export: config.json of the MoE family (Mixtral, Qwen2-MoE or
Qwen3-MoE), generation_config.json and the tokenizer of the dense model, and the weights in
``dtype`` under Hugging Face's per-expert names, so that transformers, vLLM and ``specrl train
--set model.name=OUT`` load it. Returns OUT.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from specrl.models import checkpoints
from specrl.models.checkpoints import hf_state_dict, load_config, resolve_model
from specrl.models.upcycle import upcycle, upcycled_config
from specrl.pipelines.export import (
    ModelExportError,
    check_out,
    check_room,
    generation_config,
    staged_dir,
    write_model_files,
)


def write_upcycled(
    model: str | os.PathLike,
    out: str | os.PathLike,
    experts: int,
    top_k: int,
    seed: int = 0,
    router_std: float = 0.02,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``model`` upcycled to ``experts`` experts as the model directory ``out``."""
    out = Path(out)
    check_out(out)
    model_dir = resolve_model(model)
    try:
        config = upcycled_config(load_config(model_dir), experts, top_k)
    except ValueError as e:
        raise ModelExportError(str(e)) from None
    moe = upcycle(checkpoints.load_model(model_dir), experts, top_k, seed, router_std)
    tensors = {k: v.to(dtype) for k, v in hf_state_dict(moe).items()}
    check_room(out, tensors)
    with staged_dir(out) as tmp:
        write_model_files(tmp, config, tensors, model_dir, generation_config(model_dir, config))
    return out
