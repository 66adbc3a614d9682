"""``specrl export RUN OUT``, ``specrl export-drafter`` and ``specrl upcycle OUT``: a run's
checkpoint as a Hugging Face model directory, a trained drafter in the layout vLLM loads, a
dense model sparsely upcycled to a mixture of experts.

``register(app)`` adds all three. Their settings are read like every command's
(``cli_util.Shortcuts`` over ``config_commands.ExportCfg``, ``ExportDrafterCfg``,
``UpcycleCfg``): defaults <- ``--config F.toml`` <- the options, each one key (``EXPORT``,
``EXPORT_DRAFTER``, ``UPCYCLE``; an option and a ``--set`` of the same key are refused) <-
``--set section.key=value``.

``export`` checks everything it can before reading a weight (the run dir, a checkpoint that
verifies, ``export.step``, the run's model and tokenizer, ``export.merge_drafter``,
``export.shard_size``, OUT absent or empty and writable): a bad value is one ``error: ...`` line
and exit code 2. Then ``pipelines.export.write_export`` writes OUT atomically,
``OUT/specrl_export.toml`` records the settings (the step resolved) and the command prints OUT's
path (newer checkpoints skipped as damaged are named on stderr first); an error while writing (a
full disk) is one line too, exit 2, with nothing left in OUT. ``export-drafter`` checks the
drafter's files against their manifest (``drafters.export``), writes it, and records its
settings as ``OUT/export_drafter.toml`` (paths absolute: ``--config`` on it exports the same
drafter again); bad settings, unusable paths, damaged drafters and OSErrors exit 2 with one
``error:`` line (before any work where they can), and a failed export leaves no output
directory it created. ``upcycle`` checks its settings, the model and OUT before any work and
writes OUT as ``export`` does (``pipelines.upcycle``), recording ``OUT/specrl_upcycle.toml``.
Details: docs/export.md.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated

import typer

from specrl.cli_util import Shortcuts, fail, os_errors_in_one_line
from specrl.config_commands import MAX_STEP, ExportCfg, ExportDrafterCfg, UpcycleCfg
from specrl.errors import unknown
from specrl.fsutil import atomic_write, writable_problem
from specrl.paths import drafter_cache_dir

# The options kept beside --config/--set, each the same as one key (giving both is refused).
EXPORT = Shortcuts(
    ExportCfg,
    "export",
    {
        "step": ("--step", "export.step"),
        "merge_drafter": ("--merge-drafter", "export.merge_drafter"),
        "shard_size": ("--shard-size", "export.shard_size"),
    },
)


def export_command(
    ctx: typer.Context,
    run_dir: Annotated[
        Path, typer.Argument(metavar="RUN", help="a run directory (specrl train --run-dir)")
    ],
    out: Annotated[
        Path, typer.Argument(metavar="OUT", help="the model directory to write (absent or empty)")
    ],
    config: Annotated[
        Path | None, EXPORT.config_option("; the record OUT/specrl_export.toml of an export too")
    ] = None,
    sets: Annotated[
        list[str] | None, EXPORT.set_option("export.step=3, export.shard_size='500MB'")
    ] = None,
    step: Annotated[
        int | None,
        EXPORT.option(
            "step", "export checkpoint step_N (default: the newest checkpoint that verifies)"
        ),
    ] = None,
    merge_drafter: Annotated[
        bool | None,
        EXPORT.option(
            "merge_drafter",
            "also write the EAGLE-3 head the run trained, in the layout vLLM loads, to "
            "OUT/drafter (vLLM: speculative_config method 'eagle3', model OUT/drafter)",
        ),
    ] = None,
    shard_size: Annotated[
        str | None,
        EXPORT.option(
            "shard_size",
            "largest weights file: 5GB, 500MB, 2GiB or bytes; above it the weights are "
            "sharded as Hugging Face does",
        ),
    ] = None,
) -> None:
    """Write a run's checkpoint as a Hugging Face model directory OUT.

    OUT gets config.json (the run's model, e.g. LlamaForCausalLM), generation_config.json, the
    model's tokenizer and chat template, and the policy's weights in the checkpoint's precision
    (model.safetensors, or shards and model.safetensors.index.json above --shard-size). Load it
    with transformers.AutoModelForCausalLM.from_pretrained(OUT) or vllm.LLM(model=OUT). Works
    for a one-process learner and for train workers (cluster.train_workers). OUT must not exist
    or be empty; it appears only when complete, with specrl_export.toml: the settings (every
    key: specrl.config_commands.ExportCfg; defaults <- --config FILE <- the options <- --set).
    """
    from specrl.pipelines.export import (
        ModelExportError,
        check_out,
        parse_size,
        resolve_export,
        write_export,
    )

    given = EXPORT.read(ctx)
    cfg = given.cfg.export
    try:
        size = parse_size(str(cfg.shard_size))
    except ValueError as e:
        fail(f"{given.name('export.shard_size')}: {e}")
    if cfg.step is not None and not 0 <= cfg.step <= MAX_STEP:
        fail(f"{given.name('export.step')} must be in [0, {MAX_STEP}], got {cfg.step}")
    try:
        check_out(out)
        source = resolve_export(run_dir, cfg.step, cfg.merge_drafter)
    except ModelExportError as e:
        fail(str(e))
    for skipped in source.skipped:
        typer.echo(f"skipped damaged checkpoint {skipped}", err=True)
    existed = out.is_dir()  # and empty (check_out)
    try:
        path = write_export(source, out, size)
        record = given.cfg.model_copy(
            update={"export": cfg.model_copy(update={"step": source.step})}
        )
        header = f"# specrl export of {source.run_dir.resolve()}, checkpoint step {source.step}\n"
        _record(path, ExportCfg.RECORD, header + ExportCfg.load(record.model_dump()).to_toml(),
                existed)  # fmt: skip
    except ModelExportError as e:
        fail(str(e))
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        fail(f"cannot write {out}: {e.strerror or e}{where} (nothing was left there)")
    typer.echo(str(path))


def _record(out: Path, name: str, text: str, existed: bool | None) -> None:
    """Write ``OUT/NAME`` (the settings an output was made with); if that fails, what the
    command wrote goes: OUT, or its contents where OUT was an empty directory before
    (``existed`` True; None: it held files of its own, which stay), and the error is raised."""
    try:
        atomic_write(out / name, text)
    except OSError:
        if existed is False:
            shutil.rmtree(out, ignore_errors=True)
        elif existed:
            for p in out.iterdir():
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- export-drafter


EXPORT_DTYPES = ("float32", "bfloat16", "float16")
_VLLM_METHOD = {"eagle3": "eagle3", "block": "dflash", "draft": "draft_model"}  # vLLM's method
_HEADS = ("eagle3", "block")  # exported from a head directory (with the target's LM head)
EXPORT_DRAFTER = Shortcuts(
    ExportDrafterCfg,
    "export-drafter",
    {
        "drafter": ("--drafter", "drafter.kind"),
        "source": ("--from", "drafter.source"),
        "out": ("--out", "export.out"),
        "model": ("--model", "model.name"),
        "dtype": ("--dtype", "export.dtype"),
    },
)


def export_drafter(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        EXPORT_DRAFTER.config_option("; the record OUT/export_drafter.toml of an export too"),
    ] = None,
    sets: Annotated[
        list[str] | None,
        EXPORT_DRAFTER.set_option("drafter.kind=draft, export.dtype=bfloat16"),
    ] = None,
    drafter: Annotated[
        str | None, EXPORT_DRAFTER.option("drafter", "eagle3 | block | draft")
    ] = None,
    source: Annotated[
        Path | None,
        EXPORT_DRAFTER.option(
            "source",
            "the trained drafter's directory (default: where `specrl train-drafter` saves it "
            "for --model)",
        ),
    ] = None,
    out: Annotated[Path | None, EXPORT_DRAFTER.option("out", "output directory (required)")] = None,
    model: Annotated[
        str | None,
        EXPORT_DRAFTER.option("model", "target model (eagle3, block: its LM head rows)"),
    ] = None,
    dtype: Annotated[
        str | None,
        EXPORT_DRAFTER.option(
            "dtype", "eagle3, block: float32 | bfloat16 | float16 (default: the head's)"
        ),
    ] = None,
) -> None:
    """Export a trained drafter to the layout vLLM loads (EAGLE-3 head, block head as DFlash, or
    HF draft model).

    Then serve with vLLM: speculative_config {"method": "eagle3", "dflash" or "draft_model",
    "model": OUT} (dflash: "num_speculative_tokens" up to the head's block size).
    Settings: defaults <- --config FILE <- the options <- --set section.key=value (every key:
    specrl.config_commands.ExportDrafterCfg); OUT gets them as export_drafter.toml.
    """
    import torch

    from specrl.drafters.export import ExportError, export_draft_model, export_eagle3
    from specrl.drafters.export_dflash import export_dflash

    given = EXPORT_DRAFTER.read(ctx)
    cfg, name = given.cfg, given.name
    kind, model, dtype = cfg.drafter.kind, cfg.model.name, cfg.export.dtype
    if kind == "mtp":
        fail("vLLM runs MTP only from the MTP layers built into specific models' own checkpoints "
             "(DeepSeek-V3, MiMo, Qwen3-Next, ...): an MTP head cannot be exported; "
             "use --drafter eagle3, block or draft")  # fmt: skip
    if kind not in _VLLM_METHOD:
        fail(unknown(name("drafter.kind"), kind, list(_VLLM_METHOD)))
    if cfg.export.out is None:
        fail(f"{name('export.out')} is required")
    if dtype is not None and (kind not in _HEADS or dtype not in EXPORT_DTYPES):
        fail(f"{name('export.dtype')} must be one of {', '.join(EXPORT_DTYPES)} (eagle3 and "
             f"block only), got {dtype!r}")  # fmt: skip
    src = Path(cfg.drafter.source).expanduser() if cfg.drafter.source else None
    src = src or drafter_cache_dir(model, kind)
    if not src.is_dir():
        fail(f"{name('drafter.source')} {src} is not a directory (train one with specrl "
             f"train-drafter --drafter {kind})")  # fmt: skip
    dest = Path(cfg.export.out).expanduser()
    problem = writable_problem(dest, "dir")
    if problem:
        fail(f"cannot use {name('export.out')}: {problem}")
    existed = None if dest.is_dir() and any(dest.iterdir()) else dest.is_dir()
    try:
        if kind in _HEADS:
            if dest.resolve() == src.resolve():
                fail(f"{name('export.out')} must differ from {name('drafter.source')} (the "
                     "head's own files would be mixed in)")  # fmt: skip
            export = export_eagle3 if kind == "eagle3" else export_dflash
            export(src, model, dest, None if dtype is None else getattr(torch, dtype))
        else:
            # the target's tokenizer only when the draft is a model without one (resolving a
            # bundled target converts it once: not for a source that is no model at all)
            needs = (src / "config.json").is_file() and not (src / "tokenizer.json").is_file()
            export_draft_model(src, dest, _tokenizer_dir(model) if needs else None)
    except ExportError as e:
        fail(str(e))
    _record(dest, ExportDrafterCfg.RECORD, _drafter_record(cfg, src, dest), existed)
    method = _VLLM_METHOD[kind]
    typer.echo(f"exported {kind} drafter {src} to {dest} "
               f'(vLLM: speculative_config method "{method}", model {dest})')  # fmt: skip


def _drafter_record(cfg: ExportDrafterCfg, src: Path, dest: Path) -> str:
    """The settings an export was made with, paths absolute (the source resolved, a model
    that is a path too), as TOML that ``--config`` reads back."""
    model = cfg.model.name
    if Path(model).expanduser().exists():
        model = str(Path(model).expanduser().resolve())
    record = cfg.model_copy(
        update={
            "drafter": cfg.drafter.model_copy(update={"source": str(src.resolve())}),
            "model": cfg.model.model_copy(update={"name": model}),
            "export": cfg.export.model_copy(update={"out": str(dest.resolve())}),
        }
    )
    return ExportDrafterCfg.load(record.model_dump(exclude_none=True)).to_toml()


def _tokenizer_dir(model: str) -> Path | None:
    """The target's model directory (for its tokenizer files), or None if it cannot be found."""
    from specrl.models.checkpoints import CheckpointError, resolve_model

    try:
        return resolve_model(model)
    except CheckpointError:
        return None


# --------------------------------------------------------------------------- upcycle


UPCYCLE = Shortcuts(
    UpcycleCfg,
    "upcycle",
    {
        "model": ("--model", "model.name"),
        "experts": ("--experts", "upcycle.experts"),
        "top_k": ("--top-k", "upcycle.top_k"),
        "seed": ("--seed", "upcycle.seed"),
    },
)


def upcycle_command(
    ctx: typer.Context,
    out: Annotated[
        Path, typer.Argument(metavar="OUT", help="the model directory to write (absent or empty)")
    ],
    config: Annotated[
        Path | None, UPCYCLE.config_option("; OUT/specrl_upcycle.toml of an upcycle too")
    ] = None,
    sets: Annotated[
        list[str] | None, UPCYCLE.set_option("upcycle.router_std=0.05, upcycle.dtype='bfloat16'")
    ] = None,
    model: Annotated[
        str | None, UPCYCLE.option("model", "the dense model (default: the bundled SmolLM2)")
    ] = None,
    experts: Annotated[
        int | None, UPCYCLE.option("experts", "experts per layer, each a copy of the dense MLP")
    ] = None,
    top_k: Annotated[int | None, UPCYCLE.option("top_k", "experts per token")] = None,
    seed: Annotated[int | None, UPCYCLE.option("seed", "seed of the router's weights")] = None,
) -> None:
    """Write a dense model sparsely upcycled to a mixture of experts as the model directory OUT.

    Every layer's MLP becomes --experts copies of it behind a random router that picks --top-k
    per token with weights summing to 1, so the MoE computes what the dense model does (up to
    float rounding) until training moves the experts apart. Llama and Mistral become Mixtral,
    Qwen2 Qwen2-MoE, Qwen3 Qwen3-MoE: OUT loads in transformers and vLLM, and trains with
    `specrl train --set model.name=OUT`. OUT must not exist or be empty; it appears only when
    complete, with specrl_upcycle.toml: the settings (specrl.config_commands.UpcycleCfg;
    defaults <- --config FILE <- the options <- --set).
    """
    import torch

    from specrl.models.checkpoints import CheckpointError
    from specrl.pipelines.export import ModelExportError
    from specrl.pipelines.upcycle import write_upcycled

    given = UPCYCLE.read(ctx)
    cfg = given.cfg
    up = cfg.upcycle
    existed = out.is_dir()
    try:
        path = write_upcycled(cfg.model.name, out, up.experts, up.top_k, up.seed, up.router_std,
                              getattr(torch, up.dtype))  # fmt: skip
        header = f"# specrl upcycle of {cfg.model.name}\n"
        _record(path, UpcycleCfg.RECORD, header + cfg.to_toml(), existed)
    except (ModelExportError, CheckpointError) as e:
        fail(str(e))
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        fail(f"cannot write {out}: {e.strerror or e}{where} (nothing was left there)")
    typer.echo(str(path))


def register(app: typer.Typer) -> None:
    """Add ``export``, ``export-drafter`` and ``upcycle`` to the main specrl CLI."""
    app.command("export")(export_command)
    app.command("export-drafter")(os_errors_in_one_line(export_drafter))
    app.command("upcycle")(upcycle_command)
