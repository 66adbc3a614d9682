"""The Python API: ``specrl.train(config, reward_funcs=..., dataset=...)``, the run ``specrl
train`` makes, from Python.

Contract: ``train(config=None, *, reward_funcs=None, dataset=None, overrides=(), preset=None,
run_dir=None, resume=None, compare=True, progress=True, echo=print) -> Path`` resolves the config
(a ``Config``, a dict in the TOML's shape, or a TOML path; ``overrides`` as ``--set``; ``preset``
as ``--preset``) and the run directory exactly as the CLI does (``pipelines.runconfig``), builds
the run and trains it (``run_training``); it returns the run directory. ``reward_funcs``: names
as ``reward.funcs`` takes them or callables in TRL's convention, used as given and recorded in
config.toml by ``reward_spec`` (``package.module:fn`` or ``/abs/file.py:fn``, so ``specrl train
--resume`` rebuilds them; ``python:<name>`` for a callable that cannot be named, which a resume
refuses unless it is handed to ``specrl.train`` again). ``dataset``: a path
(``env.kind='file'``, made absolute) or a ``datasets.Dataset`` (saved into ``RUN/dataset``
with ``save_to_disk`` and read from there, so the run directory holds what it trained on).
Errors are the CLI's ``ValueError``s (one line); a failed reward is a ``RewardError``. Same
seed, same config: the same metrics as the CLI.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specrl.config import Config, validate_config
from specrl.pipelines.runconfig import resolve_config, with_run_dir
from specrl.pipelines.rundir import RunDir
from specrl.pipelines.scoring import UNNAMED
from specrl.rewards import reward_name


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
    sets = [*overrides, *_dataset_sets(dataset), *_reward_sets(names)]
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
    """The rewards as config.toml names them (``reward_spec``), and, if any is a callable, the
    whole list as given to ``build_run``."""
    if not funcs:
        return [], []
    names = [f if isinstance(f, str) else reward_spec(f) for f in funcs]
    return names, ([] if all(isinstance(f, str) for f in funcs) else list(funcs))


def reward_spec(fn: Callable[..., Any]) -> str:
    """How config.toml names a callable, so that a resume rebuilds it: ``package.module:fn``
    for a function of a package module, ``/abs/path/file.py:fn`` for one of a plain module or
    script (``__main__`` included: found whatever the working directory), else
    ``python:<name>`` (a lambda, a closure, a notebook's function), which a resume refuses
    unless the callable is handed to ``specrl.train`` again."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    plain = bool(module) and "." not in name and "<" not in name
    if plain and module != "__main__" and "." in module and _importable(fn, module, name):
        return f"{module}:{name}"
    source = _source_file(fn) if plain else None
    return f"{source}:{name}" if source else f"{UNNAMED}{reward_name(fn)}"


def _importable(fn: Callable[..., Any], module: str, name: str) -> bool:
    try:
        return getattr(importlib.import_module(module), name, None) is fn
    except Exception:
        return False


def _source_file(fn: Callable[..., Any]) -> str | None:
    """The absolute path of the ``.py`` file defining ``fn`` at module level, if any."""
    try:
        path = inspect.getsourcefile(fn)
    except TypeError:
        return None
    if path is None or not path.endswith(".py") or not Path(path).is_file():
        return None
    return str(Path(path).resolve())


def _reward_sets(names: list[str]) -> list[str]:
    return [f"reward.funcs={json.dumps(names)}"] if names else []


def _dataset_sets(dataset: Any) -> list[str]:
    """The overrides of a dataset: its absolute path, or (a ``datasets.Dataset``) a
    placeholder ``_with_saved_dataset`` replaces, so the file settings apply either way."""
    if dataset is None:
        return []
    path = Path(dataset).resolve() if isinstance(dataset, str | Path) else SAVED_PLACEHOLDER
    return ['env.kind="file"', f"env.train_file={json.dumps(str(path))}"]


SAVED_PLACEHOLDER = "<the datasets.Dataset given to specrl.train>"


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
    data.setdefault("env", {}).update(kind="file", train_file=str(path.resolve()))
    return with_run_dir(validate_config(data), target)
