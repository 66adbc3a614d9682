"""A learner's weights and AdamW state saved and loaded with torch.distributed.checkpoint (DCP).

``save_learner(learner, path)`` / ``load_learner(learner, path)``: collectives over a
``ShardedLearner``'s group (the same ``path``, on a filesystem every rank sees), plain calls for
a one-process ``Learner``. A save writes ``<path>.tmp`` (per-rank safetensors shards,
``optimizer.json``, ``manifest.json`` last) and renames it; a load checks the manifest
(``ShardedCheckpointError`` on every rank, one line) and reshards: N ranks -> M ranks or one
process. Nothing is pickled; the reference model is not saved.
Details: docs/internals.md, docs/training.md.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    CheckpointException,
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from specrl.errors import one_line
from specrl.fsutil import TMP_SUFFIX, fsync_path, manifest_problem, replace_dir, write_manifest
from specrl.rl.learner import Learner
from specrl.rl.sharded import ShardedLearner

HYPER = "optimizer.json"
# How an optimizer runs, not what it learned: kept from this run's optimizer on resume (a
# checkpoint written on a GPU, with fused AdamW, resumes on the CPU with foreach, and back).
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable")
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # "state.<name>.<key>" entries
NO_DIST = "torch.distributed is disabled"  # DCP's warning when it runs in one process


class ShardedCheckpointError(ValueError):
    """A learner checkpoint cannot be written or used; the message is one line."""


def _group(learner: Learner) -> dist.ProcessGroup | None:
    return learner.group if isinstance(learner, ShardedLearner) else None


def _on_rank0(group: dist.ProcessGroup | None, fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0 (the only process without a group), its result on every rank; if it
    failed, every rank raises ``ShardedCheckpointError`` with the same line."""
    outcome: list[Any] = [None, None]  # [problem, result]
    if group is None or dist.get_rank(group) == 0:
        try:
            outcome[1] = fn()
        except ShardedCheckpointError as e:
            outcome[0] = str(e)
        except Exception as e:  # a full disk, a permission: one line on every rank
            outcome[0] = one_line(e)
    if group is not None:
        dist.broadcast_object_list(outcome, group_src=0, group=group)
    if outcome[0] is not None:
        raise ShardedCheckpointError(outcome[0])
    return outcome[1]


def _first_failure(e: CheckpointException) -> str:
    """One line of the first rank's error in DCP's exception (a ``BaseException`` whose first
    line lists only the ranks that failed)."""
    rank, (exc, _) = min(e.failures.items(), key=lambda kv: kv[0])
    return f"rank {rank}: {one_line(exc)}"


def _tied(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter name that is another's parameter (a tied weight) -> that first name."""
    first: dict[int, str] = {}
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        first.setdefault(id(p), name)
    return tied


def _state(learner: Learner) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the tensors DCP writes or reads into, by key in the files: local shards on a sharded
    learner; AdamW's other entries, ``param_groups.<name>.<key>``). Initialises AdamW's state
    (a zero step) on a learner that has not stepped yet: what a load then replaces."""
    if learner.masters is not None:
        raise ShardedCheckpointError(
            "a one-process learner with separate float32 masters (bf16_mode 'params') has no "
            "sharded checkpoint; use the run's checkpoints"
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", NO_DIST)
        model, optim = get_state_dict(learner.model, learner.optimizer, options=OPTIONS)
    tied = _tied(learner.model)
    tensors = {f"model.{k}": v for k, v in model.items() if k not in tied}
    tensors |= {f"optim.{k}": v for k, v in optim.items() if isinstance(v, torch.Tensor)}
    return tensors, {k: v for k, v in optim.items() if not isinstance(v, torch.Tensor)}


def save_learner(learner: Learner, path: str | Path) -> Path:
    """Write the learner's checkpoint to ``path`` atomically (see the module); an error while
    writing removes ``<path>.tmp`` and leaves ``path`` as it was."""
    path, group = Path(path), _group(learner)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    if not learner.optimizer.state:  # DCP would make AdamW state with a zero step, and save it
        raise ShardedCheckpointError(f"{path}: not saved: the learner has not stepped yet")
    tensors, hyper = _state(learner)
    _on_rank0(group, lambda: _fresh(tmp))
    try:
        writer = HuggingFaceStorageWriter(str(tmp), save_distributed=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", NO_DIST)
            dcp.save(tensors, storage_writer=writer, process_group=group, no_dist=group is None)
    except BaseException as e:  # DCP raises on every rank when one fails
        if group is None or dist.get_rank(group) == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, CheckpointException):
            raise ShardedCheckpointError(f"{path}: not saved: {_first_failure(e)}") from None
        raise
    _on_rank0(group, lambda: _finish(tmp, path, hyper))
    return path


def _fresh(tmp: Path) -> None:
    """An empty ``tmp`` (an interrupted save's leftover removed)."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


def _finish(tmp: Path, path: Path, hyper: dict[str, Any]) -> None:
    """Rank 0, after every rank has written its shards: the hyperparameters, the manifest,
    the rename."""
    try:
        (tmp / HYPER).write_text(json.dumps(hyper))
        write_manifest(tmp, sorted(p.name for p in tmp.iterdir()))
        fsync_path(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, path)


def _verified(path: Path) -> dict[str, Any]:
    """The saved hyperparameters of the checkpoint in ``path``, once every file checks out."""
    if path.name.endswith(TMP_SUFFIX):
        raise ShardedCheckpointError(f"{path}: an interrupted save, not a checkpoint")
    if not path.is_dir():
        tmp = path.with_name(path.name + TMP_SUFFIX)
        left = f" (an interrupted save left {tmp.name})" if tmp.exists() else ""
        raise ShardedCheckpointError(f"{path}: no checkpoint{left}")
    problem = manifest_problem(path, exact=True)
    if problem is None and not (path / HYPER).is_file():
        problem = f"{HYPER}: missing"
    if problem is not None:
        raise ShardedCheckpointError(f"{path}: {problem}")
    hyper = json.loads((path / HYPER).read_bytes())
    if not isinstance(hyper, dict):
        raise ShardedCheckpointError(f"{path}: {HYPER}: not a JSON object")
    return hyper


def _hyperparameters(current: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    """AdamW's non-tensor entries: the saved values, but this optimizer's implementation flags
    and whatever the checkpoint lacks."""
    out = {}
    for key, value in current.items():
        if key.rsplit(".", 1)[-1] in IMPLEMENTATION_KEYS or key not in saved:
            out[key] = value
        else:
            out[key] = tuple(saved[key]) if isinstance(value, tuple) else saved[key]
    return out


def load_learner(learner: Learner, path: str | Path) -> None:
    """Restore the learner's weights and AdamW state from the checkpoint in ``path``, written
    by any number of ranks (``ShardedCheckpointError`` if it is damaged or does not fit)."""
    path, group = Path(path), _group(learner)
    saved = _on_rank0(group, lambda: _verified(path))
    tensors, hyper = _state(learner)
    reader = HuggingFaceStorageReader(str(path))
    unused = sorted(set(reader.read_metadata().state_dict_metadata))
    unused = [k for k in unused if k not in tensors]  # the same on every rank
    if unused:
        raise ShardedCheckpointError(f"{path} does not fit this learner: it has no {unused[0]}")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", NO_DIST)
            dcp.load(tensors, storage_reader=reader, process_group=group, no_dist=group is None)
    except CheckpointException as e:  # DCP raises on every rank when one fails
        raise ShardedCheckpointError(
            f"{path} does not fit this learner: {_first_failure(e)}"
        ) from None
    model = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    model |= {name: model[first] for name, first in _tied(learner.model).items()}
    optim = {k.removeprefix("optim."): v for k, v in tensors.items() if k.startswith("optim.")}
    optim |= _hyperparameters(hyper, saved)
    set_state_dict(
        learner.model, learner.optimizer, model_state_dict=model, optim_state_dict=optim,
        options=OPTIONS,
    )  # fmt: skip
