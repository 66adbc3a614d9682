"""``specrl bench gpu``: the GPU check (floors, exactness, engine, learner, grpo) or the
calibration grid, one JSON each (docs/gpu.md).

Contract: ``register(bench_app)`` adds the ``gpu`` command to the ``bench`` group. Its settings
are read like every command's (``cli_util.Shortcuts`` over ``config_gpubench.GpuBenchCfg``):
defaults <- ``--config F.toml`` <- the options (``GPU``, each one key; the same key by an option
and ``--set`` in one command line is refused; an option given where it cannot apply is refused
in the options' words) <- ``--set section.key=value``. Then ``gpubench.common.prepare``
resolves the device and the result path: a bad setting, a device that is not here, no CUDA
without ``--smoke``, a smoke run aimed at a committed result and an unwritable path each end in
one ``error:`` line, exit 2, before any work. The run's JSON records the settings
(``meta.settings``: TOML that ``--config`` reads back); the check prints ``wrote PATH`` to
stderr and its summary as one JSON line to stdout. On the GPU machine, where specrl is not
installed: ``python3 -m specrl.cli bench gpu ...`` (docs/gpu.md).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from specrl.cli_util import Shortcuts, fail, named_as_keys
from specrl.config_gpubench import APPLIES_ONLY, SECTIONS, WHAT, GpuBenchCfg

# The options kept beside --config/--set, each the same as one key (giving both is refused).
GPU = Shortcuts(
    GpuBenchCfg,
    WHAT,
    {
        **named_as_keys("run", "mode", "device", "out", "budget_s"),
        "smoke": ("--smoke/--no-smoke", "run.smoke"),
        **named_as_keys("check", "sections", "step_graphs", "oracle_accept", "oracle_k"),
        **named_as_keys("calibrate", "ks", "max_kv_tokens", "warmup", "repeats"),
    },
    rules=APPLIES_ONLY,
)
opt = GPU.option
# Options read as comma lists: each entry's type.
COMMA_LISTS: dict[str, type] = {"sections": str, "ks": int}


def register(bench_app: typer.Typer) -> None:
    """Add ``gpu`` to the ``bench`` group."""
    bench_app.command("gpu")(bench_gpu)


def bench_gpu(
    ctx: typer.Context,
    config: Annotated[Path | None, GPU.config_option()] = None,
    sets: Annotated[
        list[str] | None,
        GPU.set_option('check.sections=["floors","engine"], calibrate.ks=[3,5]'),
    ] = None,
    mode: Annotated[
        str | None,
        opt(
            "mode",
            "check (the GPU check: one JSON of its sections) or calibrate (the engine's "
            "forward timed over a grid of shapes: a trace for `specrl simulate calibrate`)",
        ),
    ] = None,  # fmt: skip
    smoke: Annotated[
        bool | None,
        opt(
            "smoke",
            "tiny sizes: the same code path in well under a minute, on the CPU too "
            "(a CI test); without it a CUDA GPU is needed",
        ),
    ] = None,  # fmt: skip
    device: Annotated[
        str | None, opt("device", "auto (CUDA when present, else cpu), cpu, cuda or cuda:N")
    ] = None,
    out: Annotated[
        Path | None,
        opt(
            "out",
            "result JSON (default benchmarks/results/gpu_check.json, or "
            "gpu_calibrate_trace.json with --mode calibrate; with --smoke a temporary file, "
            "never those)",
        ),
    ] = None,  # fmt: skip
    budget_s: Annotated[
        float | None,
        opt(
            "budget_s",
            "time budget in seconds, a ceiling (default 390; 300 with --smoke; 270 "
            "with --mode calibrate)",
        ),
    ] = None,  # fmt: skip
    sections: Annotated[
        str | None,
        opt(
            "sections",
            f"comma list of the check's sections to run (default all: "
            f"{','.join(SECTIONS)}; they run in that order)",
        ),
    ] = None,  # fmt: skip
    step_graphs: Annotated[
        str | None,
        opt(
            "step_graphs",
            "the engine section's step_graphs: auto, capture, static or off "
            "(default capture; static with --smoke); its decode points also run with off",
        ),
    ] = None,  # fmt: skip
    oracle_accept: Annotated[
        float | None,
        opt("oracle_accept", "the grpo section's oracle drafter: per-token acceptance in (0, 1]"),
    ] = None,
    oracle_k: Annotated[
        int | None, opt("oracle_k", "the grpo section's oracle drafter: its largest k, 1 to 16")
    ] = None,
    ks: Annotated[
        str | None,
        opt(
            "ks",
            "--mode calibrate: comma list of the draft lengths k of the verify shapes "
            "(T = k + 1 tokens per row)",
        ),
    ] = None,  # fmt: skip
    max_kv_tokens: Annotated[
        int | None,
        opt(
            "max_kv_tokens",
            "--mode calibrate: keep the grid points whose KV cache fits this many tokens",
        ),
    ] = None,  # fmt: skip
    warmup: Annotated[
        int | None, opt("warmup", "--mode calibrate: untimed forwards per grid point")
    ] = None,
    repeats: Annotated[
        int | None,
        opt("repeats", "--mode calibrate: timed forwards per grid point (the median kept)"),
    ] = None,
) -> None:
    """specrl on one GPU, one JSON: floors, exactness tests, engine steps, learner, GRPO.

    The check takes at most ~7 minutes on one H200 (its budget); --smoke runs the same path
    with tiny sizes on the CPU; --mode calibrate writes a calibration trace instead. Settings:
    defaults <- --config FILE <- the options <- --set section.key=value (every key:
    specrl.config_gpubench.GpuBenchCfg); the JSON records them (meta.settings, TOML that
    --config reads back).
    """
    run_bench_gpu(GPU.read_parsed(ctx, comma_lists).cfg)


def comma_lists(named: dict[str, Any]) -> dict[str, Any]:
    """The options given ({parameter name: value}), those of ``COMMA_LISTS`` as lists."""
    return {n: comma_list(v, COMMA_LISTS[n]) if n in COMMA_LISTS else v for n, v in named.items()}


def comma_list(text: str, kind: type) -> list[Any]:
    """A comma list option's entries, each as ``kind`` where it reads as one (else as given,
    for the settings to refuse it by name)."""

    def entry(word: str) -> Any:
        try:
            return kind(word)
        except ValueError:
            return word

    return [entry(w.strip()) for w in text.split(",")]


def run_bench_gpu(cfg: GpuBenchCfg) -> None:
    """Check what the settings cannot (the device, the result path), then run: the check
    (its summary to stdout) or the calibration grid."""
    from specrl.gpubench import calibrate, check, common

    try:
        target = common.prepare(cfg)
    except common.GpuBenchError as e:
        fail(str(e))
    command = shlex.join(["specrl", *sys.argv[1:]])
    try:
        if cfg.run.mode == "calibrate":
            calibrate.run_calibrate(cfg, target, command)
            return
        result = check.run_check(cfg, target, command)
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        fail(f"{e.strerror or e}{where}")
    typer.echo(f"wrote {target.out}", err=True)
    typer.echo(json.dumps(result["summary"]))
