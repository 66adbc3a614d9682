"""Distilling a small draft model (a layer prefix of the target) on the target's distributions.

``init_draft(target, num_layers)`` copies the target's embedding, first layers, final norm and
LM head in fp32 (``untrained_draft(policy, dtype)``: the one a run without a draft model starts
from, the same for the engine that drafts with it and the trainer that trains it);
``distill(draft, target, examples, cfg, out=None)`` minimises the forward KL(target || draft)
on completion positions, training only the draft's layers and final norm
(the loop is ``drafters.train.fit``: resumable, same losses), and returns the per-step losses;
``save_draft_model`` writes a Hugging Face style directory that ``load_model`` reads as is,
plus ``distill.json``, each file atomically and a ``manifest.json`` (size and sha256 of each)
last (loaders check it: ``models.heads.verify_drafter``). Details: docs/internals.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from specrl.drafters.data import Example
from specrl.drafters.train import STATE_FILE, TrainConfig, fit
from specrl.fsutil import atomic_write, atomic_writer, write_manifest
from specrl.models.config import ModelConfig
from specrl.models.device import model_device, on
from specrl.models.heads import CHECKSUMS, MODEL_FILES
from specrl.models.linear import Linear
from specrl.models.transformer import Transformer, layer_prefix_model

# 4 of SmolLM2-135M's 30 layers: a decode step costs ~0.2-0.25 of the target's (the tied
# 49k-row LM head is a fixed ~0.1; each layer adds ~0.03), see docs/drafters.md.
DEFAULT_LAYERS = 4
FORMAT = "specrl-distilled-draft"
VERSION = 1
SPEC_FILE = "distill.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def init_draft(target: Transformer, num_layers: int = DEFAULT_LAYERS) -> Transformer:
    """fp32 draft model: the target's embedding, first ``num_layers`` layers, norm and LM head."""
    top = target.config.num_layers
    if not 1 <= num_layers <= top:
        raise ValueError(
            f"draft layers must be in [1, {top}] (the target's layer count), got {num_layers}"
        )
    device = target.embed.weight.device  # where the target (the policy) is
    return layer_prefix_model(target, num_layers).to(device=device, dtype=torch.float32)


def untrained_draft(policy: Transformer, dtype: torch.dtype) -> Transformer:
    """The draft model a run without one starts from and trains: the policy's embedding, first
    ``DEFAULT_LAYERS`` layers (at most half of its layers, at least one), final norm and LM
    head (a copy), in ``dtype``."""
    layers = max(1, min(DEFAULT_LAYERS, policy.config.num_layers // 2))
    return init_draft(policy, layers).to(dtype)


def set_trainable(draft: Transformer) -> None:
    """Layers and final norm train; the embedding and LM head (tied: the target's) stay frozen."""
    draft.requires_grad_(True)
    draft.embed.requires_grad_(False)
    draft.lm_head.requires_grad_(False)


def collate_tokens(
    examples: list[Example], max_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded batch: tokens [B, T], target final hidden [B, T, H] (at the same position), mask
    [B, T] (the position predicts a completion token; padding and prompt positions excluded)."""
    lens = [min(len(e.tokens), max_len) for e in examples]
    b, t = len(examples), max(lens)
    final = examples[0].final.new_zeros(b, t, examples[0].final.shape[-1])  # on its device
    tokens = torch.zeros(b, t, dtype=torch.int64, device=final.device)
    mask = torch.zeros(b, t, dtype=torch.bool, device=final.device)
    for i, (e, n) in enumerate(zip(examples, lens, strict=True)):
        tokens[i, :n] = e.tokens[:n]
        final[i, :n] = e.final[:n]
        mask[i, max(e.prompt_len - 1, 0) : n - 1] = True
    return tokens, final, mask


def distill_loss(
    draft: Transformer,
    target_lm: Linear,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """Mean KL(target || draft) over the masked positions of ``batch`` (``collate_tokens``)."""
    tokens, final, mask = on(model_device(draft), *batch)  # examples may sit elsewhere
    b, t = tokens.shape
    positions = torch.arange(t, device=tokens.device).expand(b, t)
    h, _ = draft.hidden_states(tokens, positions)  # [B, T, H]
    with torch.no_grad():
        logits = target_lm(final[mask].to(target_lm.weight.dtype))  # [N, V]
        target_lp = F.log_softmax(logits.float(), -1)  # [N, V]
    lp = F.log_softmax(draft.lm_head(h[mask]).float(), -1)  # [N, V]
    return (target_lp.exp() * (target_lp - lp)).sum(-1).mean()


def distill(
    draft: Transformer,
    target: Transformer,
    examples: list[Example],
    cfg: TrainConfig,
    out: str | Path | None = None,
    tokenizer_dir: str | Path | None = None,
    progress: bool = True,
) -> list[float]:
    """Distill ``target`` into ``draft`` in place (see docs/internals.md)."""
    set_trainable(draft)
    state_path = Path(out) / STATE_FILE if out is not None else None

    def loss_fn(batch: list[Example]) -> torch.Tensor:
        return distill_loss(draft, target.lm_head, collate_tokens(batch, cfg.max_len))

    losses = fit(draft, examples, cfg, loss_fn, state_path, progress)
    if out is not None:
        extra = {"train": vars(cfg), "final_loss": losses[-1:]}
        save_draft_model(draft, out, target.config, tokenizer_dir, extra)
    return losses


def save_draft_model(
    draft: Transformer,
    out: str | Path,
    target_config: ModelConfig,
    tokenizer_dir: str | Path | None = None,
    extra: dict | None = None,
) -> Path:
    """Write the model directory described in docs/internals.md; returns it."""
    from safetensors.torch import save_file

    from specrl.models.checkpoints import hf_state_dict

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.float() for k, v in hf_state_dict(draft).items()}
    with atomic_writer(out / "model.safetensors") as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    atomic_write(out / "config.json", json.dumps(draft.config.to_hf_dict(), indent=1))
    names = [*MODEL_FILES]
    for name in TOKENIZER_FILES if tokenizer_dir is not None else ():
        src = Path(tokenizer_dir) / name
        if src.exists():
            atomic_write(out / name, src.read_bytes())
            names.append(name)
    n = draft.config.num_layers
    spec = {
        "format": FORMAT,
        "version": VERSION,
        CHECKSUMS: True,
        "num_layers": n,
        "init": f"target embedding, layers 0..{n - 1}, final norm, LM head",
        "trained": ["layers", "norm"],
        "target": target_config.to_hf_dict(),
        "extra": extra or {},
    }
    atomic_write(out / SPEC_FILE, json.dumps(spec, indent=1))
    write_manifest(out, [*names, SPEC_FILE])
    return out
