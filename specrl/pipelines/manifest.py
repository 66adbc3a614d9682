"""Checkpoint directories committed atomically and verified against their manifest.

``write_atomically(ckpt, write)`` fills ``step_N.tmp``, fsyncs every file, writes the manifest
(size and sha256 of each) last and renames the directory into place: a checkpoint is complete
or not taken for one. ``verify_manifest`` / ``is_complete`` / ``recoverable`` check one;
damage is ``CheckpointDamaged`` naming the file (``policy.safetensors: sha256 mismatch``);
``RunDirError`` is every one-line "this run directory cannot be used".
Details: docs/internals.md.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specrl.errors import one_line
from specrl.fsutil import (
    MANIFEST,
    TMP_SUFFIX,
    file_digest,
    fsync_path,
    listed_problem,
    manifest_problem,
    naming,
    read_manifest,
    replace_dir,
    write_manifest,
)

CKPT_PREFIX = "step_"
DEL_SUFFIX = ".del"  # a checkpoint being removed by retention (never recovered)
FORMAT = 2  # state.json's "format" in checkpoints that always have a manifest (absent before)
REQUIRED = ("policy.safetensors", "optimizer.safetensors", "optimizer.json", "state.json")
SHARDED = "learner"  # a sharded learner's DCP checkpoint (a folder with its own manifest)
SHARDED_MARK = "learner.json"  # {"workers": N, "manifest_sha256": of SHARDED's manifest}
SHARDED_REQUIRED = (SHARDED_MARK, "state.json")
WEIGHTS_ONLY = "weights_only"  # state.json's flag of a checkpoint without optimizer state
WEIGHTS_REQUIRED = ("policy.safetensors", "state.json")


class RunDirError(ValueError):
    """A run directory (a log, a checkpoint) cannot be used; the message is one line."""


class CheckpointDamaged(RunDirError):
    """One checkpoint failed verification; the message names the file and the damage."""


def checkpoint_step(path: Path) -> int | None:
    """N for a directory named ``step_N`` (digits only), else None."""
    suffix = path.name[len(CKPT_PREFIX) :]
    ok = path.name.startswith(CKPT_PREFIX) and suffix.isdigit() and path.is_dir()
    return int(suffix) if ok else None


# --------------------------------------------------------------------------- write


def write_atomically(ckpt: Path, write: Callable[[Path], list[str]]) -> Path:
    """Write the checkpoint ``ckpt`` through ``write`` (see the module docstring)."""
    tmp = ckpt.with_name(ckpt.name + TMP_SUFFIX)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with naming(tmp):  # a library's "(os error 28)": an OSError naming the checkpoint
            write_manifest(tmp, write(tmp))
        fsync_path(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, ckpt)  # a checkpoint there goes to ``.old`` first, removed after
    return ckpt


def verify_manifest(ckpt: Path) -> dict[str, tuple[int, str]]:
    """Check every file the manifest lists (size, then sha256); the listing. Without a
    manifest: damaged if state.json carries the ``format`` marker (every checkpoint that has it
    was written with a manifest), else an older specrl's checkpoint, which passes here (an
    empty listing) and is checked by parsing alone."""
    path = ckpt / MANIFEST
    if not path.exists():
        if _format(ckpt) >= FORMAT:
            raise CheckpointDamaged(f"{MANIFEST}: missing")
        return {}
    listed = read_manifest(ckpt)
    if isinstance(listed, str):
        raise CheckpointDamaged(listed)
    sharded = SHARDED_MARK in listed
    weights = not sharded and _weights_only(ckpt)  # state.json's hash is checked below
    for name in SHARDED_REQUIRED if sharded else WEIGHTS_REQUIRED if weights else REQUIRED:
        if name not in listed:
            raise CheckpointDamaged(f"{MANIFEST}: does not list {name}")
    problem = listed_problem(ckpt, listed)
    if problem is None and sharded:
        problem = _sharded_problem(ckpt)
    if problem is not None:
        raise CheckpointDamaged(problem)
    return listed


def _sharded_problem(ckpt: Path) -> str | None:
    """``None`` when the sharded learner's folder is the one ``SHARDED_MARK`` names (its
    manifest's sha256) and every file in it checks out, else one line naming what is wrong."""
    try:
        wanted = json.loads((ckpt / SHARDED_MARK).read_bytes())["manifest_sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{SHARDED_MARK}: unreadable"
    inner = ckpt / SHARDED
    problem = manifest_problem(inner, exact=True)
    if problem is None and file_digest(inner / MANIFEST)["sha256"] != wanted:
        problem = f"{MANIFEST}: not the one {SHARDED_MARK} names"
    return None if problem is None else f"{SHARDED}/{problem}"


def is_complete(ckpt: Path) -> bool:
    """Whether ``ckpt`` is what a finished ``write_atomically`` leaves: a manifest, and every
    file it lists matching it (files are hashed, not parsed)."""
    return (ckpt / MANIFEST).is_file() and _verifies(ckpt)


def recoverable(leftover: Path) -> bool:
    """Whether an interrupted replace's copy may become ``step_N``: a ``.tmp`` needs its
    manifest (written last) and every file to match; an ``.old`` (once a committed checkpoint,
    maybe from before manifests) needs ``verify_manifest``."""
    if not leftover.is_dir() or not leftover.stem[len(CKPT_PREFIX) :].isdigit():
        return False
    return is_complete(leftover) if leftover.suffix == TMP_SUFFIX else _verifies(leftover)


def _verifies(ckpt: Path) -> bool:
    """Whether ``verify_manifest`` passes."""
    try:
        verify_manifest(ckpt)
    except CheckpointDamaged:
        return False
    return True


def _weights_only(ckpt: Path) -> bool:
    """Whether state.json says the checkpoint holds no optimizer state (``WEIGHTS_ONLY``)."""
    try:
        return json.loads((ckpt / "state.json").read_bytes()).get(WEIGHTS_ONLY) is True
    except (OSError, ValueError, AttributeError):
        return False


def _format(ckpt: Path) -> int:
    """state.json's ``format`` marker; 0 when absent or unreadable (parsing reports that)."""
    try:
        found = json.loads((ckpt / "state.json").read_bytes()).get("format", 0)
    except (OSError, ValueError, AttributeError):
        return 0
    return found if isinstance(found, int) else 0


def parse_file(ckpt: Path, name: str, parse: Callable[[Path], Any]) -> Any:
    """``parse(path)``, any failure (a missing or unreadable file) as ``CheckpointDamaged``."""
    path = ckpt / name
    if not path.is_file():
        raise CheckpointDamaged(f"{name}: missing")
    try:
        return parse(path)
    except Exception as e:  # safetensors, json, and malformed-content errors of every kind
        raise CheckpointDamaged(f"{name}: {one_line(e)}") from None
