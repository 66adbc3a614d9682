"""What a run's checkpoint holds, written and read back exactly (or refused in one line).

``save_checkpoint`` writes the policy (Hugging Face names), float32 masters if any, AdamW state
(safetensors + JSON, nothing pickled), state.json (the step state, the alarm, the torch RNG,
``"format": 2``), the backend's state and a drafter trainer's files, through
``manifest.write_atomically``; ``weights_only=True`` (a run's final checkpoint under
``run.final_checkpoint = 'weights'``) leaves out the AdamW state and masters (state.json says
``"weights_only": true``): it exports, it does not resume; ``save_run_checkpoint`` writes
train workers' DCP checkpoint (``learner/``, its manifest's sha256 in ``learner.json``) in place
of the policy and AdamW files.
``read_checkpoint`` verifies and parses everything first (``CheckpointDamaged``);
``apply_checkpoint`` restores in place (``RunDirError`` when it does not fit), ``apply_to_learner``
whichever way the run trains; ``load_checkpoint`` is read + apply. Details: docs/internals.md.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from specrl.errors import one_line
from specrl.fsutil import MANIFEST, file_digest
from specrl.models.checkpoints import hf_state_dict, load_state
from specrl.pipelines.manifest import (
    DEL_SUFFIX,
    FORMAT,
    REQUIRED,
    SHARDED,
    SHARDED_MARK,
    WEIGHTS_ONLY,
    CheckpointDamaged,
    RunDirError,
    checkpoint_step,
    parse_file,
    verify_manifest,
    write_atomically,
)
from specrl.pipelines.train_workers import TrainGroup
from specrl.rl.learner import Learner
from specrl.rl.sharded_checkpoint import (
    IMPLEMENTATION_KEYS,
    ShardedCheckpointError,
    load_learner,
    save_learner,
)

BACKEND = "backend.json"
MASTERS = "masters.safetensors"
DRAFTER = "drafter.safetensors"


class Savable(Protocol):
    """Something that writes its own files into a checkpoint (a drafter trainer)."""

    def save(self, path: Path) -> list[Path]: ...


# --------------------------------------------------------------------------- optimizer


def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors for safetensors, JSON-able rest) of ``opt.state_dict()``."""
    sd = opt.state_dict()
    tensors, keys = {}, {}
    for idx, state in sd["state"].items():
        keys[str(idx)] = {}
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{name}"] = value.detach().contiguous()
                keys[str(idx)][name] = "tensor"
            else:
                keys[str(idx)][name] = value
    return tensors, {"param_groups": sd["param_groups"], "state": keys}


def optimizer_state(tensors: Mapping[str, torch.Tensor], meta: dict) -> dict[str, Any]:
    """The ``opt.state_dict()`` that ``optimizer_tensors`` split (``KeyError``/``TypeError``/
    ``AttributeError`` on a malformed ``meta``)."""
    state = {}
    for idx, entries in meta["state"].items():
        state[int(idx)] = {
            name: tensors[f"{idx}.{name}"] if value == "tensor" else value
            for name, value in entries.items()
        }
    groups = [g | {"betas": tuple(g["betas"])} if "betas" in g else g for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def _stepped(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in state-dict index order."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def master_tensors(
    policy: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """The optimizer's parameters that are not ``policy``'s own (float32 masters of a bf16
    policy), keyed by their state-dict index; empty when it steps the policy itself."""
    own = {id(p) for p in policy.parameters()}
    params = _stepped(optimizer)
    return {str(i): p.detach().contiguous() for i, p in enumerate(params) if id(p) not in own}


@torch.no_grad()
def restore_masters(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    masters: Mapping[str, torch.Tensor],
) -> None:
    """Copy saved ``masters`` into the optimizer's parameters (``ValueError`` on a shape or
    index that does not fit); without saved ones, separate masters take the policy's values."""
    params = _stepped(optimizer)
    if not masters:
        for p, m in zip(policy.parameters(), params, strict=False):
            if p is not m:
                m.copy_(p)
        return
    for key, value in masters.items():
        if not key.isdigit() or int(key) >= len(params) or params[int(key)].shape != value.shape:
            raise ValueError(f"{MASTERS}: tensor {key!r} {tuple(value.shape)} fits no parameter")
        params[int(key)].copy_(value)


# --------------------------------------------------------------------------- save


def rng_state() -> str:
    return torch.get_rng_state().numpy().tobytes().hex()


def _policy_files(
    tmp: Path, policy: torch.nn.Module, optimizer: torch.optim.Optimizer, weights_only: bool
) -> list[str]:
    """A one-process learner's files in ``tmp``: the policy, AdamW state, masters if any (the
    policy alone when ``weights_only``)."""
    save_file(hf_state_dict(policy), str(tmp / "policy.safetensors"))
    if weights_only:
        return ["policy.safetensors"]
    tensors, meta = optimizer_tensors(optimizer)
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    (tmp / "optimizer.json").write_text(json.dumps(meta))
    masters = master_tensors(policy, optimizer)
    if masters:
        save_file(masters, str(tmp / MASTERS))
    return [n for n in REQUIRED if n != "state.json"] + ([MASTERS] if masters else [])


def _sharded_files(tmp: Path, group: TrainGroup) -> list[str]:
    """The train workers' DCP checkpoint in ``tmp/learner`` and the mark naming it."""
    group.save(tmp / SHARDED)
    digest = file_digest(tmp / SHARDED / MANIFEST)["sha256"]
    mark = {"workers": group.world, "manifest_sha256": digest}
    (tmp / SHARDED_MARK).write_text(json.dumps(mark))
    return [SHARDED_MARK]


def _write_files(
    tmp: Path,
    learner_files: Callable[[Path], list[str]],
    state: Mapping[str, Any],
    backend_state: Mapping[str, Any] | None,
    drafter: Savable | None = None,
) -> list[str]:
    """Write a checkpoint's files into ``tmp`` (the learner's through ``learner_files``);
    their names."""
    names = learner_files(tmp)
    marked = dict(state) | {"format": FORMAT, "torch_rng": rng_state()}
    (tmp / "state.json").write_text(json.dumps(marked))
    names.append("state.json")
    if backend_state:
        (tmp / BACKEND).write_text(json.dumps(dict(backend_state)))
        names.append(BACKEND)
    if drafter is not None:
        names += [p.name for p in drafter.save(tmp / DRAFTER)]
    return names


def save_checkpoint(
    ckpt: Path,
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: Mapping[str, Any],
    backend_state: Mapping[str, Any] | None = None,
    drafter: Savable | None = None,
    weights_only: bool = False,
) -> Path:
    """Write a complete checkpoint directory atomically (``manifest.write_atomically``). A
    failure while writing (a full disk) removes ``step_N.tmp`` and leaves ``step_N`` as it was;
    one between the renames leaves both copies for ``RunDir.recover_interrupted``;
    ``weights_only``: no optimizer state (see the module docstring)."""
    files = partial(_policy_files, policy=policy, optimizer=optimizer, weights_only=weights_only)
    marked = dict(state) | ({WEIGHTS_ONLY: True} if weights_only else {})
    return _commit(ckpt, files, marked, backend_state, drafter)


def save_run_checkpoint(
    ckpt: Path,
    learner: Learner | TrainGroup,
    state: Mapping[str, Any],
    backend_state: Mapping[str, Any] | None = None,
    drafter: Savable | None = None,
    weights_only: bool = False,
) -> Path:
    """``save_checkpoint`` of a run's learner: a one-process one's files, or the train
    workers' DCP checkpoint (``learner/``, named by ``learner.json``) for a ``TrainGroup``
    (always whole: ``weights_only`` is for one process, the config refuses it with workers)."""
    if not isinstance(learner, TrainGroup):
        return save_checkpoint(ckpt, learner.model, learner.optimizer, state, backend_state,
                               drafter, weights_only)  # fmt: skip
    if weights_only:
        raise ValueError("a weights-only checkpoint of train workers is not supported")
    return _commit(ckpt, partial(_sharded_files, group=learner), state, backend_state, drafter)


def _commit(
    ckpt: Path,
    learner_files: Callable[[Path], list[str]],
    state: Mapping[str, Any],
    backend_state: Mapping[str, Any] | None,
    drafter: Savable | None,
) -> Path:
    """``write_atomically`` of ``_write_files``."""
    write = partial(_write_files, learner_files=learner_files, state=state,
                    backend_state=backend_state, drafter=drafter)  # fmt: skip
    return write_atomically(ckpt, write)


# --------------------------------------------------------------------------- verify / load


@dataclass
class CheckpointData:
    """A checkpoint read and checked, nothing applied yet."""

    path: Path
    policy: dict[str, torch.Tensor]
    optimizer: dict[str, Any]  # for ``Optimizer.load_state_dict``
    state: dict[str, Any]  # state.json without the RNG
    rng: torch.Tensor
    backend: dict[str, Any]
    drafter: Path | None = None  # a learned drafter's training state, verified, not yet read
    masters: dict[str, torch.Tensor] = field(default_factory=dict)  # float32 masters, if any
    sharded: Path | None = None  # train workers' DCP checkpoint (then no policy/optimizer)
    weights_only: bool = False  # the policy without optimizer state: exports, never resumes


def _json(path: Path) -> Any:
    return json.loads(path.read_bytes())


def _state(path: Path) -> tuple[dict[str, Any], torch.Tensor]:
    state = _json(path)
    if not isinstance(state.get("step"), int) or not isinstance(state.get("policy_version"), int):
        raise ValueError("no integer 'step' and 'policy_version'")
    state.pop("format", None)
    if not isinstance(state.setdefault(WEIGHTS_ONLY, False), bool):
        raise ValueError(f"{WEIGHTS_ONLY!r} is not a boolean")
    raw = np.frombuffer(bytes.fromhex(state.pop("torch_rng")), np.uint8).copy()
    return state, torch.from_numpy(raw)


def read_checkpoint(ckpt: Path) -> CheckpointData:
    """Verify and parse the checkpoint in ``ckpt`` (``CheckpointDamaged`` on any damage)."""
    sharded = ckpt / SHARDED if SHARDED_MARK in verify_manifest(ckpt) else None
    state, rng = parse_file(ckpt, "state.json", _state)
    weights_only = state.pop(WEIGHTS_ONLY)
    if sharded is not None:
        policy, optimizer = {}, {}
    elif weights_only:
        policy = parse_file(ckpt, "policy.safetensors", lambda p: load_file(str(p)))
        optimizer = {}
    else:
        policy, optimizer = _one_process_files(ckpt)
    step = checkpoint_step(ckpt)
    if step is not None and state["step"] != step:
        raise CheckpointDamaged(f"state.json: step {state['step']} in a checkpoint named {step}")
    backend = parse_file(ckpt, BACKEND, _json) if (ckpt / BACKEND).exists() else {}
    if not isinstance(backend, dict):
        raise CheckpointDamaged(f"{BACKEND}: not a JSON object")
    drafter = ckpt / DRAFTER if (ckpt / DRAFTER).is_file() else None
    masters = (
        parse_file(ckpt, MASTERS, lambda p: load_file(str(p))) if (ckpt / MASTERS).exists() else {}
    )
    return CheckpointData(ckpt, policy, optimizer, state, rng, backend, drafter, masters, sharded,
                          weights_only)  # fmt: skip


def _one_process_files(ckpt: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(policy tensors, optimizer state dict) of a one-process learner's checkpoint."""
    policy = parse_file(ckpt, "policy.safetensors", lambda p: load_file(str(p)))
    opt_tensors = parse_file(ckpt, "optimizer.safetensors", lambda p: load_file(str(p)))
    optimizer = parse_file(ckpt, "optimizer.json", lambda p: optimizer_state(opt_tensors, _json(p)))
    return policy, optimizer


def load_optimizer(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``, keeping the optimizer's implementation flags."""
    keep = [{k: g[k] for k in IMPLEMENTATION_KEYS if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, flags in zip(optimizer.param_groups, keep, strict=True):
        group.update(flags)


def apply_checkpoint(
    data: CheckpointData, policy: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore policy, optimizer, masters and torch RNG from ``data``; return (its state, the
    backend state). A checkpoint that does not fit this model or optimizer is a ``RunDirError``."""
    try:
        load_state(policy, data.policy)
        load_optimizer(optimizer, data.optimizer)
        restore_masters(policy, optimizer, data.masters)
        torch.set_rng_state(data.rng)
    except (ValueError, KeyError, RuntimeError) as e:
        raise RunDirError(f"checkpoint {data.path} does not fit this run: {one_line(e)}") from None
    return dict(data.state), dict(data.backend)


def apply_to_learner(
    data: CheckpointData, learner: Learner | TrainGroup
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``apply_checkpoint`` for a run's learner, whichever wrote it: one process or N train
    workers (DCP reshards N -> M or one process; a one-process checkpoint reaches train
    workers as a DCP checkpoint made from it beside the run's checkpoints, then removed: named
    ``step_N.reshard-*.del``, so a crash's leftover is cleared as any removal's)."""
    try:
        if data.sharded is not None:
            _load_sharded(learner, data.sharded)
        elif isinstance(learner, TrainGroup):
            one = learner.one_process()
            apply_checkpoint(data, one.model, one.optimizer)
            scratch = {"prefix": f"{data.path.name}.reshard-", "suffix": DEL_SUFFIX}
            with tempfile.TemporaryDirectory(**scratch, dir=data.path.parent) as tmp:
                save_learner(one, Path(tmp) / SHARDED)
                learner.load(Path(tmp) / SHARDED)
        else:
            return apply_checkpoint(data, learner.model, learner.optimizer)
    except ShardedCheckpointError as e:
        raise RunDirError(f"checkpoint {data.path} does not fit this run: {e}") from None
    torch.set_rng_state(data.rng)
    return dict(data.state), dict(data.backend)


def _load_sharded(learner: Learner | TrainGroup, path: Path) -> None:
    """A DCP learner checkpoint into a one-process learner or the train workers."""
    if isinstance(learner, TrainGroup):
        learner.load(path)
    else:
        load_learner(learner, path)


def load_checkpoint(
    ckpt: Path,
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``read_checkpoint`` then ``apply_checkpoint``."""
    return apply_checkpoint(read_checkpoint(ckpt), policy, optimizer)
