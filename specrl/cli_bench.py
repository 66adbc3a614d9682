"""``specrl bench generate``: tokens/s of the engine against itself, transformers and vLLM.

Contract: ``register(app)`` adds the ``bench`` group. ``bench generate --json PATH`` checks that
PATH can be written before the benchmark runs (``specrl.bench.check_writable``; nothing is
created); the results are written atomically at the end, and if that fails they go to stdout and
one ``error:`` line follows.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Annotated

import typer

from specrl import cli_options as opts
from specrl.cli_util import fail, refuse_unless_applies
from specrl.fsutil import atomic_write

MAX_REPEATS = 1000  # bench --repeats


def register(app: typer.Typer) -> None:
    """Add the ``bench`` group to the main specrl CLI."""
    bench_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Benchmarks.")
    bench_app.command("generate")(bench_generate)
    app.add_typer(bench_app, name="bench")


def bench_generate(
    ctx: typer.Context,
    batch_sizes: Annotated[str, typer.Option("--batch-sizes", help="comma list")] = "1,8,32,64",
    new_tokens: Annotated[
        int, typer.Option("--new-tokens", help="tokens per sequence", max=opts.MAX_NEW_TOKENS)
    ] = 128,
    compare: Annotated[
        str,
        typer.Option(
            "--compare",
            help="comma list of other engines: hf (transformers), vllm (the vllm extra)",
        ),
    ] = "",
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    model: opts.ModelOpt = "smollm2-135m-instruct",
    dtype: opts.DtypeOpt = "auto",
    repeats: Annotated[
        int, typer.Option(help="timed runs per point, >= 1 (best kept)", max=MAX_REPEATS)
    ] = 1,
    spec: Annotated[
        str, typer.Option("--spec", help="comma list of drafters to compare with no speculation")
    ] = "",
    num_spec_tokens: opts.KOpt = 3,
    group_size: Annotated[
        int,
        typer.Option(
            "--group-size",
            help="samples per prompt (GRPO group); divides batch",
            max=opts.MAX_BATCH,
        ),
    ] = 1,
    drafter: opts.DrafterOpt = None,
    spec_exact: opts.ExactOpt = "distribution",
) -> None:
    """Tokens/s of the engine at several batch sizes: no speculation vs each --spec drafter,
    and optionally transformers (--compare hf) and vLLM (--compare vllm), all in one run, with
    ratios."""
    from specrl.bench import (
        GenerateBench,
        check_writable,
        default_drafter_path,
        run_generate_bench,
    )
    from specrl.models.checkpoints import CheckpointError, resolve_model
    from specrl.spec.config import missing_head
    from specrl.spec.proposers import proposer_takes
    from specrl.spec.verify import RULES

    sizes = parse_batch_sizes(batch_sizes)
    if new_tokens < 1:
        fail(f"--new-tokens must be >= 1, got {new_tokens}")
    if repeats < 1:
        fail(f"--repeats must be >= 1, got {repeats}")
    others = parse_compare(compare)
    methods = parse_methods(spec, num_spec_tokens)
    if group_size < 1 or any(b % min(b, group_size) for b in sizes):
        fail(f"--group-size {group_size} must be >= 1 and divide every batch size >= it {sizes}")
    torch_dtype = opts.parse_dtype(dtype)
    if json_path is not None and (problem := check_writable(json_path)):
        fail(f"cannot write --json: {problem}")
    if spec_exact not in RULES:
        fail(f"--spec-exact must be one of {', '.join(RULES)}, got {spec_exact!r}")
    refuse_unless_applies(ctx, ["num_spec_tokens", "drafter", "spec_exact"], bool(methods),
                          "--spec naming a drafter")  # fmt: skip
    for method in methods:  # before any work: a learned drafter needs its cached head
        if proposer_takes(method, "drafter_path") and default_drafter_path(model, method) is None:
            fail(missing_head(method))
    bench = GenerateBench(model=model, dtype=torch_dtype, batch_sizes=sizes,
                          new_tokens=new_tokens, compare=others, repeats=repeats,
                          methods=methods, k=num_spec_tokens, group_size=group_size,
                          drafter=drafter, exact=spec_exact)  # fmt: skip
    try:
        resolve_model(model)
        result = run_generate_bench(bench)
    except (CheckpointError, ValueError) as e:
        fail(str(e))
    if json_path is not None:
        save_results(result, json_path)


def parse_batch_sizes(text: str) -> list[int]:
    """``--batch-sizes``: a comma list of integers in [1, ``MAX_BATCH``], no empty entry."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        fail(f"--batch-sizes must be integers, comma-separated, no empty entry: got {text!r}")
    if not sizes or min(sizes) < 1:
        fail(f"batch sizes must be >= 1, got {text!r}")
    if max(sizes) > opts.MAX_BATCH:
        fail(f"batch sizes must be <= {opts.MAX_BATCH}, got {max(sizes)}")
    return sizes


def parse_compare(text: str) -> list[str]:
    """The --compare engines; an engine whose package is missing is refused, never ignored."""
    others = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in others if x not in ("hf", "vllm")]
    if unknown:
        fail(f"unknown --compare engine {unknown[0]!r} (choose hf, vllm)")
    if "vllm" in others and importlib.util.find_spec("vllm") is None:
        fail("--compare vllm needs the vllm extra (pip install 'specrl[vllm]')")
    if "hf" in others and importlib.util.find_spec("transformers") is None:
        fail("--compare hf needs transformers (pip install transformers)")
    return others


def parse_methods(text: str, k: int) -> list[str]:
    from specrl.spec.config import SpecConfig

    methods = [x.strip() for x in text.split(",") if x.strip() and x.strip() != "none"]
    try:
        for m in methods:
            SpecConfig(m, k).validate()
    except ValueError as e:
        fail(str(e))
    if methods and k < 1:
        fail(f"--num-spec-tokens {k} drafts nothing with --spec {text}: give k >= 1")
    return methods


def save_results(result: dict, path: Path) -> None:
    """Write the results atomically (parents created); if that fails, print them to stdout so
    nothing is lost, then one ``error:`` line."""
    text = json.dumps(result, indent=1)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, text)
    except OSError as e:
        typer.echo(text)
        fail(f"cannot write --json {path}: {e.strerror or e} (the results are printed above)")
