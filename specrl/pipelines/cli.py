"""CLI of the training pipeline: ``specrl train`` and ``specrl report``.

Contract: ``register(app)`` adds two commands to the main Typer app.
- ``specrl train [--config F.toml] [--set key=value ...] [--run-dir DIR] [--resume RUN_DIR]``:
  every option has a default, so ``specrl train`` alone runs the embedded default (SmolLM2,
  the default task, speculation per config). The config is validated, the model, task and
  drafter checked before any work: a bad value ends with one ``error: ...`` line and exit code 2.
  ``--resume RUN_DIR`` reads RUN_DIR/config.toml (``--set`` may override, e.g. ``run.steps``)
  and continues from its latest checkpoint. Without ``--resume`` a used run dir is never
  overwritten: the next free ``DIR-1``, ``DIR-2``, ... is taken (and printed). At the end the
  summary is printed, including the measured rollout speedup over a no-speculation rollout of
  the same prompts (``--no-compare`` skips that measurement).
- ``specrl report RUN_DIR [--out DIR]``: PNG plots and summary.md (``pipelines.report``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from specrl.cli_util import fail
from specrl.config import Config, ConfigError, load_config
from specrl.pipelines.checkpoint import RunDir


def free_run_dir(path: Path) -> Path:
    """``path`` if unused, else the first unused ``path-1``, ``path-2``, ..."""
    candidate, i = path, 0
    while candidate.exists() and any(candidate.iterdir()):
        i += 1
        candidate = path.with_name(f"{path.name}-{i}")
    return candidate


def resolve_config(
    config: Path | None, sets: list[str], run_dir: Path | None, resume: Path | None
) -> tuple[Config, Path]:
    """The validated config and the run directory (``ConfigError`` on any bad input)."""
    if resume is not None:
        if config is not None:
            raise ConfigError("--resume reads RUN_DIR/config.toml; change values with --set")
        if not (resume / "config.toml").exists():
            raise ConfigError(f"cannot resume {resume}: no config.toml there")
        if RunDir(resume).latest_checkpoint() is None:
            raise ConfigError(f"cannot resume {resume}: it holds no checkpoint")
        return with_run_dir(load_config(resume / "config.toml", sets), resume), resume
    cfg = load_config(config, sets)
    target = free_run_dir(run_dir or Path(cfg.run.run_dir))
    return with_run_dir(cfg, target), target


def with_run_dir(cfg: Config, run_dir: Path) -> Config:
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"run_dir": str(run_dir)})})


def train_command(
    config: Annotated[Path | None, typer.Option("--config", help="TOML run config")] = None,
    sets: Annotated[
        list[str] | None, typer.Option("--set", help="override: section.key=value (repeatable)")
    ] = None,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="run directory")] = None,
    resume: Annotated[
        Path | None, typer.Option("--resume", help="continue the run in RUN_DIR")
    ] = None,
    compare: Annotated[
        bool, typer.Option("--compare/--no-compare", help="measure speedup vs plain at the end")
    ] = True,
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
) -> None:
    """Post-train the policy with GRPO; rollouts are generated speculatively (lossless)."""
    from specrl.models.checkpoints import CheckpointError
    from specrl.pipelines.build import build_run
    from specrl.pipelines.report import summary_text
    from specrl.pipelines.train import run_training

    try:
        cfg, target = resolve_config(config, sets or [], run_dir, resume)
        parts = build_run(cfg)
    except (ConfigError, CheckpointError, ValueError) as e:
        fail(str(e))
    typer.echo(f"run dir: {target}  (spec={cfg.rollout.spec}, k={cfg.rollout.num_spec_tokens}, "
               f"pipeline={cfg.pipeline.mode})")  # fmt: skip
    from tqdm import tqdm

    summary = run_training(parts, str(target), resume=resume is not None, compare_plain=compare,
                           progress=progress, echo=tqdm.write)  # fmt: skip
    typer.echo(summary_text(summary))
    typer.echo(f"metrics: {target / 'metrics.jsonl'}; plots: specrl report {target}")


def report_command(
    run_dir: Annotated[Path, typer.Argument(help="a run directory")],
    out: Annotated[Path | None, typer.Option("--out", help="output dir (default RUN_DIR)")] = None,
    compare: Annotated[
        list[Path] | None,
        typer.Option(
            "--compare",
            help="another run dir: reward curves of all runs on one plot "
            "(compare.png), x = completions trained on (repeatable)",
        ),
    ] = None,
) -> None:
    """Write PNG plots and summary.md for a training run."""
    from specrl.pipelines.report import write_comparison, write_report

    try:
        paths = write_report(run_dir, out)
        if compare:
            dest = out if out is not None else run_dir
            paths.append(write_comparison([run_dir, *compare], dest / "compare.png"))
    except ValueError as e:
        fail(str(e))
    for p in paths:
        typer.echo(str(p))


def register(app: typer.Typer) -> None:
    """Add ``train`` and ``report`` to the main specrl CLI."""
    app.command("train")(train_command)
    app.command("report")(report_command)
