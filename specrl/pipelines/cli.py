"""CLI of the training pipeline: ``specrl train`` and ``specrl report``.

``register(app)`` adds both to the main Typer app. ``specrl train`` (``--config``, ``--set``,
``--run-dir``, ``--resume RUN_DIR``) checks config, run dir, model, task and drafter before any
work (a bad value: one ``error: ...`` line, exit code 2), never overwrites a used run dir,
resumes from the newest checkpoint that verifies and prints the summary with the measured
speedup; a failed weight-sync check exits 1, SIGINT/SIGTERM checkpoints the step in progress
and exits 130/143; ``cluster.rollout_workers > 0`` runs it on Ray. ``specrl report RUN_DIR
[--out DIR] [--compare RUN]...``: PNG plots and summary.md, its settings read like every
command's (``cli_util.Shortcuts`` over ``config_commands.ReportCfg``: ``--config``, the options,
``--set report.key=value``). Details: docs/internals.md.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from specrl.cli_util import Shortcuts, fail
from specrl.config import Config, ConfigError
from specrl.config_commands import ReportCfg
from specrl.pipelines.manifest import RunDirError
from specrl.pipelines.runconfig import require_writable_dir, resolve_config

if TYPE_CHECKING:
    from specrl.pipelines.build import RunParts
    from specrl.pipelines.signals import Stopped


def train_command(
    config: Annotated[Path | None, typer.Option("--config", help="TOML run config")] = None,
    sets: Annotated[
        list[str] | None, typer.Option("--set", help="override: section.key=value (repeatable)")
    ] = None,
    preset: Annotated[
        str | None,
        typer.Option(
            "--preset",
            help="start from a shipped config (--config and --set apply over it): "
            "'reasoning' = step-by-step answers with long, variable lengths and a tail of "
            "few live rows; 'dapo-math' = the published workload: DAPO-Math-17K's columns, the "
            "math reward, long replies (set model.name and env.train_file to your copies) "
            "(docs/training.md)",
        ),
    ] = None,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="run directory")] = None,
    resume: Annotated[
        Path | None, typer.Option("--resume", help="continue the run in RUN_DIR")
    ] = None,
    compare: Annotated[
        bool, typer.Option("--compare/--no-compare", help="measure speedup vs plain at the end")
    ] = True,
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
    device: Annotated[
        str | None,
        typer.Option(
            "--device",
            help="where the policy, engine and learner run: auto (CUDA when present), cpu, "
            "cuda or cuda:N; the same as --set model.device=... (this one wins)",
        ),
    ] = None,
) -> None:
    """Post-train the policy with GRPO; rollouts are generated speculatively (lossless)."""
    from specrl.malloc import keep_freed_memory
    from specrl.models.checkpoints import CheckpointError
    from specrl.pipelines.build import build_run
    from specrl.pipelines.train_workers import TrainWorkerDied

    keep_freed_memory()  # the learner reuses its freed activations (specrl.malloc)
    try:
        sets = [*(sets or []), *([f"model.device={device}"] if device is not None else [])]
        cfg, target = resolve_config(config, sets, run_dir, resume, preset)
        parts = None if cfg.cluster.rollout_workers > 0 else build_run(cfg)
        if parts is None:  # built by the learner actor; what can be checked first is
            from specrl.pipelines.ray_run import precheck

            precheck(cfg)
    except (ConfigError, CheckpointError, ValueError) as e:
        fail(str(e))
    except TrainWorkerDied as e:  # a train worker died while the run was being built
        fail(str(e), code=1)
    except KeyboardInterrupt:
        typer.echo("stopped by SIGINT before training started; nothing to save", err=True)
        raise typer.Exit(130) from None
    typer.echo(f"run dir: {target}  (spec={cfg.rollout.spec}, k={cfg.rollout.num_spec_tokens}, "
               f"pipeline={cfg.pipeline.mode})")  # fmt: skip
    for note in parts.notes if parts is not None else ():
        typer.echo(note, err=True)
    try:
        if parts is None:  # the learner and the rollout workers run as Ray actors
            ray_and_report(cfg, target, resume is not None, compare, progress)
        else:
            run_and_report(parts, target, resume is not None, compare, progress)
    except KeyboardInterrupt:  # only outside training's own handlers: no step is cut short
        typer.echo(f"stopped by SIGINT; continue with: specrl train --resume {target}", err=True)
        raise typer.Exit(130) from None
    finally:
        if parts is not None:
            parts.close()


NOTES = ("checkpoint ", "checkpoints ", "warning")  # console lines that go to stderr


def console_line(line: str) -> None:
    """Print a training run's console line above the progress bar: a note about damaged
    checkpoints or a warning on stderr, step and eval lines on stdout."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr if line.startswith(NOTES) else sys.stdout)


def run_and_report(
    parts: RunParts, target: Path, resume: bool, compare: bool, progress: bool
) -> None:
    """``run_training`` and its summary (``report``)."""

    from specrl.pipelines.train import run_training

    report(lambda: run_training(parts, str(target), resume=resume, compare_plain=compare,
                                progress=progress, echo=console_line), target)  # fmt: skip


def ray_and_report(cfg: Config, target: Path, resume: bool, compare: bool, progress: bool) -> None:
    """``ray_run.run_training_on_ray`` and its summary (``report``); a bad model or config
    found by the learner actor is one ``error:`` line (exit code 2), as before any work."""

    from specrl.models.checkpoints import CheckpointError
    from specrl.pipelines.ray_run import run_training_on_ray

    def produce() -> dict[str, Any]:
        try:
            return run_training_on_ray(cfg, str(target), resume=resume, compare_plain=compare,
                                       progress=progress, echo=console_line)  # fmt: skip
        except (ConfigError, CheckpointError, ValueError) as e:  # a file or reward too
            fail(str(e))

    report(produce, target)


def report(produce: Callable[[], dict[str, Any]], target: Path) -> None:
    """Run ``produce`` (a training run returning its summary) and print the summary; a stop by
    signal, a run dir that cannot be resumed, a failed weight-sync check or a dead train worker
    ends with one line and its exit code."""
    from specrl.pipelines.guard import WeightSyncError
    from specrl.pipelines.report import summary_text
    from specrl.pipelines.signals import Stopped
    from specrl.pipelines.train_workers import TrainWorkerDied
    from specrl.rewards import RewardError

    try:
        summary = produce()
    except RunDirError as e:
        fail(str(e))
    except RewardError as e:  # the user's reward function failed: exit 2, as bad input
        fail(str(e))
    except (WeightSyncError, TrainWorkerDied) as e:  # runtime failures, not bad input
        fail(str(e), code=1)
    except Stopped as e:
        end_stopped(e, target)
    typer.echo(summary_text(summary))
    typer.echo(f"metrics: {target / 'metrics.jsonl'}; plots: specrl report {target}")


def end_stopped(stopped: Stopped, target: Path) -> NoReturn:
    """Print a stopped run's summary (a completed one has it) and its one line, and exit with
    its code; a run with steps left gets the command that continues it."""
    from specrl.pipelines.report import summary_text

    if stopped.summary is not None:
        typer.echo(summary_text(stopped.summary))
    hint = "" if stopped.complete else f"; continue with: specrl train --resume {target}"
    typer.echo(f"{stopped}{hint}", err=True)
    raise typer.Exit(stopped.exit_code) from None


# report's options kept beside --config/--set, each the same as one key (giving both is refused).
REPORT = Shortcuts(
    ReportCfg,
    "report",
    {"out": ("--out", "report.out"), "compare": ("--compare", "report.compare")},
)


def report_command(
    ctx: typer.Context,
    run_dir: Annotated[Path, typer.Argument(help="a run directory")],
    config: Annotated[Path | None, REPORT.config_option()] = None,
    sets: Annotated[
        list[str] | None, REPORT.set_option("report.out=plots, report.compare=['runs/b']")
    ] = None,
    out: Annotated[Path | None, REPORT.option("out", "output dir (default RUN_DIR)")] = None,
    compare: Annotated[
        list[Path] | None,
        REPORT.option(
            "compare",
            "another run dir: reward curves of all runs on one plot (compare.png), x = "
            "completions trained on (repeatable; replaces the list of --config)",
        ),
    ] = None,
) -> None:
    """Write PNG plots and summary.md for a training run.

    Every run (RUN_DIR and each --compare) is read and checked before anything is written; a
    run whose metrics.jsonl logs a step twice or skips one gets one warning line (stderr and
    summary.md) and is reported with the last row of each step. Settings: defaults <- --config
    FILE <- the options <- --set report.key=value (every key: specrl.config_commands.ReportCfg).
    """
    from specrl.pipelines.report import read_runs, write_runs

    given = REPORT.read(ctx)
    cfg = given.cfg.report
    others = [Path(p).expanduser() for p in cfg.compare]
    dest = Path(cfg.out).expanduser() if cfg.out is not None else run_dir
    try:
        require_writable_dir(dest, given.name("report.out") if cfg.out is not None else "RUN_DIR")
        runs = read_runs([run_dir, *others])
        for run in runs:
            if run.warning is not None:
                typer.echo(run.warning, err=True)
        paths = write_runs(runs, dest, compare=bool(others))
    except ValueError as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot write the report to {dest}: {e.strerror or e}")
    for p in paths:
        typer.echo(str(p))


def register(app: typer.Typer) -> None:
    """Add ``train`` and ``report`` to the main specrl CLI."""
    app.command("train")(train_command)
    app.command("report")(report_command)
