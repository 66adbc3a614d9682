"""Exporting specrl's drafters to the layouts vLLM loads.

``export_eagle3(head_dir, target, out_dir, dtype=None)`` writes an EAGLE-3 drafter directory
(``config.json`` + ``model.safetensors`` + ``manifest.json``) that vLLM's
``Eagle3LlamaForCausalLM`` / ``Eagle3Qwen3ForCausalLM`` loads, from an ``--head-arch eagle3``
head (``import_eagle3`` reads one back as a ``DraftHead``); ``export_draft_model`` checks that
a draft model is a Hugging Face checkpoint vLLM's ``draft_model`` method loads and copies it
with its tokenizer. What vLLM cannot load (an MTP head, a ``proj``-layout head, a head of
another target, damaged files) raises ``ExportError`` (a ``ValueError``) in one line. What is
read is checked against its manifest first (``models.heads.verify_drafter``: a file that does
not match is an ``ExportError`` naming it; a drafter made before checksums is read, with one
``notice:`` line on stderr). An export is written into a hidden directory beside the output
with its ``manifest.json`` (sha256 of each file), then moved into place (``write_dir``): a
failure (a full disk) leaves no half-written output, and no output directory it created.
Details (the exact layout): docs/internals.md.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from specrl.errors import one_line
from specrl.fsutil import MANIFEST, TMP_SUFFIX, fsync_path, write_manifest
from specrl.models.checkpoints import (
    CheckpointError,
    hf_state_dict,
    load_config,
    load_model,
    resolve_model,
    split_sizes,
)
from specrl.models.config import ModelConfig
from specrl.models.heads import (
    CHECKSUMS,
    HEAD_FILES,
    MODEL_FILES,
    DrafterDamaged,
    DraftHead,
    cast_floats,
    check_compatible,
    notice,
    read_head_config,
    verify_drafter,
)
from specrl.models.transformer import Transformer

FORMAT = "specrl-vllm-eagle3"
VERSION = 1
Say = Callable[[str], None]  # where a drafter's "made before checksums" notice goes
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
HF_ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# a head decoder layer's tensor -> vLLM's names in the layer (a fused one split along dim 0)
LAYER_NAMES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attn_norm.weight", ("input_layernorm.weight",)),
    ("attn.qkv.weight", tuple(f"self_attn.{p}_proj.weight" for p in "qkv")),
    ("attn.qkv.bias", tuple(f"self_attn.{p}_proj.bias" for p in "qkv")),
    ("attn.o.weight", ("self_attn.o_proj.weight",)),
    ("attn.q_norm.weight", ("self_attn.q_norm.weight",)),
    ("attn.k_norm.weight", ("self_attn.k_norm.weight",)),
    ("mlp_norm.weight", ("post_attention_layernorm.weight",)),
    ("mlp.gate_up.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ("mlp.down.weight", ("mlp.down_proj.weight",)),
)
# specrl head tensor -> vLLM EAGLE-3 checkpoint tensors (concatenated along dim 0 in specrl); the
# eagle3 layout's layer has no pre-attention norm (input_layernorm is the embedding's, enorm)
EAGLE3_NAMES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("fc.weight", ("fc.weight",)),
    ("hnorm.weight", ("midlayer.hidden_norm.weight",)),
    ("enorm.weight", ("midlayer.input_layernorm.weight",)),
    *((f"block.{ours}", tuple(f"midlayer.{t}" for t in theirs))
      for ours, theirs in LAYER_NAMES if ours != "attn_norm.weight"),
    ("norm.weight", ("norm.weight",)),
)  # fmt: skip


class ExportError(ValueError):
    """A drafter cannot be exported; the one-line message says why."""


# ---------------------------------------------------------------------------- EAGLE-3


def export_eagle3(
    head_dir: str | os.PathLike,
    target: str | os.PathLike | Transformer,
    out_dir: str | os.PathLike,
    dtype: torch.dtype | None = None,
    source: str | None = None,
    say: Say = notice,
) -> Path:
    """Write ``out_dir/config.json`` + ``out_dir/model.safetensors`` (docs/internals.md) and
    their manifest; ``source``: what config.json names as the head exported (default: the
    resolved ``head_dir``); ``say``: the notice for a head made before checksums."""

    head_dir, out = Path(head_dir), Path(out_dir)
    unverified = verified(head_dir, HEAD_FILES)
    cfg = eagle3_head_config(head_dir)
    tcfg, lm_head, state, d2t = head_inputs(head_dir, cfg, target)
    tensors = eagle3_tensors(state, tcfg, lm_head, d2t)
    config = eagle3_config(tcfg, cfg["feature_layers"], len(lm_head) if d2t is None else len(d2t))
    record = {"format": FORMAT, "version": VERSION, "source": source or str(head_dir.resolve()),
              "feature_layers": cfg["feature_layers"]}  # fmt: skip
    write_export(out, tensors, config, record, dtype or state["norm.weight"].dtype)
    if unverified is not None:
        say(unverified)
    return out


def head_inputs(
    head_dir: Path, cfg: dict, target: str | os.PathLike | Transformer
) -> tuple[ModelConfig, torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
    """What exporting the head in ``head_dir`` (its head.json ``cfg``) over ``target`` needs,
    checked: (the target's config, its LM head [V, H], the head's tensors without ``d2t``,
    ``d2t`` [Vd] sorted target ids or None); ``ExportError`` (one line) for a head of another
    target, feature layers the target lacks or a bad ``d2t``."""
    tcfg, lm_head = target_lm_head(target)
    try:
        check_compatible(cfg, tcfg)
    except ValueError as e:
        raise ExportError(str(e)) from None
    _check_layers(cfg["feature_layers"], tcfg.num_layers)
    state = read_safetensors(head_dir / "head.safetensors")
    d2t = state.pop("d2t", None)  # [Vd] target ids, or None (full vocabulary)
    if d2t is not None:
        check_d2t(d2t, tcfg.vocab_size)
    return tcfg, lm_head, state, d2t


def write_export(
    out: Path, tensors: dict[str, torch.Tensor], config: dict, record: dict, dtype: torch.dtype
) -> Path:
    """A head's export as vLLM loads it (``write_dir``): ``model.safetensors`` of ``tensors``
    (floating ones in ``dtype``) and ``config.json`` of ``config`` with its ``torch_dtype`` and
    specrl's ``record`` (``specrl_export``, checksums marked)."""
    from safetensors.torch import save_file

    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    config = config | {"torch_dtype": str(dtype).removeprefix("torch."),
                       "specrl_export": record | {CHECKSUMS: True}}  # fmt: skip

    def write(tmp: Path) -> list[str]:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        return ["model.safetensors", "config.json"]

    return write_dir(out, write)


def import_eagle3(
    model_dir: str | os.PathLike, target: Transformer, say: Say = notice
) -> DraftHead:
    """The specrl head (``arch='eagle3'``, float32) a drafter directory in vLLM's EAGLE-3 layout
    holds for ``target``: ``export_eagle3`` read back (its LM head, rows of the target's, is not
    the head's own and is dropped). ``ExportError`` for a drafter specrl's head cannot hold
    (another target, tensors without a place in it, no feature layer ids) or whose files do not
    match their manifest; ``say``: the notice for an export made before checksums."""
    src = Path(model_dir)
    unverified = verified(src, MODEL_FILES, "import")
    try:
        raw = json.loads((src / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"cannot read {src}/config.json: {one_line(e)}") from None
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    c = target.config
    if not ids or raw.get("norm_before_residual"):
        raise ExportError(
            f"{src} names no eagle_aux_hidden_state_layer_ids (or normalises before the "
            "residual): specrl's EAGLE-3 head cannot hold it"
        )
    size = (raw.get("hidden_size"), raw.get("vocab_size"))
    if size != (c.hidden_size, c.vocab_size):
        raise ExportError(
            f"{src} is a drafter for another target (hidden size {size[0]}, vocabulary {size[1]})"
        )
    layers = [int(i) - 1 for i in ids]  # vLLM id j = output of target layer j - 1
    _check_layers(layers, c.num_layers)
    state, d2t = _head_state(src)
    head = DraftHead(target, "eagle3", tuple(layers), d2t, arch="eagle3").float()
    if d2t is not None:
        state["d2t"] = d2t
    try:
        head.load_state_dict(cast_floats(state, torch.float32))
    except RuntimeError as e:  # missing or mis-shaped tensors (several lines)
        why = " ".join(str(e).split())
        raise ExportError(f"{src} does not fit an eagle3 head: {why}") from None
    if unverified is not None:
        say(unverified)
    return head.eval()


def _head_state(src: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """(the head's tensors under specrl's names, ``d2t`` as target ids or None) from vLLM's
    EAGLE-3 checkpoint tensors in ``src``."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors |= read_safetensors(f)
    offsets = tensors.pop("d2t", None)  # [Vd]: target id = i + offsets[i]
    for derived in ("t2d", "lm_head.weight", "midlayer.self_attn.o_proj.bias"):
        tensors.pop(derived, None)  # from d2t, the target's LM head, zeros (eagle3_tensors)
    state = {}
    for ours, theirs in EAGLE3_NAMES:
        if all(n in tensors for n in theirs):
            state[ours] = torch.cat([tensors.pop(n) for n in theirs])
    if tensors:
        raise ExportError(f"{src}: tensor {sorted(tensors)[0]} has no place in specrl's head")
    d2t = None if offsets is None else offsets.long() + torch.arange(len(offsets))
    return state, d2t


def is_head_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a specrl head (head.json)."""
    return (Path(path) / "head.json").is_file()


def is_eagle3_export(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a drafter in vLLM's EAGLE-3 layout (config.json naming an Eagle3
    architecture)."""
    try:
        arch = json.loads((Path(path) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return any("eagle3" in str(a).lower() for a in arch)


def eagle3_head_config(head_dir: Path) -> dict:
    """head.json of an exportable head, or ``ExportError`` saying why it is not one."""
    try:
        cfg = read_head_config(head_dir)
    except (OSError, ValueError) as e:
        raise ExportError(f"cannot read the head in {head_dir}: {one_line(e)}") from None
    if cfg.get("kind") == "mtp":
        raise ExportError(
            f"{head_dir} is an MTP head: vLLM runs MTP only from the MTP layers built into "
            "specific models' own checkpoints (DeepSeek-V3, MiMo, Qwen3-Next, GLM-4.5, ...), "
            "not a separate head for a llama/qwen target; export an eagle3 head or a draft model"
        )
    if cfg.get("kind") != "eagle3":
        raise ExportError(f"{head_dir} holds a {cfg.get('kind')!r} head, not an eagle3 head")
    if cfg["arch"] != "eagle3":
        raise ExportError(
            f"{head_dir} has specrl's {cfg['arch']!r} layout (inputs projected 2H->H, then a "
            "normed decoder layer), which vLLM's EAGLE-3 layer (attention over the 2H concat, "
            "residual from the features) cannot express: train one with "
            "`specrl train-drafter --drafter eagle3 --head-arch eagle3`"
        )
    return cfg


def _check_layers(layers: list[int], num_layers: int) -> None:
    if not layers or layers != sorted(set(layers)) or not 0 <= layers[0] <= layers[-1] < num_layers:
        raise ExportError(
            f"the head's feature layers {layers} are not distinct sorted layers of the target "
            f"(0..{num_layers - 1})"
        )


def check_d2t(d2t: torch.Tensor, vocab_size: int) -> None:
    ok = d2t.dim() == 1 and len(d2t) > 0 and not d2t.is_floating_point()
    ok = ok and bool((d2t[1:] > d2t[:-1]).all()) and 0 <= int(d2t[0]) <= int(d2t[-1]) < vocab_size
    if not ok:
        raise ExportError(
            f"the head's d2t is not a sorted list of distinct ids in [0, {vocab_size})"
        )


def eagle3_tensors(
    state: dict[str, torch.Tensor],
    target: ModelConfig,
    lm_head: torch.Tensor,  # [V, H] the target's LM head
    d2t: torch.Tensor | None,  # [Vd] sorted target ids, or None (full vocabulary)
) -> dict[str, torch.Tensor]:
    """vLLM EAGLE-3 tensors from a head's state dict (without ``d2t``); ``ExportError`` when the
    state holds tensors that have no vLLM name or lacks one."""
    known = {ours for ours, _ in EAGLE3_NAMES}
    extra = sorted(set(state) - known)
    if extra:
        raise ExportError(f"head tensor {extra[0]} has no place in vLLM's EAGLE-3 layout")
    out: dict[str, torch.Tensor] = {}
    for ours, theirs in EAGLE3_NAMES:
        if ours in state:
            t = state[ours]
            rows = t.shape[0] if t.dim() else 0
            sizes = [rows] if len(theirs) == 1 else split_sizes(target, theirs, rows)
            if t.dim() == 0 or rows != sum(sizes):
                raise ExportError(
                    f"head tensor {ours} has shape {tuple(t.shape)}: not this target's"
                )
            parts = t.split(sizes)
            out.update({n: p.contiguous() for n, p in zip(theirs, parts, strict=True)})
    if "block.attn.qkv.bias" in state and target.model_type != "qwen3":
        # vLLM's Llama layer gives o_proj a bias whenever attention_bias is set
        out["midlayer.self_attn.o_proj.bias"] = torch.zeros(target.hidden_size)
    out |= draft_lm_head(lm_head, d2t)
    if d2t is not None:
        t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
        out["t2d"] = t2d.index_fill_(0, d2t.to(torch.int64), True)  # [V]
    _check_complete(out, target)
    return out


def draft_lm_head(lm_head: torch.Tensor, d2t: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """vLLM's ``lm_head.weight`` of a draft head: the target's LM head [V, H], or its rows
    ``d2t`` [Vd] with ``d2t`` as vLLM's offsets (draft i -> target i + d2t[i])."""
    lm_head = lm_head.detach().float()
    if d2t is None:
        return {"lm_head.weight": lm_head.contiguous()}  # [V, H]
    d2t = d2t.to(torch.int64)
    return {"lm_head.weight": lm_head.index_select(0, d2t).contiguous(),  # [Vd, H]
            "d2t": d2t - torch.arange(len(d2t))}  # fmt: skip


def expected_eagle3_shapes(
    target: ModelConfig, num_features: int, draft_vocab: int
) -> dict[str, tuple[int, ...]]:
    """Every tensor vLLM's EAGLE-3 class reads for this target (biases and q/k norms only where
    the target has them; d2t/t2d only with a reduced vocabulary), with its shape."""
    h, i, m = target.hidden_size, target.intermediate_size, "midlayer."
    q, kv = target.num_heads * target.head_dim, target.num_kv_heads * target.head_dim
    shapes = {
        "fc.weight": (h, num_features * h),
        m + "hidden_norm.weight": (h,),
        m + "input_layernorm.weight": (h,),
        m + "self_attn.q_proj.weight": (q, 2 * h),
        m + "self_attn.k_proj.weight": (kv, 2 * h),
        m + "self_attn.v_proj.weight": (kv, 2 * h),
        m + "self_attn.o_proj.weight": (h, q),
        m + "post_attention_layernorm.weight": (h,),
        m + "mlp.gate_proj.weight": (i, h),
        m + "mlp.up_proj.weight": (i, h),
        m + "mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (draft_vocab, h),
    }
    if target.attention_bias:
        shapes |= {
            m + f"self_attn.{p}_proj.bias": (n,) for p, n in zip("qkv", (q, kv, kv), strict=True)
        }
        if target.model_type != "qwen3":
            shapes[m + "self_attn.o_proj.bias"] = (h,)
    if target.qk_norm:
        shapes |= {m + f"self_attn.{p}_norm.weight": (target.head_dim,) for p in "qk"}
    if draft_vocab != target.vocab_size:
        shapes |= {"d2t": (draft_vocab,), "t2d": (target.vocab_size,)}
    return shapes


def _check_complete(out: dict[str, torch.Tensor], target: ModelConfig) -> None:
    fc = out.get("fc.weight")
    n = 0 if fc is None else fc.shape[1] // target.hidden_size
    want = expected_eagle3_shapes(target, n, len(out["lm_head.weight"]))
    extra = sorted(set(out) - set(want))
    if extra:
        raise ExportError(f"the head has a tensor for {extra[0]}, which this target lacks")
    for name, shape in want.items():
        if name not in out:
            raise ExportError(f"the head lacks the tensor for vLLM's {name}")
        if tuple(out[name].shape) != shape:
            got = tuple(out[name].shape)
            raise ExportError(f"vLLM's {name} must be {shape}, the head gives {got}")


def eagle3_config(target: ModelConfig, feature_layers: list[int], draft_vocab: int) -> dict:
    """config.json of the exported drafter (docs/internals.md)."""
    qwen3 = target.model_type == "qwen3"
    ids = [int(x) + 1 for x in feature_layers]  # vLLM id j = output of target layer j - 1
    config = target.replace(num_layers=1).to_hf_dict()
    config |= {
        "architectures": ["Eagle3Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLMEagle3"],
        "model_type": "qwen3" if qwen3 else "llama",
        "tie_word_embeddings": False,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": target.hidden_size,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
    }
    return config


def target_lm_head(target: str | os.PathLike | Transformer) -> tuple[ModelConfig, torch.Tensor]:
    """(target config, its LM head [V, H]) from a loaded model or a model name/directory (only
    the one tensor is read)."""
    if isinstance(target, Transformer):
        return target.config, target.lm_head.weight.detach()
    try:
        model_dir = resolve_model(target)
        config = load_config(model_dir)
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    names = ["lm_head.weight", "model.embed_tokens.weight"]
    if config.tie_word_embeddings:
        names.reverse()
    for name in names:
        w = _read_tensor(model_dir, name)
        if w is not None:
            return config, w
    raise ExportError(f"{model_dir} has neither lm_head.weight nor model.embed_tokens.weight")


def _read_tensor(model_dir: Path, name: str) -> torch.Tensor | None:
    """Tensor ``name`` from the first of ``model_dir``'s *.safetensors holding it, or None."""
    from safetensors import SafetensorError, safe_open

    for f in sorted(model_dir.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                if name in st.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    return st.get_tensor(name)
        except (OSError, SafetensorError) as e:
            raise ExportError(f"corrupt safetensors file {f}: {one_line(e)}") from None
    return None


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as e:
        raise ExportError(f"cannot read {path}: {one_line(e)}") from None


# ---------------------------------------------------------------------------- draft model


def export_draft_model(
    draft_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None = None,
    say: Say = notice,
) -> Path:
    """Check ``draft_dir`` is an HF checkpoint vLLM loads (its files matching its manifest);
    copy it (and tokenizer files) to ``out_dir`` unless that is the same directory
    (docs/internals.md); ``say``: the notice for a draft model made before checksums."""
    try:
        src = resolve_model(draft_dir)
    except CheckpointError as e:
        raise ExportError(f"{draft_dir} is not a model vLLM can load: {e}") from None
    unverified = verified(src, MODEL_FILES)
    try:
        model = load_model(src)  # every tensor present, named and shaped as HF's
    except CheckpointError as e:
        raise ExportError(f"{draft_dir} is not a model vLLM can load: {e}") from None
    out = Path(out_dir)
    same = out.exists() and out.resolve() == src.resolve()
    tok_src = src if same or (src / "tokenizer.json").is_file() else tokenizer_dir
    if tok_src is None or not (Path(tok_src) / "tokenizer.json").is_file():
        how = "export to another --out" if same else "name the target model to copy it from"
        raise ExportError(f"{src} has no tokenizer.json: {how}")
    if same:
        _check_hf_config(src)
    else:
        write_dir(out, lambda tmp: _write_hf_model(model, src, Path(tok_src), tmp))
    if unverified is not None:
        say(unverified)
    return out


def verified(path: Path, required: tuple[str, ...], doing: str = "export") -> str | None:
    """``models.heads.verify_drafter`` with damage as an ``ExportError`` ('cannot ``doing``
    the drafter: DIR/FILE: sha256 mismatch'): the notice line for a drafter made before
    checksums, else None."""
    try:
        return verify_drafter(path, required)
    except DrafterDamaged as e:
        raise ExportError(f"cannot {doing} the drafter: {e}") from None


def write_dir(out: Path, write: Callable[[Path], list[str]]) -> Path:
    """Fill a hidden directory beside ``out`` through ``write`` (which returns the names of the
    files it wrote), add their manifest, and move it into place (``_move_in``). On any failure
    nothing half-written stays: the hidden directory is removed, and so is every directory this
    call created (``out``, and its parents that were missing)."""
    created = _first_missing(out)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        names = write(tmp)
        write_manifest(tmp, names)
        _move_in(tmp, out, [*names, MANIFEST])
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
    return out


def _first_missing(path: Path) -> Path | None:
    """The outermost of ``path`` and its parents that does not exist (None: ``path`` does)."""
    missing = None
    for p in (path, *path.parents):
        if p.exists():
            break
        missing = p
    return missing


def _move_in(tmp: Path, out: Path, names: list[str]) -> None:
    """``tmp`` renamed to ``out`` when that is missing or empty; else each of ``names`` renamed
    over its namesake in ``out``, the manifest last (a reader in between finds files that do not
    match the old manifest, so refuses them), and ``tmp`` removed."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        tmp.rename(out)  # over an empty directory too
    else:
        for name in sorted(names, key=lambda n: n == MANIFEST):
            (tmp / name).replace(out / name)
        fsync_path(out)
        tmp.rmdir()
    fsync_path(out.parent)


def _check_hf_config(model_dir: Path) -> None:
    """``ExportError`` unless config.json names the HF architecture of its model_type."""
    raw = json.loads((model_dir / "config.json").read_text())
    want = HF_ARCHS[raw.get("model_type", "llama")]
    if raw.get("architectures") != [want]:
        raise ExportError(
            f"{model_dir}/config.json names architectures {raw.get('architectures')}, "
            f"vLLM needs [{want!r}] for model_type {raw.get('model_type')!r}: export to another "
            "--out to rewrite it"
        )


def _write_hf_model(model: Transformer, src: Path, tok_src: Path, out: Path) -> list[str]:
    """config.json (architecture set from model_type, the rest kept), model.safetensors (HF
    names, the source's dtype) of ``model``, read from ``src``, its distill.json and the
    tokenizer files of ``tok_src``, written into ``out``; the names written."""
    from safetensors.torch import save_file

    raw = json.loads((src / "config.json").read_text())
    raw["architectures"] = [HF_ARCHS[model.config.model_type]]
    dtype = _source_dtype(src)
    state = {k: v.to(dtype) for k, v in hf_state_dict(model).items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    names = ["model.safetensors", "config.json"]
    spec = src / "distill.json"  # specrl's record of how the draft was made
    copies = [spec] if spec.is_file() else []
    copies += [tok_src / n for n in TOKENIZER_FILES if (tok_src / n).is_file()]
    for path in copies:
        shutil.copyfile(path, out / path.name)
        names.append(path.name)
    return names


def _source_dtype(model_dir: Path) -> torch.dtype:
    """The float dtype of the first tensor of ``model_dir``'s first safetensors file."""
    from safetensors import safe_open

    f = sorted(model_dir.glob("*.safetensors"))[0]
    with safe_open(str(f), framework="pt") as st:
        first = next(iter(st.keys()))
        return st.get_tensor(first).dtype
