"""Which head class a drafter kind builds, and building one: fresh, or from a saved directory.

``new_head(target, kind, ...)`` is a ``models.heads.DraftHead`` (eagle3, mtp) or a
``models.block_head.BlockHead`` (block, with its ``geometry``); ``fresh_head`` a seeded random
one as a run trained from nothing starts it; ``load_head`` a saved head read back (verified
against its manifest, checked against the target, rebuilt with the geometry head.json
records). A module of its own so that the head modules import nothing of each other but the
base class.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from specrl.models.block_head import BlockHead
from specrl.models.heads import (
    GEOMETRY,
    HEAD_FILES,
    DraftHead,
    cast_floats,
    check_arch,
    check_compatible,
    notice,
    read_head_config,
    verify_drafter,
)
from specrl.models.transformer import Transformer


def new_head(
    target: Transformer,
    kind: str = "eagle3",
    feature_layers: tuple[int, ...] | None = None,
    draft_vocab: torch.Tensor | None = None,
    arch: str = "proj",
    geometry: dict | None = None,
) -> DraftHead:
    """A head of ``kind`` over ``target``: a ``DraftHead``, or for ``"block"`` a
    ``models.block_head.BlockHead`` built with ``geometry`` (its layers and block size)."""
    if kind == "block":
        check_arch(kind, arch)
        return BlockHead(target, feature_layers, draft_vocab, **(geometry or {}))
    return DraftHead(target, kind, feature_layers, draft_vocab, arch)


def fresh_head(
    target: Transformer, kind: str, seed: int, arch: str = "proj", vocab: int = 0
) -> DraftHead:
    """A random head seeded by ``seed`` (the global RNG left as it was); ``vocab`` in
    (0, V): a draft vocabulary of that size fixed from the start (the first ``vocab`` ids, a
    placeholder until a trainer picks them), else the full vocabulary."""
    d2t = torch.arange(vocab) if 0 < vocab < target.config.vocab_size else None
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return new_head(target, kind, draft_vocab=d2t, arch=arch)


def load_head(
    path: str | Path,
    target: Transformer,
    kind: str | None = None,
    say: Callable[[str], None] | None = None,
) -> DraftHead:
    """Load a saved head onto ``target``: ``DrafterDamaged`` (a ``ValueError``) when a file does
    not match its manifest, ``ValueError`` when it is damaged otherwise or incompatible (json's
    and torch's state-dict mismatches included), ``OSError`` when a file is unreadable,
    safetensors' ``SafetensorError`` when head.safetensors is damaged. A head without a manifest
    (made before checksums) loads, and ``say`` (default ``notice``) gets one line saying so."""
    from safetensors.torch import load_file

    unverified = verify_drafter(path, HEAD_FILES)
    cfg = read_head_config(path)
    check_compatible(cfg, target.config)
    if kind is not None and cfg["kind"] != kind:
        raise ValueError(f"{path} holds a {cfg['kind']!r} head, not {kind!r}")
    state = load_file(str(Path(path) / "head.safetensors"))
    layers, vocab = tuple(cfg["feature_layers"]), state.get("d2t")
    geometry = {k: cfg[k] for k in GEOMETRY if k in cfg}
    head = new_head(target, cfg["kind"], layers, vocab, cfg["arch"], geometry)
    try:
        head.load_state_dict(cast_floats(state, head.dtype))
    except RuntimeError as e:  # missing, unexpected or mis-shaped tensors (several lines)
        why = " ".join(str(e).split())
        raise ValueError(
            f"{path}/head.safetensors does not fit a {cfg['kind']} head: {why}"
        ) from None
    if unverified is not None:
        (say or notice)(unverified)
    return head.eval()
