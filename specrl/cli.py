"""The ``specrl`` command line: generate | bench | train | train-drafter | report | simulate.

Contract: every command validates its inputs before doing work and reports a bad value as one
line (``error: ...``) with exit code 2, never a traceback. Commands are thin: they parse options
and call library functions.
- ``generate`` answers every good prompt even when others are bad: each bad prompt (a JSONL line
  that is not a prompt of ``specrl.jsonl_prompts``' format, not valid Unicode, empty, too long
  for the context, a chat template that fails on it) gets one ``error: prompt N: <why>`` line on
  stderr and the exit code is then 2 (0 when every prompt was answered). Prompt numbers N (and
  ``prompt_index`` in ``--json``) count every prompt given, good or bad, arguments first. The
  prompts file's lines are a string, {"prompt": string} or, with the chat template (the
  default), {"messages": [{"role", "content"}, ...]}. A prompts file that cannot be read
  (missing, a directory, unreadable, not UTF-8) or holds a line that is not JSON fails the whole
  command before the model is loaded.
- ``bench generate --json PATH`` checks that PATH can be written before the benchmark runs
  (``specrl.bench.check_writable``; nothing is created); the results are written atomically at
  the end, and if that fails they go to stdout and one ``error:`` line follows.
- Ctrl-C ends any command but ``train`` (whose pipeline handles signals itself) with the line
  ``error: interrupted by Ctrl-C`` and exit code 130.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from specrl.cli_util import OneLineErrors, fail, parse_device, refuse_unless_applies
from specrl.config import MAX_TOP_K
from specrl.drafters.cli import register as register_drafters
from specrl.errors import one_line
from specrl.fsutil import atomic_write
from specrl.jsonl_prompts import Messages, numbered_lines, parse_line, prompt_of
from specrl.pipelines.cli import register as register_pipelines
from specrl.sim.cli import register as register_simulate

if TYPE_CHECKING:
    from specrl.sampling import SamplingParams

app = typer.Typer(
    cls=OneLineErrors,
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
DeviceOpt = Annotated[
    str,
    typer.Option(
        "--device",
        help="auto (CUDA when present, else cpu), cpu, cuda or cuda:N: where the model, its KV "
        "cache, the drafter and the sampler run",
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
ExactOpt = Annotated[
    str,
    typer.Option(
        "--spec-exact",
        help="verification rule: 'distribution' (rejection sampling, the policy's distribution) "
        "or 'sample' (plain sampling's tokens, one for one with the same --seed)",
    ),
]
DrafterOpt = Annotated[
    str | None,
    typer.Option(
        "--drafter",
        help="draft model: a model dir/.gguf, or prefix:N (target's first N layers); for eagle3/"
        "mtp a head dir (default: the one `specrl train-drafter` cached), or 'untrained'",
    ),
]


MAX_REPEATS = 1000  # bench --repeats
MAX_N = 65_536  # --n: completions per prompt (each is held in memory to the end)
MAX_BATCH = 4096  # --max-batch, --batch-sizes, --group-size: as the config's rollout.max_batch
MAX_NEW_TOKENS = 1_000_000  # --max-new-tokens, --new-tokens (the context stops them sooner)


def parse_dtype(name: str, device=None):
    """``--dtype`` as a torch dtype; 'auto' for ``device`` (default: the CPU)."""
    import torch

    from specrl.models.precision import torch_dtype

    dtypes = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
              "bf16": torch.bfloat16, "auto": torch_dtype("auto", device)}  # fmt: skip
    if name not in dtypes:
        fail(f"unknown dtype {name!r} (choose float32, bfloat16 or auto)")
    return dtypes[name]


@dataclass(frozen=True)
class Prompt:
    """One prompt as given: its text or chat messages, or why it cannot be answered (``error``)."""

    prompt: str | Messages = ""
    error: str | None = None


def read_prompts(prompts: list[str], prompts_file: Path | None, chat: bool = True) -> list[Prompt]:
    """Prompts from arguments and a JSONL file (``specrl.jsonl_prompts``: lines a string,
    {"prompt": string} or, with ``chat``, {"messages": [...]}).

    A file that cannot be read, or a line that is not JSON, fails the command; a JSON line that
    is not a prompt becomes a ``Prompt`` with an ``error`` (the other prompts still run).
    """
    out = [Prompt(t) for t in prompts]
    if prompts_file is not None:
        for n, line in _file_lines(prompts_file):
            where = f"{prompts_file}:{n}"
            try:
                item = parse_line(line, where)
            except ValueError as e:
                fail(str(e))
            try:
                out.append(Prompt(prompt_of(item, where, chat)))
            except ValueError as e:
                out.append(Prompt(error=str(e)))
    if not out:
        fail("no prompts: pass PROMPT arguments or --prompts-file")
    return out


def _file_lines(path: Path) -> list[tuple[int, str]]:
    """The numbered non-blank lines of a UTF-8 text file, or one error line and exit."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        fail(f"prompts file not found: {path}")
    except IsADirectoryError:
        fail(f"prompts file is a directory: {path}")
    except OSError as e:
        fail(f"cannot read prompts file {path}: {e.strerror or e}")
    try:
        return numbered_lines(data, path)
    except ValueError as e:
        fail(f"prompts file {e}")


def encode_prompt(encode: Callable[[Any], list[int]], prompt: str | Messages) -> list[int]:
    """Token ids of one prompt (a text or chat messages); ``ValueError`` with a one-line reason
    if it cannot be encoded."""
    texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
    if not any(t.strip() for t in texts):
        raise ValueError("empty prompt")
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            bad = text[e.start].encode("unicode_escape").decode()
            raise ValueError(
                f"not valid Unicode (lone surrogate {bad} at character {e.start})"
            ) from None
    try:
        return encode(prompt)
    except Exception as e:  # the tokenizer and the model's Jinja chat template can raise anything
        raise ValueError(f"cannot encode: {one_line(e)}") from None


def encode_prompts(
    items: list[Prompt], encode: Callable[[Any], list[int]]
) -> tuple[list[int], list[list[int]]]:
    """(original indices, token ids) of the prompts that encode; one ``error: prompt N`` line on
    stderr for each that does not."""
    indices, ids = [], []
    for i, item in enumerate(items):
        try:
            if item.error is not None:
                raise ValueError(item.error)
            ids.append(encode_prompt(encode, item.prompt))
            indices.append(i)
        except ValueError as e:
            typer.echo(f"error: prompt {i + 1}: {e}", err=True)
    return indices, ids


def check_generate_options(
    params: SamplingParams, max_batch: int, spec: str, k: int, siblings: int, exact: str
) -> None:
    """Sampling, batch and speculation values, checked before anything is loaded."""
    from specrl.spec.config import SpecConfig

    try:
        params.validate()
        SpecConfig(spec, k, siblings=siblings, exact=exact).validate()
    except ValueError as e:
        fail(str(e))
    if max_batch < 1:
        fail(f"--max-batch must be >= 1, got {max_batch}")
    if spec != "none" and k < 1:
        fail(f"--num-spec-tokens {k} drafts nothing with --spec {spec}: give k >= 1")


@app.command()
def generate(
    ctx: typer.Context,
    prompts: Annotated[list[str] | None, typer.Argument(help="prompt texts")] = None,
    prompts_file: Annotated[
        Path | None,
        typer.Option(
            "--prompts-file",
            help='JSONL: "text", {"prompt": "text"} or {"messages": [{"role", "content"}]}',
        ),
    ] = None,
    model: ModelOpt = "smollm2-135m-instruct",
    temperature: Annotated[float, typer.Option(help="0 = greedy; finite")] = 0.7,
    top_p: Annotated[float, typer.Option("--top-p", help="nucleus mass in (0, 1]")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="0 = off", max=MAX_TOP_K)] = 0,
    max_new_tokens: Annotated[
        int,
        typer.Option(
            "--max-new-tokens", help=">= 1; stops at the model's context", max=MAX_NEW_TOKENS
        ),
    ] = 128,
    n: Annotated[int, typer.Option("--n", help="completions per prompt", max=MAX_N)] = 1,
    seed: Annotated[
        int | None, typer.Option(help="base seed in [0, 2**63 - 1] (default: random)")
    ] = None,
    chat_template: Annotated[
        bool, typer.Option("--chat-template/--no-chat-template", help="wrap prompts as chat")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per completion")] = False,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    max_batch: Annotated[
        int, typer.Option("--max-batch", help="concurrent sequences", max=MAX_BATCH)
    ] = 64,
    spec: SpecOpt = "none",
    num_spec_tokens: KOpt = 3,
    spec_siblings: SiblingsOpt = 0,
    spec_exact: ExactOpt = "distribution",
    drafter: DrafterOpt = None,
) -> None:
    """Generate completions with the native engine (optionally speculative).

    A bad prompt does not stop the others: it gets one "error: prompt N: ..." line on stderr
    and the exit code is 2 (0 when every prompt was answered).
    """
    from specrl.engine import Engine
    from specrl.models.checkpoints import CheckpointError, load_model, load_tokenizer
    from specrl.rollout_types import Request
    from specrl.sampling import SamplingParams
    from specrl.spec.config import drafter_spec

    items = read_prompts(prompts or [], prompts_file, chat=chat_template)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                            max_new_tokens=max_new_tokens, n=n, seed=seed)  # fmt: skip
    check_generate_options(params, max_batch, spec, num_spec_tokens, spec_siblings, spec_exact)
    refuse_unless_applies(ctx, ["num_spec_tokens", "spec_exact"], spec != "none",
                          "--spec other than none")  # fmt: skip
    needs = f"a --spec that loads a drafter (eagle3, mtp, hybrid, draft), not {spec}"
    refuse_unless_applies(ctx, ["drafter"], loads_drafter(spec), needs)
    where = parse_device(device)
    torch_dtype = parse_dtype(dtype, where)
    if all(item.error is not None for item in items):  # nothing to answer: load nothing
        encode_prompts(items, encode=lambda prompt: [])  # one line each; encodes nothing
        raise typer.Exit(2)
    try:
        tok = load_tokenizer(model)
    except CheckpointError as e:
        fail(str(e))
    if chat_template and not tok.config.get("chat_template"):
        fail(f"the tokenizer of {model} has no chat template; pass --no-chat-template")

    def encode(prompt: str | Messages) -> list[int]:
        if isinstance(prompt, list):  # chat messages (only read with the chat template)
            return tok.encode(tok.chat_prompt(prompt))
        return tok.encode_chat(prompt) if chat_template else tok.encode(prompt)

    indices, ids = encode_prompts(items, encode)
    if not indices:
        raise typer.Exit(2)  # every prompt failed (one line each): no model to load
    try:
        params = params.replace(stop_token_ids=tok.stop_token_ids)
        net = load_model(model, dtype=torch_dtype, device=where)
        drafter = head_dir(spec, drafter, model)
        spec_cfg, draft = drafter_spec(spec, num_spec_tokens, drafter, net, tok)
        spec_cfg = dataclasses.replace(spec_cfg, siblings=spec_siblings, exact=spec_exact)
        spec_cfg = spec_cfg.validate()
        engine = Engine(net, max_batch=max_batch, spec=spec_cfg, draft_model=draft)
    except (CheckpointError, ValueError) as e:
        fail(str(e))
    requests = [Request(x, params) for x in ids]
    completions = engine.generate(requests, progress=not as_json and sys.stderr.isatty())
    failed = len(items) - len(indices)
    for c in completions:
        index = indices[c.request_index]  # numbered among every prompt given
        if c.error:
            if c.sample_index == 0:  # one line per prompt, not one per sample
                failed += 1
                typer.echo(f"error: prompt {index + 1}: {c.error}", err=True)
            continue
        text = tok.decode(c.token_ids)
        if as_json:
            typer.echo(json.dumps(completion_json(c, text) | {"prompt_index": index}))
        else:
            typer.echo(
                f"--- prompt {index + 1}, sample {c.sample_index + 1} "
                f"({len(c.token_ids)} tokens, {c.finish_reason})\n{text}"
            )
    if failed:
        raise typer.Exit(2)


def loads_drafter(spec: str) -> bool:
    """Whether ``--spec`` takes ``--drafter`` (a trained head or a draft model)."""
    from specrl.spec.proposers import proposer_takes

    return proposer_takes(spec, "drafter_path") or proposer_takes(spec, "draft_model")


def head_dir(spec: str, drafter: str | None, model: str) -> str | None:
    """``--drafter`` for a learned head (eagle3, mtp, hybrid): as given, else the cached
    trained head; 'untrained' says on stderr that a random head runs."""
    from specrl.paths import cached_drafter
    from specrl.spec.config import UNTRAINED
    from specrl.spec.proposers import head_kind, proposer_takes

    if not proposer_takes(spec, "drafter_path"):
        return drafter
    if drafter == UNTRAINED:
        typer.echo(f"warning: --spec {spec} runs an untrained (random) head: lossless, but "
                   "expect acceptance near 1 and no speed-up", err=True)  # fmt: skip
    if drafter:
        return drafter
    cached = cached_drafter(model, head_kind(spec))
    return None if cached is None else str(cached)


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
    ctx: typer.Context,
    batch_sizes: Annotated[str, typer.Option("--batch-sizes", help="comma list")] = "1,8,32,64",
    new_tokens: Annotated[
        int, typer.Option("--new-tokens", help="tokens per sequence", max=MAX_NEW_TOKENS)
    ] = 128,
    compare: Annotated[
        str,
        typer.Option(
            "--compare",
            help="comma list of other engines: hf (transformers), vllm (the vllm extra)",
        ),
    ] = "",
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    model: ModelOpt = "smollm2-135m-instruct",
    dtype: DtypeOpt = "auto",
    repeats: Annotated[
        int, typer.Option(help="timed runs per point, >= 1 (best kept)", max=MAX_REPEATS)
    ] = 1,
    spec: Annotated[
        str, typer.Option("--spec", help="comma list of drafters to compare with no speculation")
    ] = "",
    num_spec_tokens: KOpt = 3,
    group_size: Annotated[
        int,
        typer.Option(
            "--group-size", help="samples per prompt (GRPO group); divides batch", max=MAX_BATCH
        ),
    ] = 1,
    drafter: DrafterOpt = None,
    spec_exact: ExactOpt = "distribution",
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
    torch_dtype = parse_dtype(dtype)
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
    if max(sizes) > MAX_BATCH:
        fail(f"batch sizes must be <= {MAX_BATCH}, got {max(sizes)}")
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


INTERRUPTED = 130  # the shell's exit code for a command stopped by SIGINT


def main() -> None:
    """The ``specrl`` entry point: ``app()``, plus one line when Ctrl-C stops a command."""
    try:
        app()
    except SystemExit as e:
        if e.code == INTERRUPTED and by_ctrl_c(e) and command_name(sys.argv[1:]) != "train":
            typer.echo("error: interrupted by Ctrl-C", err=True)
        raise
    except KeyboardInterrupt:  # outside typer's own handling (it turns one into exit 130)
        typer.echo("error: interrupted by Ctrl-C", err=True)
        raise SystemExit(INTERRUPTED) from None


def by_ctrl_c(exc: BaseException) -> bool:
    """Whether a KeyboardInterrupt is among the causes of ``exc`` (typer raises Exit(130) from
    it, and the SystemExit comes while handling that)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, KeyboardInterrupt):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def command_name(args: list[str]) -> str | None:
    """The subcommand in a command line (its first word that is not an option)."""
    return next((a for a in args if not a.startswith("-")), None)


if __name__ == "__main__":
    main()
