"""CLI of the simulator: ``specrl simulate SCENARIO | run | calibrate | validate | list``.

``register(app)`` adds the ``simulate`` group; a first argument that is not a subcommand is a
scenario for ``run``. ``run`` prints a summary (or ``--json``) and, with ``--out DIR``, writes
result.json, gantt.png and tornado.png; ``calibrate TRACE.json`` fits a hardware profile (and a
model-free drafter's spec) to an engine trace (or a ``specrl bench gpu`` result's), reports the
held-out configs and predicts the measured rollouts beside it; ``validate`` runs the simulator
against published measurements (``specrl.sim.accuracy``), prints each table with its signed
errors and, with ``--json PATH``, writes the record (benchmarks/results/sim_validate.json)
atomically; ``list`` names the bundled specs. Every bad input, unwritable paths included, prints
one ``error: ...`` line and exits 2 before any work. ``calibrate`` and ``validate`` read their
settings as every command does (``cli_util.Shortcuts`` over ``config_commands.CalibrateCfg`` /
``ValidateCfg``): defaults <- ``--config F.toml`` <- their options (each one key; an option and
a ``--set`` of the same key in one command line are refused) <- ``--set section.key=value``;
``run`` reads a scenario with its own ``--set``. Details: docs/internals.md, docs/simulator.md
("Validation").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import click
import typer
from typer.core import TyperGroup

from specrl.cli_util import Given, Shortcuts, fail, named_as_keys, write_or_print
from specrl.config_commands import MAX_SEED, CalibrateCfg, ValidateCfg
from specrl.costmodel.errors import SimInputError
from specrl.costmodel.specs import SPEC_KINDS, list_specs, load_drafter, load_hardware, load_model
from specrl.fsutil import atomic_write, result_file_problem, writable_problem
from specrl.sim.accuracy import SECTIONS, run_validation
from specrl.sim.calibrate import fit_trace, read_calibration, write_drafter, write_profile
from specrl.sim.holdout import complement, held_out_checks, left_out, parse_rollouts
from specrl.sim.report import gantt_png, sensitivity, text_summary, tornado_png
from specrl.sim.runner import ScenarioResult, check_inputs, run_scenario
from specrl.sim.scenario import field_help, load_scenario

GROUP_HELP = """Simulate RL training with speculative rollouts.

\b
specrl simulate SCENARIO [--set KEY=VALUE ...] [--json] [--out DIR]
  (the same as: specrl simulate run SCENARIO ...)
  --set KEY=VALUE  override one scenario input; repeatable. KEY is a dotted key
                   from the list below (speculation.k, pipeline.staleness),
                   VALUE a TOML literal (5, 2.5, true, [0.8, 0.6]) or a bare
                   string (eagle3)
  --json           print the full result as JSON instead of the summary:
                   speedups and their spread over length seeds, steady-state
                   step times, phases, convergence and warnings
  --out DIR        also write result.json, gantt.png and tornado.png into DIR

A bad input (unknown scenario, key or spec, wrong type or range, GPU counts
that do not add up, a model that does not fit its GPUs, an unreadable file)
prints one 'error: ...' line on stderr and exits with code 2, before any
simulation work. Warnings (a run too short to converge) end the summary; with
--json they go to stderr as 'warning: ...' lines and into the JSON."""


def _check_writable(path: Path, what: str, kind: Literal["file", "dir"]) -> None:
    """Fail with one line unless ``path`` can be written as a ``kind`` (nothing is created)."""
    problem = writable_problem(path, kind)
    if problem:
        fail(f"{what}: {problem}")


class _ScenarioFirst(TyperGroup):
    """A group whose unknown first word is a scenario name handed to ``run``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and not args[0].startswith("-") and args[0] not in self.commands:
            args = ["run", *args]
        return super().parse_args(ctx, args)


def _inputs_epilog() -> str:
    return "Scenario inputs (override with --set KEY=VALUE):\n\n\b\n" + "\n".join(field_help())


def build_app() -> typer.Typer:
    app = typer.Typer(
        cls=_ScenarioFirst,
        no_args_is_help=True,
        rich_markup_mode=None,
        help=GROUP_HELP,
        epilog=_inputs_epilog(),
    )
    app.command("run", epilog=_inputs_epilog())(run_command)
    app.command("calibrate")(calibrate_command)
    app.command("validate")(validate_command)
    app.command("list")(list_command)
    return app


def register(app: typer.Typer) -> None:
    """Add the ``simulate`` group to the main specrl CLI."""
    app.add_typer(build_app(), name="simulate")


def run_command(
    scenario: Annotated[
        str, typer.Argument(help="scenario name (specrl simulate list) or .toml path")
    ],
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            metavar="KEY=VALUE",
            help="override one input: a dotted KEY from the list below and a TOML literal VALUE"
            " (repeatable)",
        ),
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="print the full result as JSON (speedups with their spread over length seeds,"
            " step times, phases, convergence, warnings)",
        ),
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            metavar="DIR",
            help="write result.json, gantt.png and tornado.png into this dir",
        ),
    ] = None,
    tornado: Annotated[
        bool,
        typer.Option("--tornado/--no-tornado", help="with --out: sensitivity sweep and its chart"),
    ] = True,
) -> None:
    """Simulate a scenario with and without speculation; print speedups and phase times."""
    try:
        sc = load_scenario(scenario, set_ or [])
        check_inputs(sc)
    except SimInputError as e:
        fail(str(e))
    if out is not None:
        _check_writable(out, "--out", "dir")
    res = run_scenario(sc)
    result = res.to_json()
    if as_json:
        for warning in res.warnings:
            typer.echo(f"warning: {warning}", err=True)
    if out is not None:
        try:
            out.mkdir(parents=True, exist_ok=True)
            _write_outputs(res, result, out, tornado)
        except OSError as e:
            fail(f"--out {out}: cannot write {e.filename or ''} ({e.strerror or e})")
    typer.echo(json.dumps(result, indent=2) if as_json else text_summary(res))


def _write_outputs(res: ScenarioResult, result: dict, out: Path, tornado: bool) -> None:
    """gantt.png, tornado.png (a sensitivity sweep) and result.json (atomically) into ``out``."""
    sc = res.scenario
    gantt_png(res, out / "gantt.png")
    if tornado and sc.speculation.enabled:
        swings = sensitivity(sc)
        result["sensitivity"] = [s.__dict__ for s in swings]
        center = res.end_to_end_speedup_vs_sync_no_spec
        tornado_png(swings, center, out / "tornado.png", sc.name)
    atomic_write(out / "result.json", json.dumps(result, indent=2))


# The options kept beside --config/--set, each the same as one key (giving both is refused).
CALIBRATE = Shortcuts(
    CalibrateCfg,
    CalibrateCfg.WHAT,
    {
        **named_as_keys("calibrate", "base", "out", "drafter_out", "name", "heldout", "seed"),
        **named_as_keys("calibrate", "heldout_configs", "fit_configs"),
        "as_json": ("--json", "calibrate.json_report"),
    },
    rules=CalibrateCfg.RULES,
)


def _calibrate_options(named: dict[str, Any]) -> dict[str, Any]:
    """The options given, the config lists as lists; ``--heldout`` out of range is one line
    naming it (``--set``/``--config``: the settings' bounds)."""
    heldout = named.get("heldout")
    if heldout is not None and not 0.0 <= heldout < 1.0:
        fail(f"--heldout {heldout} must be in [0, 1)")
    lists = ("heldout_configs", "fit_configs")
    return {n: [c for c in v.split(",") if c] if n in lists else v for n, v in named.items()}


def _calibrate_check(given: Given[CalibrateCfg]) -> None:
    cfg = given.cfg.calibrate
    if cfg.fit_configs and cfg.heldout_configs:
        fits, held = given.name("calibrate.fit_configs"), given.name("calibrate.heldout_configs")
        fail(f"{fits} and {held}: give one (each names the other's complement)")


def calibrate_command(
    ctx: typer.Context,
    trace: Annotated[
        Path,
        typer.Argument(
            help="engine trace JSON, or a `specrl bench gpu` result (its engine.trace and"
            " engine.rollouts; see docs/simulator.md)"
        ),
    ],
    config: Annotated[Path | None, CALIBRATE.config_option()] = None,
    sets: Annotated[
        list[str] | None,
        CALIBRATE.set_option('calibrate.seed=3, calibrate.fit_configs=["bs1","bs64"]'),
    ] = None,
    base: Annotated[
        str | None,
        CALIBRATE.option(
            "base",
            "hardware profile whose peak/bandwidth the fit scales (default: the trace's"
            " 'hardware', else cpu-2core)",
        ),
    ] = None,
    out: Annotated[
        Path | None, CALIBRATE.option("out", "where to write the fitted hardware profile TOML")
    ] = None,
    drafter_out: Annotated[
        Path | None,
        CALIBRATE.option(
            "drafter_out",
            "model-free drafter traces: where to write the fitted drafter TOML"
            " (default: OUT with a -drafter suffix)",
        ),
    ] = None,
    name: Annotated[
        str | None,
        CALIBRATE.option("name", "name of the fitted profile (default BASE-calibrated)"),
    ] = None,
    heldout: Annotated[
        float | None,
        CALIBRATE.option("heldout", "fraction of records held out to report error"),
    ] = None,
    seed: Annotated[
        int | None,
        CALIBRATE.option("seed", "seed of the held-out split", min=0, max=MAX_SEED),
    ] = None,
    heldout_configs: Annotated[
        str | None,
        CALIBRATE.option(
            "heldout_configs",
            "comma-separated record 'config' labels held out as whole runs (instead of --heldout)",
        ),
    ] = None,
    fit_configs: Annotated[
        str | None,
        CALIBRATE.option(
            "fit_configs",
            "comma-separated record 'config' labels to fit on; every other config is held"
            " out as a whole run (bench gpu: bs1,bs64 fits on batches 1 and 64)",
        ),
    ] = None,
    as_json: Annotated[
        bool | None, CALIBRATE.option("as_json", "print the fit report as JSON")
    ] = None,
) -> None:
    """Fit efficiency terms (overhead, bytes/s, FLOP/s) to a trace (or a bench gpu result's
    engine trace); write a hardware profile; report held-out configs and predicted rollouts.
    Settings: defaults <- --config FILE <- the options <- --set calibrate.key=value (every key:
    specrl.config_commands.CalibrateCfg)."""
    given = CALIBRATE.read_parsed(ctx, _calibrate_options, _calibrate_check)
    cfg, what = given.cfg.calibrate, given.name
    out = Path(cfg.out)
    if not out.name or out.is_dir():  # '.', '/', a directory: no file to write (nor a sibling)
        fail(f"{what('calibrate.out')} {out} is a directory: name the profile's TOML file")
    drafter_out = Path(cfg.drafter_out) if cfg.drafter_out else None
    drafter_out = drafter_out or out.with_stem(f"{out.stem}-drafter")
    _check_writable(out, what("calibrate.out"), "file")
    _check_writable(drafter_out, what("calibrate.drafter_out"), "file")
    held = tuple(cfg.heldout_configs)
    try:
        tr, raw_rollouts = read_calibration(trace)
        rollouts = parse_rollouts(raw_rollouts)
        if cfg.fit_configs:
            held = complement(tr, tuple(cfg.fit_configs))
        base_hw = load_hardware(cfg.base or tr.hardware or "cpu-2core")
        model = load_model(tr.model)  # the specs the fit needs, checked before it starts
        if tr.drafter:
            load_drafter(tr.drafter)
        report = fit_trace(tr, base_hw, cfg.heldout, cfg.seed, cfg.name or "", held)
        checks = held_out_checks(model, report, tr, held, rollouts, left_out(raw_rollouts))
        write_profile(report, out, tr)
        drafter_path = write_drafter(report, drafter_out, tr)
    except (SimInputError, ValueError) as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot write {e.filename or out}: {e.strerror or e}")
    if cfg.json_report:
        typer.echo(json.dumps(report.to_json() | checks, indent=2))
        return
    p = report.profile
    typer.echo(
        f"wrote {out}: step_overhead_s={p.step_overhead_s:.4g} eta_mem={p.eta_mem:.3f} "
        f"eta_compute={p.eta_compute:.3f} verify_s_per_logit={p.verify_s_per_logit:.3g} "
        f"verify_overhead_s={p.verify_overhead_s:.3g} "
        f"prefill_s_per_flop={p.prefill_s_per_flop:.3g}\n"
        f"fit MAPE {report.fit_error:.1%} "
        f"({report.n_fit} records), held-out MAPE {report.heldout_error:.1%} "
        f"({report.n_heldout} records)"
    )
    _echo_checks(checks)
    if drafter_path is not None:
        cpu = report.drafter.cpu_s_per_seq
        typer.echo(f"wrote {drafter_path}: cpu_s_per_seq={cpu:.3g}")


def _echo_checks(checks: dict) -> None:
    """One line per held-out config (with its worst point) and per predicted rollout."""
    for config, e in checks["heldout_configs"].items():
        w = e["worst_point"]
        typer.echo(
            f"held-out {config}: MAPE {e['mape']:.1%}, worst {e['worst']:.1%} ({e['n']} records;"
            f" worst {w['kind']} B={w['batch_size']} T={w['tokens_per_seq']} context"
            f" {w['context_len']:.0f}: {w['measured_s']:.4g}s measured, predicted"
            f" {w['predicted_s']:.4g}s)"
        )
    rollouts = checks["rollouts"]
    for r in rollouts["rollouts"]:
        batch = "a fitted batch" if r["batch_fitted"] else "a batch not fitted"
        typer.echo(
            f"rollout {r['config']}: plain {r['plain_s']:.3g}s predicted "
            f"{r['predicted_plain_s']:.3g}s ({r['plain_error']:.1%}), speculative "
            f"{r['spec_s']:.3g}s predicted {r['predicted_spec_s']:.3g}s ({r['spec_error']:.1%});"
            f" speedup {r['speedup']:.2f} predicted {r['predicted_speedup']:.2f} ({batch})"
        )
    if rollouts["rollouts"]:
        typer.echo(
            f"rollouts: MAPE {rollouts['mape']:.1%}, worst {rollouts['worst']:.1%}"
            f" ({rollouts['worst_prediction']})"
        )
    if rollouts["skipped"]:
        typer.echo(f"rollouts not measured: {', '.join(rollouts['skipped'])}")


VALIDATE = Shortcuts(
    ValidateCfg,
    ValidateCfg.WHAT,
    {
        **named_as_keys("validation", "sections", "refit"),
        "tornado": ("--tornado/--no-tornado", "validation.tornado"),
        "json_path": ("--json", "validation.out"),
    },
    rules=ValidateCfg.RULES,
)


def _validate_options(named: dict[str, Any]) -> dict[str, Any]:
    """The options given, ``--sections`` as a list (an unknown section: one line naming it)."""
    if (text := named.get("sections")) is None:
        return named
    names = [n.strip() for n in text.split(",")]
    if unknown := [n for n in names if n not in SECTIONS]:
        fail(f"--sections: unknown section {unknown[0]!r}: choose from {','.join(SECTIONS)}")
    return named | {"sections": names}


def _chosen(cfg: ValidateCfg) -> list[str]:
    """The sections that run, in ``SECTIONS`` order."""
    v = cfg.validation
    return [n for n in SECTIONS if n in v.sections and (v.tornado or n != "tornado")]


def _validate_check(given: Given[ValidateCfg]) -> None:
    if not _chosen(given.cfg):
        tornado = given.name("validation.tornado")  # --no-tornado, or the key
        off = tornado if tornado.startswith("--") else f"{tornado}=false"
        fail(f"{given.name('validation.sections')}: nothing to run (only tornado, with {off})")


def validate_command(
    ctx: typer.Context,
    config: Annotated[Path | None, VALIDATE.config_option()] = None,
    sets: Annotated[
        list[str] | None,
        VALIDATE.set_option('validation.sections=["fits","heldout"], validation.refit=true'),
    ] = None,
    sections: Annotated[
        str | None,
        VALIDATE.option(
            "sections",
            f"comma-separated sections to run, in this order: {','.join(SECTIONS)}"
            " (default: all; fits, heldout and nemo_rl take seconds, paper and tornado minutes)",
            metavar="LIST",
        ),
    ] = None,
    refit: Annotated[
        bool | None,
        VALIDATE.option(
            "refit",
            "fits section: re-derive the paper's fitted workload inputs (minutes) instead"
            " of reading them from the scenario TOMLs",
        ),
    ] = None,
    tornado: Annotated[
        bool | None,
        VALIDATE.option("tornado", "the sensitivity sweep of the paper scenarios"),
    ] = None,
    json_path: Annotated[
        Path | None,
        VALIDATE.option(
            "json_path",
            "write the record (command, date, machine, versions and every section's"
            " rows) here, atomically (benchmarks/results/sim_validate.json)",
            metavar="PATH",
        ),
    ] = None,
) -> None:
    """Run the simulator against published measurements (the paper's table, held-out serving
    measurements, NeMo-RL steps) with their documented inputs; print each table with the signed
    error of every row (full run: ~15 min on 2 cores, ~25 with --refit). Settings: defaults <-
    --config FILE <- the options <- --set validation.key=value (every key:
    specrl.config_commands.ValidateCfg)."""
    given = VALIDATE.read_parsed(ctx, _validate_options, _validate_check)
    cfg = given.cfg.validation
    chosen = _chosen(given.cfg)
    record = Path(cfg.out) if cfg.out is not None else None
    if record is not None and (problem := result_file_problem(record)):
        fail(f"{given.name('validation.out')}: {problem}")
    command = validate_command_line(chosen, cfg.refit, record)
    result = run_validation(chosen, cfg.refit, command, typer.echo)
    if record is not None:
        write_or_print(record, json.dumps(result, indent=2, default=float))
        typer.echo(f"wrote {record}")


def validate_command_line(sections: list[str], refit: bool, json_path: Path | None) -> str:
    """The ``specrl simulate validate`` command line that reproduces a run (recorded in it)."""
    words = ["specrl", "simulate", "validate"]
    if sections != list(SECTIONS):
        words += ["--sections", ",".join(sections)]
    if refit:
        words.append("--refit")
    if json_path is not None:
        words += ["--json", str(json_path)]
    return " ".join(words)


def list_command() -> None:
    """List bundled scenarios, models, hardware profiles and drafters."""
    for kind in SPEC_KINDS:
        typer.echo(f"{kind}: {', '.join(list_specs(kind))}")
