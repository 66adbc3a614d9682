"""The ``specrl`` command line: generate | bench | train | train-drafter | report | simulate.

Contract: every command validates its inputs before doing work and reports a bad value as one
line (``error: ...``) with exit code 2, never a traceback. Commands are thin: they parse options
and call library functions.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from specrl.cli_util import fail
from specrl.drafters.cli import register as register_drafters
from specrl.pipelines.cli import register as register_pipelines
from specrl.sim.cli import register as register_simulate

app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    help="specrl: RL post-training with lossless speculative rollouts.",
)
bench_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Benchmarks.")
app.add_typer(bench_app, name="bench")
register_pipelines(app)
register_drafters(app)
register_simulate(app)

ModelOpt = Annotated[
    str,
    typer.Option("--model", help="bundled name (smollm2-135m-instruct), model dir or .gguf file"),
]
DtypeOpt = Annotated[
    str,
    typer.Option(
        "--dtype",
        help="float32, bfloat16 or auto (bfloat16 where the CPU multiplies it natively, "
        "AVX512-BF16/AMX; else float32, ~8x faster than emulated bf16)",
    ),
]
SpecOpt = Annotated[
    str, typer.Option("--spec", help="drafter: none, ngram, suffix, draft, self (test device)")
]
KOpt = Annotated[int, typer.Option("--num-spec-tokens", help="draft tokens per step (k)")]
SiblingsOpt = Annotated[
    int,
    typer.Option(
        "--spec-siblings",
        help="extra first-token candidates per step for a stochastic drafter (eagle3, mtp, "
        "draft), verified losslessly in the same forward; raises acceptance at T > 0",
    ),
]
DrafterOpt = Annotated[
    str | None,
    typer.Option(
        "--drafter", help="draft model: a model dir/.gguf, or prefix:N (target's first N layers)"
    ),
]


def parse_dtype(name: str):
    import torch

    from specrl.models.precision import torch_dtype

    dtypes = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
              "bf16": torch.bfloat16, "auto": torch_dtype("auto")}  # fmt: skip
    if name not in dtypes:
        fail(f"unknown dtype {name!r} (choose float32, bfloat16 or auto)")
    return dtypes[name]


def read_prompts(prompts: list[str], prompts_file: Path | None) -> list[str]:
    """Prompts from arguments and a JSONL file (lines: a string, {"prompt": ...})."""
    out = list(prompts)
    if prompts_file is not None:
        if not prompts_file.exists():
            fail(f"prompts file not found: {prompts_file}")
        for n, line in enumerate(prompts_file.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                fail(f"{prompts_file}:{n}: not JSON ({e.msg})")
            out.append(item if isinstance(item, str) else item.get("prompt", ""))
    if not out:
        fail("no prompts: pass PROMPT arguments or --prompts-file")
    return out


@app.command()
def generate(
    prompts: Annotated[list[str] | None, typer.Argument(help="prompt texts")] = None,
    prompts_file: Annotated[
        Path | None, typer.Option("--prompts-file", help='JSONL: "text" or {"prompt": "text"}')
    ] = None,
    model: ModelOpt = "smollm2-135m-instruct",
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.7,
    top_p: Annotated[float, typer.Option("--top-p", help="nucleus mass in (0, 1]")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="0 = off")] = 0,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 128,
    n: Annotated[int, typer.Option("--n", help="completions per prompt")] = 1,
    seed: Annotated[int | None, typer.Option(help="base seed (default: random)")] = None,
    chat_template: Annotated[
        bool, typer.Option("--chat-template/--no-chat-template", help="wrap prompts as chat")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per completion")] = False,
    dtype: DtypeOpt = "auto",
    max_batch: Annotated[int, typer.Option("--max-batch", help="concurrent sequences")] = 64,
    spec: SpecOpt = "none",
    num_spec_tokens: KOpt = 3,
    spec_siblings: SiblingsOpt = 0,
    drafter: DrafterOpt = None,
) -> None:
    """Generate completions with the native engine (optionally speculative)."""
    from specrl.engine import Engine, Request
    from specrl.models.checkpoints import CheckpointError, load_model, load_tokenizer
    from specrl.sampling import SamplingParams
    from specrl.spec.config import drafter_spec

    texts = read_prompts(prompts or [], prompts_file)
    try:
        tok = load_tokenizer(model)
        params = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=max_new_tokens,
            n=n,
            seed=seed,
            stop_token_ids=tok.stop_token_ids,
        ).validate()
        net = load_model(model, dtype=parse_dtype(dtype))
        spec_cfg, draft = drafter_spec(spec, num_spec_tokens, drafter, net, tok)
        spec_cfg = dataclasses.replace(spec_cfg, siblings=spec_siblings).validate()
        engine = Engine(net, max_batch=max_batch, spec=spec_cfg, draft_model=draft)
    except (CheckpointError, ValueError) as e:
        fail(str(e))
    encode = tok.encode_chat if chat_template else tok.encode
    requests = [Request(encode(t) if t.strip() else [], params) for t in texts]
    completions = engine.generate(requests, progress=not as_json and sys.stderr.isatty())
    failed = 0
    for c in completions:
        if c.error:
            failed += 1
            typer.echo(f"error: prompt {c.request_index + 1}: {c.error}", err=True)
            continue
        text = tok.decode(c.token_ids)
        if as_json:
            typer.echo(json.dumps(completion_json(c, text)))
        else:
            typer.echo(
                f"--- prompt {c.request_index + 1}, sample {c.sample_index + 1} "
                f"({len(c.token_ids)} tokens, {c.finish_reason})\n{text}"
            )
    if failed:
        raise typer.Exit(1)


def completion_json(c, text: str) -> dict:
    return {
        "prompt_index": c.request_index,
        "sample_index": c.sample_index,
        "text": text,
        "token_ids": c.token_ids,
        "logprobs": c.logprobs,
        "raw_logprobs": c.raw_logprobs,
        "finish_reason": c.finish_reason,
        "acceptance_length": c.acceptance_length,
    }


@bench_app.command("generate")
def bench_generate(
    batch_sizes: Annotated[str, typer.Option("--batch-sizes", help="comma list")] = "1,8,32,64",
    new_tokens: Annotated[int, typer.Option("--new-tokens", help="tokens per sequence")] = 128,
    compare: Annotated[
        str, typer.Option("--compare", help="comma list of other engines: hf, vllm")
    ] = "",
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    model: ModelOpt = "smollm2-135m-instruct",
    dtype: DtypeOpt = "auto",
    repeats: Annotated[int, typer.Option(help="timed runs per point (best kept)")] = 1,
    spec: Annotated[
        str, typer.Option("--spec", help="comma list of drafters to compare with no speculation")
    ] = "",
    num_spec_tokens: KOpt = 3,
    group_size: Annotated[
        int, typer.Option("--group-size", help="samples per prompt (GRPO group); divides batch")
    ] = 1,
    drafter: DrafterOpt = None,
) -> None:
    """Tokens/s of the engine at several batch sizes: no speculation vs each --spec drafter,
    and optionally transformers (--compare hf), all in one run, with ratios."""
    from specrl.bench import GenerateBench, run_generate_bench
    from specrl.spec.config import SpecConfig

    try:
        sizes = [int(x) for x in batch_sizes.split(",") if x.strip()]
    except ValueError:
        fail(f"--batch-sizes must be integers, got {batch_sizes!r}")
    if not sizes or min(sizes) < 1:
        fail(f"batch sizes must be >= 1, got {batch_sizes!r}")
    if new_tokens < 1:
        fail(f"--new-tokens must be >= 1, got {new_tokens}")
    others = [x.strip() for x in compare.split(",") if x.strip()]
    unknown = [x for x in others if x not in ("hf", "vllm")]
    if unknown:
        fail(f"unknown --compare engine {unknown[0]!r} (choose hf, vllm)")
    methods = [x.strip() for x in spec.split(",") if x.strip() and x.strip() != "none"]
    try:
        for m in methods:
            SpecConfig(m, num_spec_tokens).validate()
    except ValueError as e:
        fail(str(e))
    if group_size < 1 or any(b % min(b, group_size) for b in sizes):
        fail(f"--group-size {group_size} must be >= 1 and divide every batch size >= it {sizes}")
    bench = GenerateBench(
        model=model,
        dtype=parse_dtype(dtype),
        batch_sizes=sizes,
        new_tokens=new_tokens,
        compare=others,
        repeats=repeats,
        methods=methods,
        k=num_spec_tokens,
        group_size=group_size,
        drafter=drafter,
    )
    result = run_generate_bench(bench)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
