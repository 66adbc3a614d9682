"""Run directories and checkpoints: everything needed to continue a run exactly, or to say
in one line why not.

Layout of a run directory::

    config.toml                 the resolved config (``Config.to_toml``)
    metrics.jsonl               one JSON object per RL step (``step`` = 0-based step index)
    eval.jsonl                  one JSON object per evaluation (``step`` = updates done before it)
    summary.json                written at the end of a run (``train.run_training``)
    checkpoints/step_000020/    after 20 updates:
        policy.safetensors      the learner's policy under Hugging Face names (float32, or
                                bf16 when trained with float32 masters)
        masters.safetensors     those float32 masters, keys "<param index>" (the learner's
                                bf16_mode 'params' only)
        optimizer.safetensors   AdamW state tensors, keys "<param index>.<name>"
        optimizer.json          AdamW param groups and the state keys (no pickle anywhere)
        state.json              step, policy version, torch RNG state (hex), data-order
                                state, "format": 2 (this layout, manifest included)
        backend.json            the rollout backend's cross-step state (e.g. the suffix
                                drafter's history), if it has any
        drafter.safetensors     a learned drafter trained during RL: its head and AdamW
        drafter.safetensors.json    state, and its counters (``drafters.online``), if any
        manifest.json           size and sha256 of every file above, written last

Contract:
- ``save_checkpoint`` writes every file into ``step_N.tmp`` (state.json with ``"format": 2``),
  fsyncs each file, writes the manifest last, fsyncs the directory, then renames it to
  ``step_N`` (a checkpoint already there is first renamed to ``step_N.old``, removed after) and
  fsyncs ``checkpoints/``. An error while writing (a full disk) removes ``step_N.tmp`` and is
  raised, ``step_N`` untouched. ``.tmp``/``.old`` directories are never taken for checkpoints
  (``RunDir.checkpoints_newest_first``, ``latest_checkpoint``). A process that dies between
  the two renames leaves no ``step_N`` but two good copies: ``RunDir.recover_interrupted``
  (run before a resume reads checkpoints) renames ``step_N.tmp`` back to ``step_N`` if it is
  complete (``is_complete``: manifest present, every file matching), else ``step_N.old`` if
  it verifies; ``RunDir.clear_interrupted`` then removes what is left (and the temporaries
  of an interrupted ``atomic_write`` of config.toml, the logs, summary.json).
- ``read_checkpoint`` verifies the manifest (every listed file present, same size and sha256)
  and parses every file before anything is changed; any damage raises ``CheckpointDamaged`` whose
  message names the file and what is wrong (``policy.safetensors: sha256 mismatch``). A
  checkpoint whose state.json has the ``format`` marker and no manifest is damaged
  (``manifest.json: missing``); one without either (written before manifests existed) is
  accepted when every file parses.
  ``apply_checkpoint`` restores policy, optimizer, masters and torch RNG in place and returns
  ``state.json`` (less ``format`` and the RNG) plus the backend state (``{}`` if none) for
  ``RolloutBackend.load_state_dict``; a checkpoint that does not fit the model raises
  ``RunDirError``. ``load_checkpoint`` is both.
- Masters (``master_tensors``) are the optimizer's parameters that are not the policy's own;
  they are saved bit-exact and restored into the optimizer's parameters by index. Resuming a
  checkpoint without masters into an optimizer that has them copies the policy's values into
  them (masters are in the policy's parameter order, as the learner builds them).
- ``RunDir.prune(latest, keep)`` (checkpoint retention, ``run.keep_checkpoints``) keeps the
  checkpoint just written and the newest ``keep - 1`` before it; each older one is renamed to
  ``step_N.del`` (never recovered, removed by ``clear_interrupted``) and then removed.
- ``RunDir.rows`` reads a JSONL log: a last line cut mid-write (a killed run) is dropped, any
  other unreadable line raises ``RunDirError`` naming the file and line. ``RunDir.append``
  fsyncs each row; ``RunDir.truncate`` (drop the rows a resumed run will produce again)
  replaces a log with ``fsutil.atomic_write``, never leaving it half-written.
- ``RunDirError`` (a ``ValueError``) is every one-line "this run directory cannot be used".
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from specrl.errors import one_line
from specrl.fsutil import atomic_write, fsync_path
from specrl.models.checkpoints import hf_state_dict, load_state

CKPT_PREFIX = "step_"
TMP_SUFFIX = ".tmp"  # a checkpoint being written
OLD_SUFFIX = ".old"  # a checkpoint being replaced
DEL_SUFFIX = ".del"  # a checkpoint being removed by retention (never recovered)
MANIFEST = "manifest.json"
FORMAT = 2  # state.json's "format" in checkpoints that always have a manifest (absent before)
REQUIRED = ("policy.safetensors", "optimizer.safetensors", "optimizer.json", "state.json")
BACKEND = "backend.json"
MASTERS = "masters.safetensors"
DRAFTER = "drafter.safetensors"
_CHUNK = 1 << 20


class Savable(Protocol):
    """Something that writes its own files into a checkpoint (a drafter trainer)."""

    def save(self, path: Path) -> list[Path]: ...


class RunDirError(ValueError):
    """A run directory (a log, a checkpoint) cannot be used; the message is one line."""


class CheckpointDamaged(RunDirError):
    """One checkpoint failed verification; the message names the file and the damage."""


# --------------------------------------------------------------------------- files


def file_digest(path: Path) -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex}`` of a file."""
    h, size = hashlib.sha256(), 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": h.hexdigest()}


def _checkpoint_step(path: Path) -> int | None:
    """N for a directory named ``step_N`` (digits only), else None."""
    suffix = path.name[len(CKPT_PREFIX) :]
    ok = path.name.startswith(CKPT_PREFIX) and suffix.isdigit() and path.is_dir()
    return int(suffix) if ok else None


# --------------------------------------------------------------------------- run directory


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
        """Whether the path holds anything (a file in its place counts)."""
        if not self.path.exists():
            return False
        return not self.path.is_dir() or any(self.path.iterdir())

    def append(self, log: Path, row: Mapping[str, Any]) -> None:
        with log.open("a") as f:
            f.write(json.dumps(dict(row)) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def rows(self, log: Path) -> list[dict[str, Any]]:
        """The log's rows (JSON objects with an integer ``step``); a last line cut mid-write
        (a killed run) is dropped, any other unreadable line is a ``RunDirError`` naming it."""
        if not log.exists():
            return []
        try:
            lines = log.read_bytes().split(b"\n")
        except OSError as e:
            raise RunDirError(f"cannot read {log}: {e.strerror or e}") from None
        numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
        out = []
        for k, (number, line) in enumerate(numbered):
            row = _parse_row(line)
            if row is None:
                if k < len(numbered) - 1:
                    raise RunDirError(f"{log}: line {number} is not a JSON row with a 'step'")
                continue
            out.append(row)
        return out

    def truncate(self, step: int) -> None:
        """Drop metric rows of steps >= ``step`` and eval rows at >= ``step`` updates."""
        for log in (self.metrics, self.evals):
            kept = [r for r in self.rows(log) if r["step"] < step]
            if kept or log.exists():
                atomic_write(log, "".join(json.dumps(r) + "\n" for r in kept))

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints / f"{CKPT_PREFIX}{step:06d}"

    def checkpoints_newest_first(self) -> list[Path]:
        """The checkpoint directories, most updates first (an interrupted save's ``.tmp`` or
        ``.old`` directory is never one; whether each verifies is ``read_checkpoint``'s job)."""
        if not self.checkpoints.is_dir():
            return []
        found = [(_checkpoint_step(p), p) for p in self.checkpoints.iterdir()]
        return [p for step, p in sorted((s, p) for s, p in found if s is not None)][::-1]

    def latest_checkpoint(self) -> Path | None:
        """The checkpoint directory with the most updates (see ``checkpoints_newest_first``)."""
        found = self.checkpoints_newest_first()
        return found[0] if found else None

    def leftovers(self) -> list[Path]:
        """What interrupted saves and removals left behind (``step_N.tmp``, ``step_N.old``,
        ``step_N.del``): by step, a ``.tmp`` before the ``.old`` of the same step."""
        if not self.checkpoints.is_dir():
            return []
        ends = (TMP_SUFFIX, OLD_SUFFIX, DEL_SUFFIX)
        found = [
            p
            for p in self.checkpoints.iterdir()
            if p.name.startswith(CKPT_PREFIX) and p.name.endswith(ends)
        ]
        return sorted(found, key=lambda p: (p.stem, p.suffix != TMP_SUFFIX))

    def recover_interrupted(self) -> list[Path]:
        """Finish interrupted replaces: for each ``step_N`` that is missing, its ``step_N.tmp``
        (a new save, manifest written last) if it ``is_complete``, else its ``step_N.old``
        (the checkpoint being replaced) if that verifies, is renamed to ``step_N``. Returns the
        checkpoints so recovered; the rest is left for ``clear_interrupted``."""
        recovered = []
        for leftover in self.leftovers():
            if leftover.suffix == DEL_SUFFIX:  # retention was removing it: never brought back
                continue
            ckpt = leftover.with_suffix("")
            if not ckpt.exists() and leftover.exists() and _recoverable(leftover):
                leftover.rename(ckpt)
                fsync_path(ckpt.parent)
                recovered.append(ckpt)
        return recovered

    def prune(self, latest: Path, keep: int) -> list[Path]:
        """Checkpoint retention: keep ``latest`` (the one just written) and the newest
        ``keep - 1`` checkpoints of fewer updates; remove the older ones, each renamed to
        ``step_N.del`` first (a removal cut short is never taken for a checkpoint, and
        ``clear_interrupted`` finishes it). Checkpoints of more updates than ``latest`` (left
        by a run resumed from before them) are not touched: the run replaces them when it gets
        there. Returns the removed checkpoints."""
        step = _checkpoint_step(latest)
        if step is None:
            return []
        older = [p for p in self.checkpoints_newest_first() if _checkpoint_step(p) < step]
        removed = older[max(keep - 1, 0) :]
        for ckpt in removed:
            doomed = ckpt.with_name(ckpt.name + DEL_SUFFIX)
            ckpt.rename(doomed)
            fsync_path(ckpt.parent)
            shutil.rmtree(doomed, ignore_errors=True)
        return removed

    def clear_interrupted(self) -> None:
        """Remove what interrupted saves and removals left behind (``step_N.tmp``, ``.old``,
        ``.del``) and the temporaries of an interrupted ``fsutil.atomic_write`` of the run's own
        files (``.metrics.jsonl.<random>.tmp``)."""
        for p in self.leftovers():
            shutil.rmtree(p, ignore_errors=True)
        for own in (self.config, self.metrics, self.evals, self.summary):
            for tmp in self.path.glob(f".{own.name}.*.tmp"):
                tmp.unlink(missing_ok=True)


def _recoverable(leftover: Path) -> bool:
    """A ``.tmp`` needs its manifest (written last) and every file to match; an ``.old``
    (once a committed checkpoint, maybe from before manifests) needs ``verify_manifest``."""
    if not leftover.is_dir() or not leftover.stem[len(CKPT_PREFIX) :].isdigit():
        return False
    if leftover.suffix == TMP_SUFFIX:
        return is_complete(leftover)
    try:
        verify_manifest(leftover)
    except CheckpointDamaged:
        return False
    return True


def _parse_row(line: bytes) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    ok = isinstance(row, dict) and isinstance(row.get("step"), int)
    return row if ok else None


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


def restore_optimizer(
    opt: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor], meta: dict
) -> None:
    opt.load_state_dict(optimizer_state(tensors, meta))


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


def _write_manifest(tmp: Path, names: list[str]) -> None:
    """fsync each file, then write and fsync the manifest of their sizes and digests."""
    files = {}
    for name in names:
        fsync_path(tmp / name)
        files[name] = file_digest(tmp / name)
    with (tmp / MANIFEST).open("w") as f:
        json.dump({"format": 1, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(
    ckpt: Path,
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: Mapping[str, Any],
    backend_state: Mapping[str, Any] | None = None,
    drafter: Savable | None = None,
) -> Path:
    """Write a complete checkpoint directory atomically (see the module docstring). A failure
    while writing (a full disk) removes ``step_N.tmp`` and leaves ``step_N`` as it was; one
    between the renames leaves both copies for ``RunDir.recover_interrupted``."""
    tmp = ckpt.with_name(ckpt.name + TMP_SUFFIX)
    old = ckpt.with_name(ckpt.name + OLD_SUFFIX)
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write_manifest(tmp, _write_files(tmp, policy, optimizer, state, backend_state, drafter))
        fsync_path(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _commit(tmp, ckpt, old)
    return ckpt


def _commit(tmp: Path, ckpt: Path, old: Path) -> None:
    """Rename the written ``tmp`` to ``ckpt``; a checkpoint there goes to ``old`` first and is
    removed after."""
    if ckpt.exists():
        ckpt.rename(old)
    tmp.rename(ckpt)
    fsync_path(ckpt.parent)
    shutil.rmtree(old, ignore_errors=True)


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


def verify_manifest(ckpt: Path) -> None:
    """Check every file the manifest lists (size, then sha256). Without a manifest: damaged if
    state.json carries the ``format`` marker (every checkpoint that has it was written with a
    manifest), else an older specrl's checkpoint, which passes here and is checked by parsing
    alone."""
    path = ckpt / MANIFEST
    if not path.exists():
        if _format(ckpt) >= FORMAT:
            raise CheckpointDamaged(f"{MANIFEST}: missing")
        return
    try:
        files = json.loads(path.read_bytes())["files"]
        listed = {name: (int(d["bytes"]), str(d["sha256"])) for name, d in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointDamaged(f"{MANIFEST}: unreadable") from None
    if any(Path(name).name != name or name.startswith(".") for name in listed):
        raise CheckpointDamaged(f"{MANIFEST}: lists a path outside the checkpoint")
    for name in REQUIRED:
        if name not in listed:
            raise CheckpointDamaged(f"{MANIFEST}: does not list {name}")
    for name, (size, sha) in listed.items():
        _check_file(ckpt / name, size, sha)


def is_complete(ckpt: Path) -> bool:
    """Whether ``ckpt`` is what a finished ``save_checkpoint`` leaves: a manifest, and every
    file it lists matching it (files are hashed, not parsed)."""
    if not (ckpt / MANIFEST).is_file():
        return False
    try:
        verify_manifest(ckpt)
    except CheckpointDamaged:
        return False
    return True


def _format(ckpt: Path) -> int:
    """state.json's ``format`` marker; 0 when absent or unreadable (parsing reports that)."""
    try:
        found = json.loads((ckpt / "state.json").read_bytes()).get("format", 0)
    except (OSError, ValueError, AttributeError):
        return 0
    return found if isinstance(found, int) else 0


def _check_file(path: Path, size: int, sha: str) -> None:
    if not path.is_file():
        raise CheckpointDamaged(f"{path.name}: missing")
    found = path.stat().st_size
    if found != size:
        raise CheckpointDamaged(f"{path.name}: {found} bytes, the manifest says {size}")
    if file_digest(path)["sha256"] != sha:
        raise CheckpointDamaged(f"{path.name}: sha256 mismatch")


def _parse(ckpt: Path, name: str, parse: Callable[[Path], Any]) -> Any:
    """``parse(path)``, any failure (a missing or unreadable file) as ``CheckpointDamaged``."""
    path = ckpt / name
    if not path.is_file():
        raise CheckpointDamaged(f"{name}: missing")
    try:
        return parse(path)
    except Exception as e:  # safetensors, json, and malformed-content errors of every kind
        raise CheckpointDamaged(f"{name}: {one_line(e)}") from None


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
    policy = _parse(ckpt, "policy.safetensors", lambda p: load_file(str(p)))
    opt_tensors = _parse(ckpt, "optimizer.safetensors", lambda p: load_file(str(p)))
    optimizer = _parse(ckpt, "optimizer.json", lambda p: optimizer_state(opt_tensors, _json(p)))
    state, rng = _parse(ckpt, "state.json", _state)
    step = _checkpoint_step(ckpt)
    if step is not None and state["step"] != step:
        raise CheckpointDamaged(f"state.json: step {state['step']} in a checkpoint named {step}")
    backend = _parse(ckpt, BACKEND, _json) if (ckpt / BACKEND).exists() else {}
    if not isinstance(backend, dict):
        raise CheckpointDamaged(f"{BACKEND}: not a JSON object")
    drafter = ckpt / DRAFTER if (ckpt / DRAFTER).is_file() else None
    masters = (
        _parse(ckpt, MASTERS, lambda p: load_file(str(p))) if (ckpt / MASTERS).exists() else {}
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
