"""Where a run's rows go: metrics.jsonl and eval.jsonl (the record) and, by setting, TensorBoard
and Weights & Biases, offline.

``MetricsSink``: ``write(kind, row)`` (``"train"`` or ``"eval"``) and ``close()``. ``SINKS``
registers ``jsonl`` (always), ``tensorboard`` (``run.tensorboard``: ``<run_dir>/tensorboard``)
and ``wandb`` (``run.wandb``, the wandb extra: an offline run in ``<run_dir>/wandb``), each
copying a row's numbers as ``<kind>/<key>``. ``check_tracking(cfg)`` refuses a missing extra in
one line; ``open_tracker(cfg, run, start)`` writes each row to every sink that is on, one row at
a time (both async threads write). Details: docs/internals.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from specrl.config import Config, ConfigError
from specrl.pipelines.rundir import RunDir

Kind = Literal["train", "eval"]
KINDS: tuple[Kind, ...] = ("train", "eval")
WANDB_EXTRA = "run.wandb=true needs the wandb extra: pip install -e '.[wandb]'"


class MetricsSink(Protocol):
    """Somewhere the rows of a run are written (see the module docstring)."""

    def write(self, kind: Kind, row: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def numbers(row: Mapping[str, Any]) -> dict[str, float]:
    """The row's numeric fields but ``step``, as floats (bools as 0/1)."""
    return {k: float(v) for k, v in row.items() if isinstance(v, int | float) and k != "step"}


class JsonlSink:
    """The record: metrics.jsonl and eval.jsonl (``RunDir.append``, fsynced per row)."""

    def __init__(self, run: RunDir) -> None:
        self.run = run
        self.logs = {"train": run.metrics, "eval": run.evals}

    def write(self, kind: Kind, row: Mapping[str, Any]) -> None:
        self.run.append(self.logs[kind], row)

    def close(self) -> None:
        pass


class TensorBoardSink:
    """Scalars ``<kind>/<key>`` at the row's step, in ``<run_dir>/tensorboard``."""

    def __init__(self, run: RunDir, start: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run.tensorboard), purge_step=start)

    def write(self, kind: Kind, row: Mapping[str, Any]) -> None:
        for key, value in numbers(row).items():
            self.writer.add_scalar(f"{kind}/{key}", value, global_step=row["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """An offline W&B run in ``<run_dir>/wandb``: ``<kind>/<key>`` against ``<kind>/step``."""

    def __init__(self, run: RunDir, cfg: Config) -> None:
        wandb = import_wandb()
        settings = wandb.Settings(
            mode="offline", silent=True, console="off", disable_git=True, disable_code=True,
            save_code=False, x_disable_stats=True, x_disable_meta=True,
            x_disable_machine_info=True, x_save_requirements=False, reinit="create_new",
        )  # fmt: skip
        config, name = cfg.model_dump(mode="json"), run.path.name
        self.wandb_run = wandb.init(
            dir=str(run.path), project="specrl", name=name, config=config, settings=settings
        )
        for kind in KINDS:
            self.wandb_run.define_metric(f"{kind}/step")
            self.wandb_run.define_metric(f"{kind}/*", step_metric=f"{kind}/step")

    def write(self, kind: Kind, row: Mapping[str, Any]) -> None:
        fields = {f"{kind}/{k}": v for k, v in numbers(row).items()}
        self.wandb_run.log({f"{kind}/step": row["step"]} | fields)

    def close(self) -> None:
        self.wandb_run.finish()


def import_wandb() -> Any:
    """The wandb module (``ConfigError`` naming the extra when it is not installed)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(WANDB_EXTRA) from None
    return wandb


@dataclass(frozen=True)
class SinkKind:
    """A registered sink: its name, the setting that turns it on, how it is opened, and the
    check that what it needs is installed (``ConfigError``)."""

    name: str
    on: Callable[[Config], bool]
    open: Callable[[RunDir, Config, int], MetricsSink]
    check: Callable[[], object] = lambda: None


SINKS: tuple[SinkKind, ...] = (
    SinkKind("jsonl", lambda cfg: True, lambda run, cfg, start: JsonlSink(run)),
    SinkKind("tensorboard", lambda cfg: cfg.run.tensorboard,
             lambda run, cfg, start: TensorBoardSink(run, start)),
    SinkKind("wandb", lambda cfg: cfg.run.wandb, lambda run, cfg, start: WandbSink(run, cfg),
             import_wandb),
)  # fmt: skip


def check_tracking(cfg: Config) -> None:
    """``ConfigError`` when a sink ``cfg`` turns on needs a package that is not installed."""
    for kind in SINKS:
        if kind.on(cfg):
            kind.check()


class Tracker:
    """Every sink that is on, written one row at a time (see the module docstring)."""

    def __init__(self, sinks: list[MetricsSink]) -> None:
        self.sinks = sinks
        self.lock = threading.Lock()

    def write(self, kind: Kind, row: Mapping[str, Any]) -> None:
        with self.lock:
            for sink in self.sinks:
                sink.write(kind, row)

    def close(self) -> None:
        with self.lock:
            for sink in self.sinks:
                sink.close()


def open_tracker(cfg: Config, run: RunDir, start: int) -> Tracker:
    """The sinks ``cfg`` turns on for ``run``, resumed at step ``start``."""
    opened: list[MetricsSink] = []
    try:
        for kind in SINKS:
            if kind.on(cfg):
                opened.append(kind.open(run, cfg, start))
    except BaseException:
        Tracker(opened).close()
        raise
    return Tracker(opened)
