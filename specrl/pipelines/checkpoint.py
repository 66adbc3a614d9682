"""What a run's checkpoint holds, written and read back exactly (or refused in one line).

``save_checkpoint`` writes the policy (Hugging Face names), float32 masters if any, AdamW state
(safetensors + JSON, nothing pickled), state.json (the step state, the alarm, the torch RNG,
``"format": 2``), the backend's state and a drafter trainer's files, through
``manifest.write_atomically``. ``read_checkpoint`` verifies and parses everything first
(``CheckpointDamaged``); ``apply_checkpoint`` restores in place (``RunDirError`` when it does
not fit); ``load_checkpoint`` is both. Details: docs/internals.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from specrl.errors import one_line
from specrl.models.checkpoints import hf_state_dict, load_state
from specrl.pipelines.manifest import (
    FORMAT,
    REQUIRED,
    CheckpointDamaged,
    RunDirError,
    checkpoint_step,
    parse_file,
    verify_manifest,
    write_atomically,
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


def _write_files(
    tmp: Path,
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: Mapping[str, Any],
    backend_state: Mapping[str, Any] | None,
    drafter: Savable | None = None,
) -> list[str]:
    """Write a checkpoint's files into ``tmp``; their names."""
    save_file(hf_state_dict(policy), str(tmp / "policy.safetensors"))
    tensors, meta = optimizer_tensors(optimizer)
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    (tmp / "optimizer.json").write_text(json.dumps(meta))
    masters = master_tensors(policy, optimizer)
    if masters:
        save_file(masters, str(tmp / MASTERS))
    marked = dict(state) | {"format": FORMAT, "torch_rng": rng_state()}
    (tmp / "state.json").write_text(json.dumps(marked))
    names = list(REQUIRED) + ([MASTERS] if masters else [])
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
) -> Path:
    """Write a complete checkpoint directory atomically (``manifest.write_atomically``). A
    failure while writing (a full disk) removes ``step_N.tmp`` and leaves ``step_N`` as it was;
    one between the renames leaves both copies for ``RunDir.recover_interrupted``."""
    return write_atomically(
        ckpt, lambda tmp: _write_files(tmp, policy, optimizer, state, backend_state, drafter)
    )


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


def _json(path: Path) -> Any:
    return json.loads(path.read_bytes())


def _state(path: Path) -> tuple[dict[str, Any], torch.Tensor]:
    state = _json(path)
    if not isinstance(state.get("step"), int) or not isinstance(state.get("policy_version"), int):
        raise ValueError("no integer 'step' and 'policy_version'")
    state.pop("format", None)
    raw = np.frombuffer(bytes.fromhex(state.pop("torch_rng")), np.uint8).copy()
    return state, torch.from_numpy(raw)


def read_checkpoint(ckpt: Path) -> CheckpointData:
    """Verify and parse the checkpoint in ``ckpt`` (``CheckpointDamaged`` on any damage)."""
    verify_manifest(ckpt)
    policy = parse_file(ckpt, "policy.safetensors", lambda p: load_file(str(p)))
    opt_tensors = parse_file(ckpt, "optimizer.safetensors", lambda p: load_file(str(p)))
    optimizer = parse_file(ckpt, "optimizer.json", lambda p: optimizer_state(opt_tensors, _json(p)))
    state, rng = parse_file(ckpt, "state.json", _state)
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
    return CheckpointData(ckpt, policy, optimizer, state, rng, backend, drafter, masters)


# How an optimizer runs, not what it learned: kept from this run's optimizer on resume (a
# checkpoint written on a GPU, with fused AdamW, resumes on the CPU with foreach, and back).
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable")


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


def load_checkpoint(
    ckpt: Path,
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``read_checkpoint`` then ``apply_checkpoint``."""
    return apply_checkpoint(read_checkpoint(ckpt), policy, optimizer)
