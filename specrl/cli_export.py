"""``specrl export RUN [--step N] OUT``: a run's checkpoint as a Hugging Face model directory.

``register(app)`` adds the command. It checks everything it can before reading a weight (the
run dir, a checkpoint that verifies, ``--step``, the run's model and tokenizer, ``--merge-drafter``,
``--shard-size``, OUT absent or empty and writable): a bad value is one ``error: ...`` line and
exit code 2. Then ``pipelines.export.write_export`` writes OUT atomically and the command prints
its path (newer checkpoints skipped as damaged are named on stderr first); an error while
writing (a full disk) is one line too, exit 2, with nothing left in OUT. Details: docs/export.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from specrl.cli_util import fail as _fail

MAX_STEP = 1_000_000  # run.steps' bound


def export_command(
    run_dir: Annotated[
        Path, typer.Argument(metavar="RUN", help="a run directory (specrl train --run-dir)")
    ],
    out: Annotated[
        Path, typer.Argument(metavar="OUT", help="the model directory to write (absent or empty)")
    ],
    step: Annotated[
        int | None,
        typer.Option(
            "--step",
            help="export checkpoint step_N (default: the newest checkpoint that verifies)",
        ),
    ] = None,
    merge_drafter: Annotated[
        bool,
        typer.Option(
            "--merge-drafter",
            help="also write the EAGLE-3 head the run trained, in the layout vLLM loads, to "
            "OUT/drafter (vLLM: speculative_config method 'eagle3', model OUT/drafter)",
        ),
    ] = False,
    shard_size: Annotated[
        str,
        typer.Option(
            "--shard-size",
            help="largest weights file: 5GB, 500MB, 2GiB or bytes; above it the weights are "
            "sharded as Hugging Face does",
        ),
    ] = "5GB",
) -> None:
    """Write a run's checkpoint as a Hugging Face model directory OUT.

    OUT gets config.json (the run's model, e.g. LlamaForCausalLM), generation_config.json, the
    model's tokenizer and chat template, and the policy's weights in the checkpoint's precision
    (model.safetensors, or shards and model.safetensors.index.json above --shard-size). Load it
    with transformers.AutoModelForCausalLM.from_pretrained(OUT) or vllm.LLM(model=OUT). Works
    for a one-process learner and for train workers (cluster.train_workers). OUT must not exist
    or be empty; it appears only when complete.
    """
    from specrl.pipelines.export import (
        ModelExportError,
        check_out,
        parse_size,
        resolve_export,
        write_export,
    )

    try:
        size = parse_size(shard_size)
    except ValueError as e:
        _fail(f"--shard-size: {e}")
    if step is not None and not 0 <= step <= MAX_STEP:
        _fail(f"--step must be in [0, {MAX_STEP}], got {step}")
    try:
        check_out(out)
        source = resolve_export(run_dir, step, merge_drafter)
    except ModelExportError as e:
        _fail(str(e))
    for skipped in source.skipped:
        typer.echo(f"skipped damaged checkpoint {skipped}", err=True)
    try:
        path = write_export(source, out, size)
    except ModelExportError as e:
        _fail(str(e))
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        _fail(f"cannot write {out}: {e.strerror or e}{where} (nothing was left there)")
    typer.echo(str(path))


def register(app: typer.Typer) -> None:
    """Add ``export`` to the main specrl CLI."""
    app.command("export")(export_command)
