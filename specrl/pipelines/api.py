"""The Python API: ``specrl.train(config, reward_funcs=..., dataset=...)``, the run ``specrl
train`` makes, from Python.

Contract: ``train(config=None, *, reward_funcs=None, dataset=None, overrides=(), preset=None,
run_dir=None, resume=None, compare=True, progress=True, echo=print) -> Path`` resolves the config
(a ``Config``, a dict in the TOML's shape, or a TOML path; ``overrides`` as ``--set``; ``preset``
as ``--preset``) and the run directory exactly as the CLI does (``pipelines.runconfig``), builds
the run and trains it (``run_training``); it returns the run directory. ``reward_funcs``: names
as ``reward.funcs`` takes them or callables in TRL's convention; a callable importable by its
module and name is recorded in config.toml as ``module:function`` (so ``specrl train --resume``
can rebuild it), others are used as given. ``dataset``: a path (``env.kind='file'``) or a
``datasets.Dataset`` (saved into ``RUN/dataset`` with ``save_to_disk`` and read from there, so
the run directory holds what it trained on). Errors are the CLI's ``ValueError``s (one line);
a failed reward is a ``RewardError``. Same seed, same config: the same metrics as the CLI.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specrl.config import Config, validate_config
from specrl.pipelines.runconfig import resolve_config, with_run_dir
from specrl.pipelines.rundir import RunDir


def train(
    config: Config | dict[str, Any] | str | Path | None = None,
    *,
    reward_funcs: Sequence[str | Callable[..., Any]] | None = None,
    dataset: Any = None,
    overrides: Sequence[str] = (),
    preset: str | None = None,
    run_dir: str | Path | None = None,
    resume: str | Path | None = None,
    compare: bool = True,
    progress: bool = True,
    echo: Callable[[str], None] | None = print,
) -> Path:
    """See the module docstring."""
    from specrl.malloc import keep_freed_memory
    from specrl.pipelines.build import build_run
    from specrl.pipelines.train import run_training

    names, given = _reward_specs(reward_funcs)
    sets = [*overrides, *_dataset_sets(dataset), *_reward_sets(names, given)]
    cfg, target = _resolve(config, sets, run_dir, resume, preset)
    if dataset is not None and not isinstance(dataset, str | Path):
        cfg = _with_saved_dataset(cfg, dataset, target)
    keep_freed_memory()  # as `specrl train` does (specrl.malloc)
    parts = build_run(cfg, rewards=given or None)
    try:
        for note in parts.notes:
            if echo is not None:
                echo(note)
        run_training(parts, str(target), resume=resume is not None, compare_plain=compare,
                     progress=progress, echo=echo)  # fmt: skip
    finally:
        parts.close()
    return target


def _resolve(
    config: Config | dict[str, Any] | str | Path | None,
    sets: list[str],
    run_dir: str | Path | None,
    resume: str | Path | None,
    preset: str | None,
) -> tuple[Config, Path]:
    """``runconfig.resolve_config`` over any form of ``config``."""
    data: Path | dict[str, Any] | None
    if isinstance(config, Config):
        data = config.model_dump(exclude_unset=True)
    elif isinstance(config, str | Path):
        data = Path(config)
    else:
        data = config
    run = Path(run_dir) if run_dir is not None else None
    back = Path(resume) if resume is not None else None
    return resolve_config(data, sets, run, back, preset)


def _reward_specs(
    funcs: Sequence[str | Callable[..., Any]] | None,
) -> tuple[list[str], list[str | Callable[..., Any]]]:
    """The rewards as config names where each can be named (a callable importable as
    ``module:function``), and, if any cannot, the whole list as given to ``build_run``."""
    if not funcs:
        return [], []
    specs = [f if isinstance(f, str) else _importable_name(f) for f in funcs]
    if all(s is not None for s in specs):
        return [s for s in specs if s is not None], []
    return [], list(funcs)


def _importable_name(fn: Callable[..., Any]) -> str | None:
    """``module:function`` when importing it gives ``fn`` back (not a lambda, a closure or a
    function of ``__main__``), else None."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "." in name or "<" in name:
        return None
    try:
        found = getattr(importlib.import_module(module), name, None)
    except Exception:
        return None
    return f"{module}:{name}" if found is fn else None


def _reward_sets(names: list[str], given: list[Any]) -> list[str]:
    return [f"reward.funcs={json.dumps(names)}"] if names and not given else []


def _dataset_sets(dataset: Any) -> list[str]:
    """The overrides of a dataset given as a path."""
    if dataset is None or not isinstance(dataset, str | Path):
        return []
    return ['env.kind="file"', f"env.train_file={json.dumps(str(dataset))}"]


def _with_saved_dataset(cfg: Config, dataset: Any, target: Path) -> Config:
    """``cfg`` reading ``dataset`` (a ``datasets.Dataset``) from ``target/dataset``, where it is
    saved; validated again as a whole."""
    if not hasattr(dataset, "save_to_disk"):
        raise TypeError(
            f"dataset must be a path or a datasets.Dataset, got {type(dataset).__name__}"
        )
    path = RunDir(target).dataset
    dataset.save_to_disk(str(path))
    data = cfg.model_dump(exclude_unset=True)
    data.setdefault("env", {}).update(kind="file", train_file=str(path))
    return with_run_dir(validate_config(data), target)
