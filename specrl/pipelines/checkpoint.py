"""Run directories and checkpoints: everything needed to continue a run exactly.

Layout of a run directory::

    config.toml                 the resolved config (``Config.to_toml``)
    metrics.jsonl               one JSON object per RL step (``step`` = 0-based step index)
    eval.jsonl                  one JSON object per evaluation (``step`` = updates done before it)
    summary.json                written at the end of a run (sync pipeline)
    checkpoints/step_000020/    after 20 updates:
        policy.safetensors      the learner's float32 policy under Hugging Face names
        optimizer.safetensors   AdamW state tensors, keys "<param index>.<name>"
        optimizer.json          AdamW param groups and the state keys (no pickle anywhere)
        state.json              step, policy version, torch RNG state (hex), data-order state
        backend.json            the rollout backend's cross-step state (e.g. the suffix
                                drafter's history), if it has any

Contract:
- ``save_checkpoint`` writes into a temporary sibling and renames it, so a checkpoint directory
  is complete or absent; ``latest_checkpoint`` returns the one with the most updates.
- ``load_checkpoint`` restores policy and optimizer in place and returns ``state.json`` plus the
  backend state (``{}`` if none) for ``RolloutBackend.load_state_dict``.
- ``RunDir.truncate`` drops metric/eval rows a resumed run will produce again.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from specrl.models.checkpoints import hf_state_dict, load_state

CKPT_PREFIX = "step_"


class RunDir:
    """Paths and JSONL logs of one run directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.config = self.path / "config.toml"
        self.metrics = self.path / "metrics.jsonl"
        self.evals = self.path / "eval.jsonl"
        self.summary = self.path / "summary.json"
        self.checkpoints = self.path / "checkpoints"

    def create(self) -> RunDir:
        self.path.mkdir(parents=True, exist_ok=True)
        return self

    def is_used(self) -> bool:
        return self.path.exists() and any(self.path.iterdir())

    def append(self, log: Path, row: Mapping[str, Any]) -> None:
        with log.open("a") as f:
            f.write(json.dumps(dict(row)) + "\n")

    def rows(self, log: Path) -> list[dict[str, Any]]:
        """The log's rows; a last line cut mid-write (a killed run) is dropped, any other
        unreadable line is a ``ValueError`` naming it."""
        if not log.exists():
            return []
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        out = []
        for i, line in enumerate(lines):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                if i < len(lines) - 1:
                    raise ValueError(f"{log}: line {i + 1} is not JSON") from None
        return out

    def truncate(self, step: int) -> None:
        """Drop metric rows of steps >= ``step`` and eval rows at >= ``step`` updates."""
        for log in (self.metrics, self.evals):
            kept = [r for r in self.rows(log) if r["step"] < step]
            log.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints / f"{CKPT_PREFIX}{step:06d}"

    def latest_checkpoint(self) -> Path | None:
        """The complete checkpoint with the most updates (an interrupted save's ``.tmp``
        directory is never one)."""
        found = self.checkpoints.glob(f"{CKPT_PREFIX}[0-9]*") if self.path.exists() else []
        done = sorted(p for p in found if p.name[len(CKPT_PREFIX) :].isdigit())
        return done[-1] if done else None


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


def restore_optimizer(
    opt: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor], meta: dict
) -> None:
    state = {}
    for idx, entries in meta["state"].items():
        state[int(idx)] = {
            name: tensors[f"{idx}.{name}"] if value == "tensor" else value
            for name, value in entries.items()
        }
    groups = [g | {"betas": tuple(g["betas"])} if "betas" in g else g for g in meta["param_groups"]]
    opt.load_state_dict({"state": state, "param_groups": groups})


# --------------------------------------------------------------------------- save / load


def rng_state() -> str:
    return torch.get_rng_state().numpy().tobytes().hex()


def set_rng_state(hex_state: str) -> None:
    torch.set_rng_state(torch.from_numpy(np.frombuffer(bytes.fromhex(hex_state), np.uint8).copy()))


def save_checkpoint(
    ckpt: Path,
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: Mapping[str, Any],
    backend_state: Mapping[str, Any] | None = None,
) -> Path:
    """Write a complete checkpoint directory atomically (temp dir + rename)."""
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(hf_state_dict(policy), str(tmp / "policy.safetensors"))
    tensors, meta = optimizer_tensors(optimizer)
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    (tmp / "optimizer.json").write_text(json.dumps(meta))
    (tmp / "state.json").write_text(json.dumps(dict(state) | {"torch_rng": rng_state()}))
    if backend_state:
        (tmp / "backend.json").write_text(json.dumps(dict(backend_state)))
    shutil.rmtree(ckpt, ignore_errors=True)
    tmp.rename(ckpt)
    return ckpt


def load_checkpoint(
    ckpt: Path,
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore policy, optimizer and torch RNG from ``ckpt``; return (its state, the backend
    state)."""
    load_state(policy, load_file(str(ckpt / "policy.safetensors")))
    meta = json.loads((ckpt / "optimizer.json").read_text())
    restore_optimizer(optimizer, load_file(str(ckpt / "optimizer.safetensors")), meta)
    state = json.loads((ckpt / "state.json").read_text())
    set_rng_state(state.pop("torch_rng"))
    backend = ckpt / "backend.json"
    return state, json.loads(backend.read_text()) if backend.exists() else {}
