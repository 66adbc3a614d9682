"""A run's checkpoint as a Hugging Face model directory that transformers and vLLM load.

Contract: ``export_model(run_dir, out, step=None, merge_drafter=False, shard_size=...)`` writes
``out`` from the newest checkpoint of ``run_dir`` that verifies (``step=N``: ``step_N``), written
by a one-process learner (``policy.safetensors``) or by train workers (their DCP ``learner/``):

- ``config.json``: the run's model config (``config.toml`` ``model.name``, resolved by
  ``models.checkpoints.resolve_model``) with its HF architecture (``LlamaForCausalLM``, ...),
  ``tie_word_embeddings`` and the weights' dtype;
- ``generation_config.json``: bos and eos ids from the model's tokenizer (eos: every token that
  ends a turn, the tokenizer's eos first), the other fields of the model's own file kept;
- the tokenizer files and chat template, copied from the model directory;
- the weights under HF names in the checkpoint's own precision: ``model.safetensors``, or
  ``model-0000K-of-0000N.safetensors`` + ``model.safetensors.index.json`` when they exceed
  ``shard_size`` bytes (no ``lm_head.weight`` when the embeddings are tied, as HF expects);
- with ``merge_drafter``: the EAGLE-3 head the run trained, in the layout vLLM loads
  (``drafters.export.export_eagle3``), in ``out/drafter``.

Every bad input is a ``ModelExportError`` (one line): ``resolve_export`` (no run dir, no
checkpoint that verifies, a step that is not there, an unusable model or tokenizer, no drafter
to merge) and ``check_out`` (``out`` non-empty or unwritable) check all but the weights before
any work; weights that do not fit the model are found before anything is written. ``out`` is
written atomically: a hidden sibling directory renamed into place at the end, removed on any
failure (``out`` is then as it was). Only safetensors are read, nothing is unpickled.
Details: docs/export.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specrl.config import Config, load_run_config
from specrl.drafters.export import ExportError, export_eagle3
from specrl.errors import one_line
from specrl.fsutil import fsync_path, naming, room_problem, writable_problem
from specrl.models.checkpoints import (
    CheckpointError,
    hf_split,
    hf_state_dict,
    load_config,
    load_tokenizer,
    name_map,
    resolve_model,
)
from specrl.models.config import ModelConfig
from specrl.models.heads import DraftHead, default_layers, read_head_config, save_head
from specrl.models.tokenizer import TextTokenizer
from specrl.models.transformer import Transformer
from specrl.pipelines.checkpoint import DRAFTER
from specrl.pipelines.manifest import (
    SHARDED,
    CheckpointDamaged,
    checkpoint_step,
    parse_file,
    verify_manifest,
)
from specrl.pipelines.rundir import RunDir
from specrl.rl.sharded_checkpoint import NO_DIST
from specrl.rollout_plan import drafter_dir

DEFAULT_SHARD_SIZE = 5 * 10**9  # bytes per weights file (Hugging Face's default, "5GB")
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DRAFTER_DIR = "drafter"  # out/drafter: the merged drafter
# What a model directory's tokenizer may consist of (copied when present).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}  # fmt: skip


class ModelExportError(ValueError):
    """A run checkpoint cannot be exported; the message is one line saying why."""


@dataclass(frozen=True)
class ExportSource:
    """What an export reads, resolved and checked: the checkpoint, the run's config, its model
    directory (config and tokenizer) and, for ``merge_drafter``, the trained drafter's file."""

    run_dir: Path
    ckpt: Path
    step: int
    cfg: Config
    model_dir: Path
    config: ModelConfig
    generation: dict[str, Any]  # generation_config.json
    drafter: Path | None = None  # the checkpoint's drafter.safetensors (merge_drafter only)
    skipped: tuple[str, ...] = ()  # newer checkpoints that failed verification, with why


# --------------------------------------------------------------------------- checks


def parse_size(text: str) -> int:
    """Bytes of ``"5GB"``, ``"500MB"``, ``"2GiB"``, ``"1000"`` (decimal units as Hugging Face
    counts them, ``Ki``/``Mi``/``Gi`` binary); ``ValueError`` for anything else or below 1."""
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"not a size: {text!r} (e.g. 5GB, 500MB, 2GiB or a number of bytes)")
    unit = (m.group(2) or "").lower().removesuffix("b")
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value):
        raise ValueError(f"not a finite size: {text!r}")
    size = int(value)
    if size < 1:
        raise ValueError(f"a shard size must be at least 1 byte, got {text!r}")
    return size


def check_out(out: str | os.PathLike) -> None:
    """``ModelExportError`` unless ``out`` is absent or an empty directory, and can be made."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ModelExportError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        raise ModelExportError(f"{out} exists and is not empty: choose a new directory")
    problem = writable_problem(out, "dir")
    if problem is None and out.is_dir() and not os.access(out.parent, os.W_OK | os.X_OK):
        problem = f"{out}: no permission to write in {out.parent}"  # the rename replaces it
    if problem is not None:
        raise ModelExportError(f"cannot write OUT: {problem}")


def resolve_export(
    run_dir: str | os.PathLike, step: int | None = None, merge_drafter: bool = False
) -> ExportSource:
    """The checked inputs of an export (see the module docstring; ``ModelExportError``)."""
    run = _run(Path(run_dir))
    cfg = _run_config(run)
    model_dir, config = _model(cfg)
    generation = generation_config(model_dir, config)
    ckpt, skipped = find_checkpoint(run, step)  # hashes every file: after the cheap checks
    drafter = _drafter_file(ckpt, cfg, config) if merge_drafter else None
    found = checkpoint_step(ckpt)
    return ExportSource(run.path, ckpt, found, cfg, model_dir, config, generation, drafter,
                        tuple(skipped))  # fmt: skip


def _run(path: Path) -> RunDir:
    if not path.exists():
        raise ModelExportError(f"run dir {path} does not exist")
    if not path.is_dir():
        raise ModelExportError(f"run dir {path} is not a directory")
    run = RunDir(path)
    if not run.config.is_file():
        raise ModelExportError(f"{path} is not a run directory: no config.toml there")
    return run


def find_checkpoint(run: RunDir, step: int | None = None) -> tuple[Path, list[str]]:
    """(the checkpoint to export, the newer ones skipped as damaged: ``"step_N (why)"``):
    ``step_<step>`` when it verifies, else the newest that verifies (``ModelExportError``)."""
    found = run.checkpoints_newest_first()
    if not found:
        raise ModelExportError(f"{run.path} holds no checkpoint (nothing in {run.checkpoints})")
    if step is not None:
        chosen = [p for p in found if checkpoint_step(p) == step]
        if not chosen:
            steps = ", ".join(str(checkpoint_step(p)) for p in reversed(found))
            raise ModelExportError(f"{run.path} has no checkpoint of step {step} "
                                   f"(its checkpoints: steps {steps})")  # fmt: skip
        problem = _damage(chosen[0])
        if problem is not None:
            raise ModelExportError(f"checkpoint {chosen[0]} is damaged ({problem})")
        return chosen[0], []
    skipped = []
    for ckpt in found:
        problem = _damage(ckpt)
        if problem is None:
            return ckpt, skipped
        skipped.append(f"{ckpt.name} ({problem})")
    raise ModelExportError(f"no checkpoint of {run.path} verifies: {', '.join(skipped)}")


def _damage(ckpt: Path) -> str | None:
    """Why ``ckpt`` fails verification (its manifest, every file's size and sha256), or None."""
    try:
        verify_manifest(ckpt)
    except CheckpointDamaged as e:
        return str(e)
    return None


def _run_config(run: RunDir) -> Config:
    try:
        return load_run_config(run.config)
    except ValueError as e:  # ConfigError: unreadable, not TOML, a value no longer valid
        raise ModelExportError(f"cannot read {run.config}: {e}") from None


def _model(cfg: Config) -> tuple[Path, ModelConfig]:
    """(the run's model directory, its config); it must hold a tokenizer that reads."""
    name = cfg.model.name
    try:
        model_dir = resolve_model(name)
        config = load_config(model_dir)
        load_tokenizer(model_dir)
    except CheckpointError as e:
        raise ModelExportError(f"the run's model {name!r} (config.toml model.name): {e}") from None
    return model_dir, config


# --------------------------------------------------------------------------- the policy


def read_policy(ckpt: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's policy under HF names (the tensors a HF directory of ``config`` holds,
    as stored); ``ModelExportError`` when a tensor is missing, left over or mis-shaped."""
    if (ckpt / SHARDED).is_dir():
        tensors = _hf_names(_read_sharded(ckpt / SHARDED), config)
    else:
        try:
            tensors = parse_file(ckpt, "policy.safetensors", _load_safetensors)
        except CheckpointDamaged as e:
            raise ModelExportError(f"checkpoint {ckpt} is damaged ({e})") from None
    _check_fits(tensors, config, ckpt)
    return tensors


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _read_sharded(path: Path) -> dict[str, torch.Tensor]:
    """The model's full tensors (specrl names) from train workers' DCP checkpoint, read in
    this process whatever the number of ranks that wrote it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    try:
        meta = HuggingFaceStorageReader(str(path)).read_metadata().state_dict_metadata
        tensors = {
            key.removeprefix("model."): torch.empty(tuple(m.size), dtype=m.properties.dtype)
            for key, m in meta.items()
            if key.startswith("model.") and hasattr(m, "size")
        }
        keyed = {f"model.{k}": v for k, v in tensors.items()}  # the same tensors, DCP's keys
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", NO_DIST)
            dcp.load(keyed, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=True)
    except Exception as e:  # DCP and safetensors raise many kinds on files that do not read
        raise ModelExportError(f"cannot read the sharded policy in {path}: {one_line(e)}") from None
    return tensors


def _hf_names(ours: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """specrl-named tensors under HF names (fused q/k/v and gate/up split back); one left
    without an HF name is a ``ModelExportError``."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for name, theirs in name_map(config):
        if name not in ours:
            continue
        used.add(name)
        out.update(hf_split(config, theirs, ours[name]))
    extra = sorted(set(ours) - used)
    if extra:
        raise ModelExportError(f"the sharded policy has a tensor {extra[0]} the model has no "
                               "place for")  # fmt: skip
    return out


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a HF directory of ``config`` holds, with its shape (no weights made)."""
    with torch.device("meta"):
        model = Transformer(config)
    return {k: tuple(v.shape) for k, v in hf_state_dict(model).items()}


def _check_fits(tensors: Mapping[str, torch.Tensor], config: ModelConfig, ckpt: Path) -> None:
    want = expected_shapes(config)
    where = f"checkpoint {ckpt.name} does not fit the run's model"
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing:
        raise ModelExportError(f"{where}: it lacks {missing[0]}")
    if extra:
        raise ModelExportError(f"{where}: it has {extra[0]}, which the model has no place for")
    for name, shape in want.items():
        if tuple(tensors[name].shape) != shape:
            got = tuple(tensors[name].shape)
            raise ModelExportError(f"{where}: {name} is {got}, the model's is {shape}")


# --------------------------------------------------------------------------- files


def hf_config(config: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json of the exported model: the HF architecture and the weights' dtype."""
    name = str(dtype).removeprefix("torch.")
    return config.to_hf_dict() | {"torch_dtype": name, "dtype": name}


def generation_config(model_dir: Path, config: ModelConfig) -> dict[str, Any]:
    """generation_config.json: the model directory's own (if a JSON object) with bos and eos
    from its tokenizer (eos: the tokenizer's eos, then the other tokens that end a turn)."""
    base = _json_object(model_dir / "generation_config.json")
    tok = load_tokenizer(model_dir)
    stops = list(tok.stop_token_ids)
    eos = tok.eos_token_id
    eos_ids = ([eos] if eos is not None else []) + [i for i in stops if i != eos]
    bos = _token_id(tok, tok.config.get("bos_token"))
    out = base | {"bos_token_id": bos if bos is not None else config.bos_token_id}
    if eos_ids:
        out["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    elif config.eos_token_id is not None:
        out["eos_token_id"] = config.eos_token_id
    return out


def _json_object(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _token_id(tok: TextTokenizer, token: Any) -> int | None:
    """The id of a special token as tokenizer_config.json names it (a string or an object
    with ``content``)."""
    if isinstance(token, dict):
        token = token.get("content")
    return tok.tok.token_to_id(token) if isinstance(token, str) else None


def shard_names(tensors: Mapping[str, torch.Tensor], shard_size: int) -> list[list[str]]:
    """Tensor names in files of at most ``shard_size`` bytes each, in order (a tensor larger
    than that alone in its file)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_size:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_weights(
    tensors: Mapping[str, torch.Tensor], folder: Path, shard_size: int = DEFAULT_SHARD_SIZE
) -> list[str]:
    """Write ``tensors`` as HF does: one ``model.safetensors``, or shards + the index when
    they exceed ``shard_size`` bytes; the names of the files written."""
    from safetensors.torch import save_file

    shards = shard_names(tensors, shard_size)
    if len(shards) == 1:
        with naming(folder / SINGLE):  # a full disk: an OSError naming the file
            save_file(dict(tensors), str(folder / SINGLE), metadata={"format": "pt"})
        return [SINGLE]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for names, file in zip(shards, files, strict=True):
        with naming(folder / file):
            save_file({n: tensors[n] for n in names}, str(folder / file), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    weight_map = {n: file for names, file in zip(shards, files, strict=True) for n in names}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2))
    return [*files, INDEX]


def _copy_tokenizer(model_dir: Path, folder: Path) -> list[str]:
    names = [n for n in TOKENIZER_FILES if (model_dir / n).is_file()]
    for name in names:
        shutil.copyfile(model_dir / name, folder / name)
    return names


# --------------------------------------------------------------------------- the drafter


def _drafter_file(ckpt: Path, cfg: Config, config: ModelConfig) -> Path:
    """The checkpoint's trained drafter, if it is an EAGLE-3 head in vLLM's layout (read from
    the names and shapes in its file, nothing loaded); else ``ModelExportError`` saying why."""
    spec, mode = cfg.rollout.spec, cfg.drafter.mode
    path = ckpt / DRAFTER
    if not path.is_file():
        raise ModelExportError(
            f"--merge-drafter: checkpoint {ckpt.name} holds no trained drafter (the run has "
            f"rollout.spec={spec!r}, drafter.mode={mode!r})"
        )
    try:
        shapes = parse_file(ckpt, DRAFTER, _param_shapes)
    except CheckpointDamaged as e:
        raise ModelExportError(f"--merge-drafter: {e}") from None
    if "block.attn.qkv.weight" not in shapes:  # a head's layer is ``block``, a model's ``layers``
        raise ModelExportError("--merge-drafter: the run trained a draft model, not a head; "
                               "--merge-drafter writes EAGLE-3 heads")  # fmt: skip
    if "fc.weight" not in shapes:
        raise ModelExportError(
            "--merge-drafter: the run trained an MTP head: vLLM runs MTP only from the MTP "
            "layers built into specific models' own checkpoints, not from a separate head"
        )
    if "proj.weight" in shapes:
        raise ModelExportError(
            "--merge-drafter: the run's EAGLE-3 head has specrl's 'proj' layout, which vLLM's "
            "EAGLE-3 layer cannot express (runs on rollout.backend='vllm', or started from a "
            "--head-arch eagle3 head, train vLLM's layout)"
        )
    _feature_layers(cfg, shapes["fc.weight"][1] // config.hidden_size, config.num_layers)
    return path


def _param_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The shapes of the drafter's parameters in its training-state file (``param.<name>``)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        keys = [k for k in f.keys() if k.startswith("param.")]  # noqa: SIM118 (not a dict)
        return {k.removeprefix("param."): tuple(f.get_slice(k).get_shape()) for k in keys}


def _feature_layers(cfg: Config, count: int, num_layers: int) -> tuple[int, ...]:
    """The policy layers the head reads: those of the drafter the run started from
    (``rollout.drafter_path`` or the cached one), else the default ones; ``count`` of them."""
    options = []
    start = drafter_dir(cfg)
    if start is not None:
        options.append(_start_layers(Path(start)))
    options.append(default_layers("eagle3", num_layers))
    for layers in options:
        if layers is not None and len(layers) == count:
            return layers
    raise ModelExportError(
        f"--merge-drafter: the head reads {count} policy layers, and neither the drafter the "
        "run started from nor the default names that many"
    )


def _start_layers(path: Path) -> tuple[int, ...] | None:
    """The feature layers of a head directory (specrl's head.json, or vLLM's EAGLE-3 config:
    its ids are layer + 1); None when it holds no head."""
    try:
        if (path / "head.json").is_file():
            return tuple(read_head_config(path)["feature_layers"])
        raw = json.loads((path / "config.json").read_text())
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or []
        return tuple(int(i) - 1 for i in ids) or None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def head_target(tensors: Mapping[str, torch.Tensor], config: ModelConfig) -> Transformer:
    """What a head and its export read of the policy: a ``Transformer`` of ``config`` whose
    embedding and LM head are ``tensors``' (float32); its other weights stay on the meta
    device (never read)."""
    with torch.device("meta"):
        model = Transformer(config)
    model.embed.weight = nn.Parameter(tensors["model.embed_tokens.weight"].float(), False)
    tied = config.tie_word_embeddings
    lm = model.embed.weight if tied else nn.Parameter(tensors["lm_head.weight"].float(), False)
    model.lm_head.weight = lm  # [V, H]
    return model.eval()


def trained_head(path: Path, cfg: Config, policy: Transformer) -> DraftHead:
    """The float32 EAGLE-3 head (vLLM's layout) in a checkpoint's drafter file, over
    ``policy``; ``ModelExportError`` when its tensors do not fit one."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        state = {
            k.removeprefix("param."): f.get_tensor(k)
            for k in f.keys()  # noqa: SIM118 (not a dict)
            if k.startswith("param.")
        }
    side = _json_object(path.with_name(path.name + ".json"))
    meta = side.get("student", side)  # older checkpoints kept d2t at the top
    d2t = meta.get("d2t") if isinstance(meta, dict) else None
    vocab = None if d2t is None else torch.tensor(d2t, dtype=torch.int64)  # [Vd] target ids
    c = policy.config
    layers = _feature_layers(cfg, state["fc.weight"].shape[1] // c.hidden_size, c.num_layers)
    try:
        head = DraftHead(policy, "eagle3", layers, vocab, arch="eagle3").float()
        head.load_state_dict(state | ({} if vocab is None else {"d2t": vocab}))
    except (RuntimeError, ValueError) as e:  # mis-shaped or missing tensors (several lines)
        why = " ".join(str(e).split())
        raise ModelExportError(
            f"--merge-drafter: {path} does not fit an EAGLE-3 head: {why}"
        ) from None
    return head.eval()


def write_drafter(source: ExportSource, tensors: Mapping[str, torch.Tensor], out: Path) -> None:
    """The run's trained EAGLE-3 head in vLLM's layout in ``out`` (its LM head rows from the
    exported policy ``tensors``), with its manifest (``drafters.export.export_eagle3``)."""
    policy = head_target(tensors, source.config)
    head = trained_head(source.drafter, source.cfg, policy)
    with tempfile.TemporaryDirectory(prefix=".head-", dir=out.parent) as tmp:
        try:  # the source named is the checkpoint's file, not the temporary head directory
            export_eagle3(save_head(head, tmp), policy, out, source=str(source.drafter))
        except ExportError as e:
            raise ModelExportError(f"--merge-drafter: {e}") from None


# --------------------------------------------------------------------------- export


def export_model(
    run_dir: str | os.PathLike,
    out: str | os.PathLike,
    step: int | None = None,
    merge_drafter: bool = False,
    shard_size: int = DEFAULT_SHARD_SIZE,
) -> Path:
    """Write the HF model directory ``out`` (see the module docstring); returns it."""
    check_out(out)
    source = resolve_export(run_dir, step, merge_drafter)
    return write_export(source, Path(out), shard_size)


def write_export(source: ExportSource, out: Path, shard_size: int = DEFAULT_SHARD_SIZE) -> Path:
    """``export_model``'s writing, from inputs ``resolve_export`` checked (``check_out`` too)."""
    tensors = read_policy(source.ckpt, source.config)
    check_room(out, tensors)
    with staged_dir(out) as tmp:
        write_model_files(tmp, source.config, tensors, source.model_dir, source.generation,
                          shard_size)  # fmt: skip
        if source.drafter is not None:
            write_drafter(source, tensors, tmp / DRAFTER_DIR)
    return out


def check_room(out: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """``ModelExportError`` unless ``out``'s disk holds ``tensors`` (before a byte is written)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    needed = sum(t.numel() * t.element_size() for t in tensors.values())
    if problem := room_problem(out, needed):
        raise ModelExportError(problem)


def write_model_files(
    folder: Path,
    config: ModelConfig,
    tensors: Mapping[str, torch.Tensor],
    model_dir: Path,
    generation: dict[str, Any],
    shard_size: int = DEFAULT_SHARD_SIZE,
) -> None:
    """A Hugging Face model directory's files in ``folder``: config.json (in the weights'
    dtype), ``generation``, ``model_dir``'s tokenizer files and the HF-named ``tensors``."""
    dtype = tensors["model.embed_tokens.weight"].dtype
    (folder / "config.json").write_text(json.dumps(hf_config(config, dtype), indent=1))
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=1))
    _copy_tokenizer(model_dir, folder)
    write_weights(tensors, folder, shard_size)


@contextlib.contextmanager
def staged_dir(out: Path) -> Iterator[Path]:
    """A fresh hidden directory beside ``out`` to write into; on a clean exit every file in it
    is fsynced and it is renamed to ``out`` (an empty ``out`` is replaced), on an exception it
    is removed and ``out`` left as it was."""
    tmp = out.with_name(f".{out.name}.export-{uuid.uuid4().hex[:8]}.tmp")
    tmp.mkdir()
    try:
        yield tmp
        for path in _tree(tmp):
            fsync_path(path)
        tmp.rename(out)  # over an empty directory; one filled since fails here
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _tree(folder: Path) -> Iterator[Path]:
    """Every file and directory under ``folder``, deepest first, ``folder`` last."""
    yield from sorted(folder.rglob("*"), key=lambda p: -len(p.parts))
    yield folder
