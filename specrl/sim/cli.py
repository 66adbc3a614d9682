"""CLI of the simulator: ``specrl simulate SCENARIO | run | calibrate | list``.

``register(app)`` adds the ``simulate`` group; a first argument that is not a subcommand is a
scenario for ``run``. ``run`` prints a summary (or ``--json``) and, with ``--out DIR``, writes
result.json, gantt.png and tornado.png; ``calibrate TRACE.json`` fits a hardware profile (and a
model-free drafter's spec) to an engine trace (or a gpu_check result's), reports the held-out
configs and predicts the measured rollouts beside it; ``list`` names the bundled specs. Every bad
input, unwritable paths included, prints one ``error: ...`` line and exits 2 before any work.
Details: docs/internals.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

import click
import typer
from typer.core import TyperGroup

from specrl.cli_util import fail
from specrl.costmodel.errors import SimInputError
from specrl.costmodel.specs import SPEC_KINDS, list_specs, load_drafter, load_hardware, load_model
from specrl.fsutil import atomic_write, writable_problem
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


def calibrate_command(
    trace: Annotated[
        Path,
        typer.Argument(
            help="engine trace JSON, or a benchmarks/gpu_check.py result (its engine.trace and"
            " engine.rollouts; see docs/simulator.md)"
        ),
    ],
    base: Annotated[
        str,
        typer.Option(
            "--base",
            help="hardware profile whose peak/bandwidth the fit scales (default: the trace's"
            " 'hardware', else cpu-2core)",
        ),
    ] = "",
    out: Annotated[
        Path, typer.Option("--out", help="where to write the fitted hardware profile TOML")
    ] = Path("calibrated.toml"),
    drafter_out: Annotated[
        Path | None,
        typer.Option(
            "--drafter-out",
            help="model-free drafter traces: where to write the fitted drafter TOML"
            " (default: OUT with a -drafter suffix)",
        ),
    ] = None,
    name: Annotated[
        str, typer.Option("--name", help="name of the fitted profile (default BASE-calibrated)")
    ] = "",
    heldout: Annotated[
        float, typer.Option("--heldout", help="fraction of records held out to report error")
    ] = 0.25,
    seed: Annotated[
        int, typer.Option("--seed", help="seed of the held-out split", min=0, max=2**63 - 1)
    ] = 0,
    heldout_configs: Annotated[
        str,
        typer.Option(
            "--heldout-configs",
            help="comma-separated record 'config' labels held out as whole runs (instead of"
            " --heldout)",
        ),
    ] = "",
    fit_configs: Annotated[
        str,
        typer.Option(
            "--fit-configs",
            help="comma-separated record 'config' labels to fit on; every other config is held"
            " out as a whole run (gpu_check: bs1,bs64 fits on batches 1 and 64)",
        ),
    ] = "",
    as_json: Annotated[bool, typer.Option("--json", help="print the fit report as JSON")] = False,
) -> None:
    """Fit efficiency terms (overhead, bytes/s, FLOP/s) to a trace (or a gpu_check result's
    engine trace); write a hardware profile; report held-out configs and predicted rollouts."""
    if not 0.0 <= heldout < 1.0:
        fail(f"--heldout {heldout} must be in [0, 1)")
    if fit_configs and heldout_configs:
        fail("--fit-configs and --heldout-configs: give one (each names the other's complement)")
    if not out.name or out.is_dir():  # '.', '/', a directory: no file to write (nor a sibling)
        fail(f"--out {out} is a directory: name the profile's TOML file")
    drafter_out = drafter_out or out.with_stem(f"{out.stem}-drafter")
    _check_writable(out, "--out", "file")
    _check_writable(drafter_out, "--drafter-out", "file")
    held = tuple(c for c in heldout_configs.split(",") if c)
    try:
        tr, raw_rollouts = read_calibration(trace)
        rollouts = parse_rollouts(raw_rollouts)
        if fit_configs:
            held = complement(tr, tuple(c for c in fit_configs.split(",") if c))
        base_hw = load_hardware(base or tr.hardware or "cpu-2core")
        model = load_model(tr.model)  # the specs the fit needs, checked before it starts
        if tr.drafter:
            load_drafter(tr.drafter)
        report = fit_trace(tr, base_hw, heldout, seed, name, held)
        checks = held_out_checks(model, report, tr, held, rollouts, left_out(raw_rollouts))
        write_profile(report, out, tr)
        drafter_path = write_drafter(report, drafter_out, tr)
    except (SimInputError, ValueError) as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot write {e.filename or out}: {e.strerror or e}")
    if as_json:
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


def list_command() -> None:
    """List bundled scenarios, models, hardware profiles and drafters."""
    for kind in SPEC_KINDS:
        typer.echo(f"{kind}: {', '.join(list_specs(kind))}")
