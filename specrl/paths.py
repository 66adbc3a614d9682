"""Where specrl keeps files it makes: one small leaf module (no specrl imports).

Contract: ``cache_dir()`` is ``$SPECRL_CACHE`` or ``~/.cache/specrl`` (read at each call, so tests
may point it elsewhere); ``drafter_cache_dir(model, drafter)`` is where ``specrl train-drafter``
writes the drafter of kind ``drafter`` for ``model`` and where runs look for it by default;
``cached_drafter(model, drafter)`` is that directory when a trained drafter is there, else None.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The specrl cache directory (not created here)."""
    return Path(os.environ.get("SPECRL_CACHE", Path.home() / ".cache" / "specrl"))


def drafter_cache_dir(model: str, drafter: str) -> Path:
    """The cached drafter of kind ``drafter`` (eagle3, mtp, draft) trained for ``model``."""
    name = Path(str(model)).name.replace(".gguf", "").lower()
    return cache_dir() / "drafters" / f"{name}-{drafter}"


def cached_drafter(model: str, drafter: str) -> Path | None:
    """``drafter_cache_dir(model, drafter)`` when it holds a trained drafter (a head's
    ``head.json`` or a draft model's ``config.json``), else None."""
    path = drafter_cache_dir(model, drafter)
    return path if (path / "head.json").exists() or (path / "config.json").exists() else None
