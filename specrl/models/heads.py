"""Learned draft heads that read the target's hidden states: EAGLE-3 and MTP (and the base of
the block head, ``models.block_head``).

A ``DraftHead`` is one decoder layer over a frozen target ``Transformer`` whose embedding and LM
head it shares (not in its state dict): position i reads a feature h_i and the embedding of
x_{i+1}, and its logits predict x_{i+2}; drafting feeds its own output back. Kinds ``eagle3``
(fc over several target layers) and ``mtp`` (the last layer); layouts ``arch="proj"`` (default)
and ``"eagle3"`` (vLLM's). An optional reduced draft vocabulary (``d2t``) predicts over Vd
tokens. ``save_head`` / ``models.head_kinds.load_head`` keep a head directory (head.json records
a block head's ``GEOMETRY``); ``check_compatible`` refuses a head of another target; the loss
sees a head through ``depth_outputs``. Details (the layer's equations, the format):
docs/internals.md.

Saved drafters (a head here, a draft model in ``drafters.distill``, a vLLM-layout export in
``drafters.export``) carry a ``manifest.json`` (``fsutil.write_manifest``: size and sha256 of
each file, written last), as run checkpoints do. ``verify_drafter(path, required)`` checks one
before it is read: a file that does not match is ``DrafterDamaged`` naming it
(``DIR/head.safetensors: sha256 mismatch``); a directory specrl wrote before drafters had
manifests passes with the line ``notice`` prints (``notice: DIR has no manifest.json (made
before checksums); its files are not verified``), one whose own record says it was written with
one (``"checksums": true``) and lacks it is damaged; a foreign one (no specrl record) passes
silently. ``load_head`` verifies, and prints the notice once the head has loaded.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from specrl.fsutil import (
    MANIFEST,
    atomic_write,
    atomic_writer,
    listed_problem,
    read_manifest,
    write_manifest,
)
from specrl.models.cache import KVCache
from specrl.models.config import ModelConfig
from specrl.models.fused import run_layers
from specrl.models.transformer import (
    AttnContext,
    Block,
    Linear,
    RMSNorm,
    Static,
    Transformer,
    cache_mask,
)

KINDS = ("eagle3", "mtp", "block")  # block: models.block_head (k drafts in one forward)
ARCHS = ("proj", "eagle3")  # the head layer's layout (docs/internals.md)
FORMAT = "specrl-draft-head"
VERSION = 1
HEAD_FILES = ("head.safetensors", "head.json")  # what ``load_head`` reads; the manifest lists both
MODEL_FILES = ("model.safetensors", "config.json")  # of a draft model or a vLLM-layout export
GEOMETRY = ("layers", "block_size", "mask_token")  # head.json keys of a block head's shape
CHECKSUMS = "checksums"  # a drafter record's key: true when a manifest.json was written with it


def default_layers(kind: str, num_layers: int) -> tuple[int, ...]:
    """Target layers a head reads: EAGLE-3 and block (1, L//2-1, L-4) clamped and deduplicated;
    MTP (L-1,)."""
    top = num_layers - 1
    if kind == "mtp":
        return (top,)
    if kind not in KINDS:
        raise ValueError(f"unknown head kind {kind!r}; known: {KINDS}")
    picks = (1, num_layers // 2 - 1, num_layers - 4)
    return tuple(sorted({min(max(p, 0), top) for p in picks}))


class DraftHead(nn.Module):
    """EAGLE-3 / MTP head (see docs/internals.md). ``target`` is held, not registered."""

    decay = 0.8  # the loss weight's decay over draft depths (decay**j; a block head's too:
    # 0.6 measured no better, docs/drafters.md)

    def __init__(
        self,
        target: Transformer,
        kind: str = "eagle3",
        feature_layers: tuple[int, ...] | None = None,
        draft_vocab: torch.Tensor | None = None,  # [Vd] sorted target ids; None = full vocab
        arch: str = "proj",
    ) -> None:
        super().__init__()
        c = target.config
        layers = tuple(feature_layers or default_layers(kind, c.num_layers))
        if list(layers) != sorted(set(layers)) or not all(0 <= x < c.num_layers for x in layers):
            raise ValueError(f"feature_layers must be distinct, sorted, in [0, {c.num_layers})")
        check_arch(kind, arch)
        self.kind, self.arch, self.feature_layers, self.target_config = kind, arch, layers, c
        self.head_config = c.replace(num_layers=1)
        h = c.hidden_size
        self.fc = Linear(len(layers) * h, h, bias=False) if kind != "mtp" else None
        self.hnorm = RMSNorm(h, c.rms_norm_eps)
        self.enorm = RMSNorm(h, c.rms_norm_eps)
        self.proj = Linear(2 * h, h, bias=False) if arch == "proj" else None
        self.block = Block(self.head_config, 0)
        if arch == "eagle3":  # attention reads the 2H concat directly; no pre-attention norm
            qkv = self.block.attn.qkv
            self.block.attn.qkv = Linear(2 * h, qkv.out_features, bias=qkv.bias is not None)
            self.block.attn_norm = None
        self.norm = RMSNorm(h, c.rms_norm_eps)
        self._target = (target,)  # a tuple: not a submodule, so not in state_dict / parameters
        vocab = None if draft_vocab is None else _check_vocab(draft_vocab, c.vocab_size)
        self.register_buffer("d2t", vocab)  # [Vd] int64, or None (full vocabulary)
        self._lm: tuple[Linear, tuple] | None = None  # reduced LM head, cache key
        self.to(device=target.embed.weight.device, dtype=target.embed.weight.dtype)

    @property
    def target(self) -> Transformer:
        return self._target[0]

    def use_target(self, target: Transformer) -> None:
        """Read the embedding and LM head of ``target`` from now on (held, not registered:
        a drafter shares the live target's, whatever model the head was loaded against)."""
        self._target = (target,)

    def features_in(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features [..., len(layers)*H] -> head input [..., H]."""
        return self.fc(feats) if self.fc is not None else feats

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the head's weights."""
        return self.norm.weight.dtype

    def inputs(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """From head inputs h [B, T, H] and the next tokens [B, T]: ``proj``: u [B, T, H];
        ``eagle3``: z [B, T, 2H] = cat(enorm(e), hnorm(h)) (docs/internals.md)."""
        e = self.target.embed(tokens).to(h.dtype)
        if self.proj is None:
            return torch.cat([self.enorm(e), self.hnorm(h)], dim=-1)
        return self.proj(torch.cat([self.hnorm(h), self.enorm(e)], dim=-1))

    def attention_in(
        self, h: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input [B, T, H] (``proj``) or [B, T, 2H] (``eagle3``), residual [B, T, H])
        of the head layer for head inputs h [B, T, H] and the next tokens [B, T]."""
        x = self.inputs(h, tokens)
        if self.proj is None:
            return x, h
        return self.block.attn_norm(x), x

    def layer(self, h, tokens, cos, sin, ctx: AttnContext) -> torch.Tensor:
        """The head's decoder layer: g [B, T, H] (``Block.forward``'s ops, in its order; a
        ``proj`` head's layer is a plain ``Block``, in one native call where that applies)."""
        blk = self.block
        if self.proj is not None and self.target.native_layers:
            u = self.inputs(h, tokens)
            if run_layers((blk,), self.norm, self.head_config, u, cos, sin, ctx) is not None:
                return u  # the layer's output, left in its input
        a, x = self.attention_in(h, tokens)
        x, m = blk.mlp_norm.add_norm(x, blk.attn(a, cos, sin, ctx))
        return x + blk.mlp(m)

    def set_draft_vocab(self, ids: torch.Tensor | None) -> None:
        """Use draft vocabulary ``ids`` ([Vd] sorted target ids; None = the full vocabulary)
        from now on (a head started from scratch picks it once it has seen rollouts)."""
        vocab = None if ids is None else _check_vocab(ids, self.target_config.vocab_size)
        if vocab is not None:
            vocab = vocab.to(self.norm.weight.device)  # indexed by drafts made on the device
        self.d2t, self._lm = vocab, None

    @property
    def draft_vocab_size(self) -> int:
        return self.target_config.vocab_size if self.d2t is None else len(self.d2t)

    def lm_head(self) -> Linear:
        """The target's LM head, or its rows ``d2t``: a copy refreshed when the target changes,
        in place while its shape holds (a captured drafting step reads its storage)."""
        lm = self.target.lm_head
        if self.d2t is None:
            return lm
        w = lm.weight
        key = (w.data_ptr(), w._version, w.dtype, self.d2t.data_ptr(), self.d2t._version)
        if self._lm is None or self._lm[1] != key:
            # a normal tensor even in inference mode: usable in training, has a version counter
            with torch.inference_mode(False), torch.no_grad():
                weight = w.detach().index_select(0, self.d2t.clone())
                rows = None if self._lm is None else self._lm[0]
                if rows is not None and _same_kind(rows.weight, weight):
                    rows.weight.copy_(weight)
                else:
                    rows = Linear(w.shape[1], len(self.d2t), bias=False, device="meta")
                    rows.weight = nn.Parameter(weight, requires_grad=False)
            self._lm = (rows, key)
        return self._lm[0]

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """Logits [..., Vd] from head outputs g [..., H] (Vd = V without a reduced vocab)."""
        lm = self.lm_head()
        return lm(self.norm(g).to(lm.weight.dtype))

    def to_target(self, idx: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices (any shape) -> target token ids."""
        return idx if self.d2t is None else self.d2t[idx]

    def to_full(self, probs: torch.Tensor) -> torch.Tensor:
        """A draft distribution [N, Vd] -> the same distribution over the target vocab [N, V]."""
        if self.d2t is None:
            return probs
        full = probs.new_zeros(probs.shape[0], self.target_config.vocab_size)
        return full.index_copy_(1, self.d2t, probs)

    def step(
        self,
        h: torch.Tensor,  # [B, T, H] head inputs (features_in(...) or fed-back g)
        tokens: torch.Tensor,  # [B, T] token x_{i+1} at each head position i
        positions: torch.Tensor,  # [B, T] head positions
        cache: KVCache | None = None,
        rows: torch.Tensor | None = None,  # [B, T] cache slot written by each token
        slots: torch.Tensor | None = None,  # [B] cache slot each row reads
        kv_len: int | Static | None = None,
    ) -> torch.Tensor:
        """Run the decoder layer; returns g [B, T, H]. Without a cache: causal over T;
        ``kv_len=STATIC`` (a ``Static``): a static step (as ``Transformer``'s): row b writes and
        reads slot b, its cache under a mask built on the device (``rows``/``slots`` unused)."""
        if cache is None:
            ctx = self.target.attn_context(positions, None, None)
        elif isinstance(kv_len, Static):
            ctx = self.target.attn_context(positions, cache, kv_len)
        else:
            kv_len = kv_len or int(positions.max()) + 1
            mask = cache_mask(positions, kv_len)  # [B, 1, T, kv_len] or None
            ctx = AttnContext(positions, mask, cache, rows, kv_len, slots=slots)
        cos, sin = self.target.rope(positions, like=self.norm.weight)
        return self.layer(h, tokens, cos, sin, ctx)

    def new_cache(self, slots: int, max_len: int) -> KVCache:
        c, p = self.head_config, self.norm.weight
        return KVCache(1, slots, c.num_kv_heads, max_len, c.head_dim, p.dtype, p.device)

    # ------------------------------------------------------------------ training-time test

    def unroll(
        self,
        feats: torch.Tensor,  # [B, T, F] target features at positions 0..T-1
        tokens: torch.Tensor,  # [B, T] token x_{i+1} for each position i
        steps: int,
    ) -> list[torch.Tensor]:
        """Training-time test: outputs g_j [B, T, H] for draft depths j = 0..steps-1.

        Depth j at position i is what the head computes when the target's features are known up
        to position i-j and it has drafted j times on its own outputs since: its input is
        g_{j-1} at i-1 and it attends to depth-0 keys at positions <= i-j and to depth-s keys at
        position i-j+s (1 <= s <= j), exactly like the KV cache holds them while drafting.
        Positions i < j have no valid input (mask them out of the loss).
        """
        b, t, _ = feats.shape
        positions = torch.arange(t, device=feats.device).expand(b, t)
        cos, sin = self.target.rope(positions, like=self.norm.weight)
        blk, attn = self.block, self.block.attn
        h = self.features_in(feats)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs = []
        for j in range(steps):
            if j:
                h = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], dim=1)
            a, x = self.attention_in(h, tokens)  # attention input, residual
            q, k, v = _qkv(attn, a, cos, sin)  # [B, heads, T, D]
            keys.append(k)
            values.append(v)
            mask = _ttt_mask(t, j, feats.device)  # [T, (j+1)T]
            a = torch.nn.functional.scaled_dot_product_attention(
                q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask, enable_gqa=True
            )
            x = x + attn.o(a.transpose(1, 2).reshape(b, t, -1))
            outs.append(x + blk.mlp(blk.mlp_norm(x)))
        return outs

    def depth_outputs(
        self,
        feats: torch.Tensor,  # [B, T, F] target features at positions 0..T-1
        tokens: torch.Tensor,  # [B, T] token x_{i+1} for each position i
        mask: torch.Tensor,  # [B, T] bool: position i's target x_{i+2} is a loss target
        steps: int,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft depth j < ``steps``: (g [N_j, H], where [B, T] bool): the head's outputs
        at the positions ``where`` marks (depth j at position i predicts x_{i+2}), the loss's
        view of ``unroll`` (a block head samples anchors instead)."""
        out = []
        for j, g in enumerate(self.unroll(feats, tokens, steps)):
            where = mask.clone()
            where[:, :j] = False
            out.append((g[where], where))
        return out

    def geometry(self) -> dict:
        """What besides kind, layers and vocabulary rebuilds this head (head.json)."""
        return {}


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` can be copied into ``a`` as it is (shape, dtype, device)."""
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


def check_arch(kind: str, arch: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown head arch {arch!r}; known: {ARCHS}")
    if arch != "proj" and kind != "eagle3":
        raise ValueError(f"head arch 'eagle3' is for eagle3 heads, not {kind!r} heads")


def _check_vocab(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    ids = torch.as_tensor(ids, dtype=torch.int64).flatten()
    if len(ids) == 0 or bool((ids[1:] <= ids[:-1]).any()):
        raise ValueError("draft_vocab must be non-empty, sorted and without repeats")
    if int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise ValueError(f"draft_vocab ids must be in [0, {vocab_size}), got {int(ids[-1])}")
    return ids


def draft_vocab_by_frequency(token_lists: list[list[int]], size: int, vocab_size: int):
    """The ``size`` most frequent ids in ``token_lists`` (ties: lower id first), sorted [Vd]."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for tokens in token_lists:
        counts += torch.bincount(torch.as_tensor(tokens, dtype=torch.int64), minlength=vocab_size)
    order = torch.sort(-counts, stable=True).indices[:size]  # stable: ties keep id order
    return order.sort().values


def cast_floats(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``state`` with floating tensors cast to ``dtype`` (index buffers like ``d2t`` kept)."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


def _qkv(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [B, heads, T, D], k/v [B, kv_heads, T, D] with RoPE, as ``Attention.forward``."""
    q, k, v = attn.project(x, cos, sin)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _ttt_mask(t: int, depth: int, device) -> torch.Tensor:
    """Bool [T, (depth+1)*T]: query i of depth ``depth`` sees depth-0 keys p <= i-depth and the
    depth-s key at p = i-depth+s. Rows i < depth see key 0 only (their output is unused)."""
    i = torch.arange(t, device=device)[:, None]
    p = torch.arange(t, device=device)[None, :]
    blocks = [p <= i - depth]
    blocks += [p == i - depth + s for s in range(1, depth + 1)]
    mask = torch.cat(blocks, dim=1)
    mask[:depth, 0] = True  # keep softmax finite on unused rows
    return mask


# ---------------------------------------------------------------------- checkpoints


def check_compatible(config: dict, target: ModelConfig) -> None:
    """Raise ValueError if a head saved for ``config['target']`` cannot read ``target``."""
    saved = config.get("target", {})
    pairs = [
        ("hidden size", saved.get("hidden_size"), target.hidden_size),
        ("vocabulary", saved.get("vocab_size"), target.vocab_size),
        ("layer count", saved.get("num_hidden_layers"), target.num_layers),
    ]
    for what, theirs, ours in pairs:
        if theirs != ours:
            raise ValueError(
                f"drafter was trained for a target with {what} {theirs}, but the target has "
                f"{ours}: train a drafter for this model (specrl train-drafter)"
            )
    if config.get("kind") not in KINDS:
        raise ValueError(f"unknown drafter kind {config.get('kind')!r}; known: {KINDS}")


def head_config(head: DraftHead) -> dict:
    return {
        "format": FORMAT,
        "version": VERSION,
        "kind": head.kind,
        "arch": head.arch,
        "feature_layers": list(head.feature_layers),
        "draft_vocab_size": None if head.d2t is None else len(head.d2t),
        "target": head.target_config.to_hf_dict(),
    } | head.geometry()


def save_head(head: DraftHead, out: str | Path, extra: dict | None = None) -> Path:
    """Write ``head.safetensors`` + ``head.json`` into directory ``out`` (each atomically), then
    their ``manifest.json``."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    with atomic_writer(out / "head.safetensors") as tmp:
        save_file(state, str(tmp))
    cfg = head_config(head) | {CHECKSUMS: True, "extra": extra or {}}
    atomic_write(out / "head.json", json.dumps(cfg, indent=1))
    write_manifest(out, list(HEAD_FILES))
    return out


def read_head_config(path: str | Path) -> dict:
    """The head.json of a saved head; ``ValueError`` (json's included) when it is not JSON, not
    a draft head's or lacks or mistypes a field ``load_head`` reads, ``OSError`` if unreadable."""
    path = Path(path)
    cfg = json.loads((path / "head.json").read_text())
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}/head.json holds a JSON {type(cfg).__name__}, not an object")
    if cfg.get("format") != FORMAT:
        raise ValueError(f"{path} is not a specrl draft head (format {cfg.get('format')!r})")
    layers = cfg.get("feature_layers")
    if not isinstance(cfg.get("target"), dict) or not (
        isinstance(layers, list) and all(type(x) is int for x in layers)
    ):
        raise ValueError(f"{path}/head.json lacks or mistypes 'target' or 'feature_layers'")
    if any(k in cfg and type(cfg[k]) is not int for k in GEOMETRY):
        raise ValueError(f"{path}/head.json mistypes {' or '.join(GEOMETRY)} (not integers)")
    cfg.setdefault("arch", "proj")  # heads saved before there was a choice
    if cfg["arch"] not in ARCHS:
        raise ValueError(f"{path}/head.json has an unknown arch {cfg['arch']!r}; known: {ARCHS}")
    return cfg


# ------------------------------------------------------------------- verified drafter files


class DrafterDamaged(ValueError):
    """A saved drafter's files do not match its manifest.json; the one line names the file."""


def verify_drafter(path: str | Path, required: Iterable[str]) -> str | None:
    """Check the drafter directory ``path`` against its manifest.json (see the module
    docstring): ``DrafterDamaged`` naming the first file that does not match, or a file of
    ``required`` present but not listed; the notice line (without ``notice:``) for a directory
    specrl wrote before drafters had manifests; ``None`` when verified (or foreign)."""
    path = Path(path)
    listed = read_manifest(path)
    if isinstance(listed, str):
        record = _record(path)
        if (path / MANIFEST).exists() or (record or {}).get(CHECKSUMS) is True:
            raise DrafterDamaged(f"{path}/{listed}")
        if record is None:
            return None
        return f"{path} has no {MANIFEST} (made before checksums); its files are not verified"
    unlisted = [n for n in required if n not in listed and (path / n).exists()]
    if unlisted:
        raise DrafterDamaged(f"{path}/{MANIFEST} does not list {unlisted[0]}")
    problem = listed_problem(path, listed)
    if problem is not None:
        raise DrafterDamaged(f"{path}/{problem}")
    return None


RECORDS = ("head.json", "distill.json", "config.json")  # where specrl records what it wrote


def _record(path: Path) -> dict | None:
    """specrl's own record of the drafter in ``path``: head.json, a draft model's distill.json
    or an export's ``specrl_export`` in config.json (the first readable one); None if none."""
    for name in RECORDS:
        try:
            raw = json.loads((path / name).read_bytes())
        except (OSError, ValueError):
            continue
        found = raw.get("specrl_export") if name == "config.json" and isinstance(raw, dict) else raw
        if isinstance(found, dict):
            return found
    return None


def notice(line: str) -> None:
    """Print ``notice: <line>`` on stderr (a drafter loaded without verification)."""
    print(f"notice: {line}", file=sys.stderr, flush=True)
