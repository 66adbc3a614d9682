"""CLI of the simulator: ``specrl simulate SCENARIO | run | calibrate | list``.

Contract: ``register(app)`` adds a ``simulate`` command group to the main Typer app. A first
argument that is not a subcommand is taken as a scenario for ``run``, so ``specrl simulate
paper-8b-sync --set speculation.k=5 --json`` works. ``run`` prints a summary (or JSON with
``rollout_speedup``, ``end_to_end_speedup`` and per-phase seconds) and, with ``--out DIR``, writes
result.json, gantt.png and tornado.png there. ``calibrate TRACE.json`` fits a hardware profile from
an engine trace (format in calibrate.py and docs/simulator.md; written by benchmarks/sim_machine.py
and benchmarks/gpu_calibrate.py), and a drafter spec when the trace's drafter is model-free.
``list`` names the bundled specs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import click
import typer
from typer.core import TyperGroup

from specrl.sim.calibrate import fit_trace, load_trace, write_drafter, write_profile
from specrl.sim.report import gantt_png, sensitivity, text_summary, tornado_png
from specrl.sim.runner import run_scenario
from specrl.sim.scenario import field_help, load_scenario
from specrl.sim.specs import list_specs, load_hardware

SPEC_KINDS = ("scenarios", "models", "hardware", "drafters")


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
        help="Simulate RL training with speculative rollouts: specrl simulate SCENARIO (options).",
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
        typer.Option("--set", help="override one input, KEY=VALUE with a dotted key (repeatable)"),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the full result as JSON")] = False,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="write result.json, gantt.png and tornado.png into this dir"),
    ] = None,
    tornado: Annotated[
        bool,
        typer.Option("--tornado/--no-tornado", help="with --out: sensitivity sweep and its chart"),
    ] = True,
) -> None:
    """Simulate a scenario with and without speculation; print speedups and phase times."""
    sc = load_scenario(scenario, set_ or [])
    res = run_scenario(sc)
    result = res.to_json()
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        gantt_png(res, out / "gantt.png")
        if tornado and sc.speculation.enabled:
            swings = sensitivity(sc)
            result["sensitivity"] = [s.__dict__ for s in swings]
            center = res.end_to_end_speedup_vs_sync_no_spec
            tornado_png(swings, center, out / "tornado.png", sc.name)
        (out / "result.json").write_text(json.dumps(result, indent=2))
    typer.echo(json.dumps(result, indent=2) if as_json else text_summary(res))


def calibrate_command(
    trace: Annotated[
        Path, typer.Argument(exists=True, help="engine trace JSON (see docs/simulator.md)")
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
    seed: Annotated[int, typer.Option("--seed", help="seed of the held-out split")] = 0,
    heldout_configs: Annotated[
        str,
        typer.Option(
            "--heldout-configs",
            help="comma-separated record 'config' labels held out as whole runs (instead of"
            " --heldout)",
        ),
    ] = "",
    as_json: Annotated[bool, typer.Option("--json", help="print the fit report as JSON")] = False,
) -> None:
    """Fit efficiency terms (overhead, bytes/s, FLOP/s) to a trace; write a hardware profile."""
    tr = load_trace(trace)
    held = tuple(c for c in heldout_configs.split(",") if c)
    base_hw = load_hardware(base or tr.hardware or "cpu-2core")
    report = fit_trace(tr, base_hw, heldout, seed, name, held)
    write_profile(report, out, tr)
    drafter_path = write_drafter(report, drafter_out or out.with_stem(f"{out.stem}-drafter"), tr)
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
        return
    p = report.profile
    typer.echo(
        f"wrote {out}: step_overhead_s={p.step_overhead_s:.4g} eta_mem={p.eta_mem:.3f} "
        f"eta_compute={p.eta_compute:.3f} verify_s_per_logit={p.verify_s_per_logit:.3g}\n"
        f"fit MAPE {report.fit_error:.1%} "
        f"({report.n_fit} records), held-out MAPE {report.heldout_error:.1%} "
        f"({report.n_heldout} records)"
    )
    if drafter_path is not None:
        cpu = report.drafter.cpu_s_per_seq
        typer.echo(f"wrote {drafter_path}: cpu_s_per_seq={cpu:.3g}")


def list_command() -> None:
    """List bundled scenarios, models, hardware profiles and drafters."""
    for kind in SPEC_KINDS:
        typer.echo(f"{kind}: {', '.join(list_specs(kind))}")
