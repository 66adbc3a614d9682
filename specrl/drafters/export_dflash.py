"""Exporting a block head to the layout vLLM's ``dflash`` method loads (``DFlashDraftModel``).

``export_dflash(head_dir, target, out_dir, dtype=None)`` writes ``config.json`` +
``model.safetensors`` + ``manifest.json`` (as ``drafters.export``'s other exports: verified
input, a hidden directory moved into place) from a ``block`` head: a Qwen3 config of the head's
layers with ``architectures = ["DFlashDraftModel"]`` and ``dflash_config`` = {``mask_token_id``,
``target_layer_ids``: the target layers whose outputs it reads, 0-based}, and the tensors under
vLLM's names (``fc``, ``hidden_norm``, ``norm``, ``layers.N.*``; the LM head over the draft
vocabulary with ``d2t`` offsets when the head has a reduced one; the embedding is the
target's). vLLM then serves it with ``speculative_config = {"method": "dflash", "model": OUT,
"num_speculative_tokens": k}`` (k up to the head's ``block_size``). ``dflash_tensors`` is the
name mapping (tested against the head's own forward). Details: docs/internals.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from specrl.drafters.export import (
    LAYER_NAMES,
    ExportError,
    Say,
    draft_lm_head,
    head_inputs,
    verified,
    write_export,
)
from specrl.models.checkpoints import split_sizes
from specrl.models.config import ModelConfig
from specrl.models.heads import HEAD_FILES, notice, read_head_config

FORMAT = "specrl-vllm-dflash"
VERSION = 1
TOP_NAMES = (("fc.weight", ("fc.weight",)), ("hnorm.weight", ("hidden_norm.weight",)),
             ("norm.weight", ("norm.weight",)))  # fmt: skip


def export_dflash(
    head_dir: str | os.PathLike,
    target,  # a Transformer, or the target's name / directory
    out_dir: str | os.PathLike,
    dtype: torch.dtype | None = None,
    say: Say = notice,
) -> Path:
    """See the module docstring; ``ExportError`` (one line) for a head that is not a block
    head of this target or whose files do not match their manifest."""
    head_dir, out = Path(head_dir), Path(out_dir)
    unverified = verified(head_dir, HEAD_FILES)
    try:
        cfg = read_head_config(head_dir)
    except (OSError, ValueError) as e:
        raise ExportError(f"cannot read the head in {head_dir}: {e}") from None
    if cfg.get("kind") != "block":
        raise ExportError(f"{head_dir} holds a {cfg.get('kind')!r} head; vLLM's dflash method "
                          "serves a block head (specrl train-drafter --drafter block)")  # fmt: skip
    tcfg, lm_head, state, d2t = head_inputs(head_dir, cfg, target)  # lm_head [V, H]
    layers = int(cfg.get("layers", 0))
    tensors = dflash_tensors(state, tcfg, layers, lm_head, d2t)
    config = dflash_config(tcfg, cfg, len(tensors["lm_head.weight"]))
    record = {"format": FORMAT, "version": VERSION, "source": str(head_dir.resolve()),
              "kind": "block", "feature_layers": cfg["feature_layers"]}  # fmt: skip
    write_export(out, tensors, config, record, dtype or state["norm.weight"].dtype)
    if unverified is not None:
        say(unverified)
    return out


def dflash_tensors(
    state: dict[str, torch.Tensor],
    target: ModelConfig,
    layers: int,
    lm_head: torch.Tensor,  # [V, H] the target's LM head
    d2t: torch.Tensor | None,  # [Vd] sorted target ids, or None (full vocabulary)
) -> dict[str, torch.Tensor]:
    """vLLM DFlash tensors from a block head's state dict (without ``d2t``): every tensor of
    the head placed (``ExportError`` for one with no place or a missing one)."""
    names = dict(TOP_NAMES)
    for i in range(layers):
        names |= {f"layers.{i}.{ours}": tuple(f"layers.{i}.{t}" for t in theirs)
                  for ours, theirs in LAYER_NAMES}  # fmt: skip
    extra = sorted(set(state) - set(names))
    if extra:
        raise ExportError(f"head tensor {extra[0]} has no place in vLLM's DFlash layout")
    out: dict[str, torch.Tensor] = {}
    for ours, theirs in names.items():
        if ours not in state:
            if "bias" in ours:
                continue
            raise ExportError(f"the head lacks {ours} (vLLM's {theirs[0]})")
        t = state[ours]
        sizes = [len(t)] if len(theirs) == 1 else split_sizes(target, list(theirs), len(t))
        if sum(sizes) != len(t):
            raise ExportError(f"head tensor {ours} has shape {tuple(t.shape)}: not this target's")
        out |= {n: p.contiguous() for n, p in zip(theirs, t.split(sizes), strict=True)}
    return out | draft_lm_head(lm_head, d2t)


def dflash_config(target: ModelConfig, head: dict, draft_vocab: int) -> dict:
    """config.json of the exported block head: the target's shapes as a Qwen3 model of the
    head's layers, and what vLLM's DFlash reads besides."""
    config = target.replace(num_layers=int(head["layers"]), qk_norm=True).to_hf_dict()
    config |= {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "tie_word_embeddings": False,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": target.hidden_size,
        "block_size": int(head["block_size"]) + 1,  # the last token and the mask slots
        "dflash_config": {"mask_token_id": int(head["mask_token"]),
                          "target_layer_ids": [int(x) for x in head["feature_layers"]]},
    }  # fmt: skip
    return config


def is_dflash_export(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a drafter in vLLM's DFlash layout (config.json naming a DFlash
    architecture)."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    arch = cfg.get("architectures") if isinstance(cfg, dict) else None
    return isinstance(arch, list) and any("dflash" in str(a).lower() for a in arch)
