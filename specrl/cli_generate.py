"""``specrl generate``: completions of prompts with the native engine (optionally speculative).

``register(app)`` adds the command. Every good prompt is answered even when others are bad:
each bad prompt gets one ``error: prompt N: <why>`` line on stderr and the exit code is 2 (0
when every prompt was answered); N counts every prompt given, arguments first. A prompts file
that cannot be read, is larger than ``jsonl_prompts.MAX_PROMPTS_BYTES`` (256 MiB; /dev/zero is
"larger" after 256 MiB + 1 byte read, not read forever), or has a line that is not JSON, fails
the whole command before the model loads.
Details: docs/internals.md.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from specrl.cli_options import (
    MAX_BATCH,
    MAX_NEW_TOKENS,
    DrafterOpt,
    DtypeOpt,
    ExactOpt,
    KOpt,
    ModelOpt,
    parse_dtype,
)
from specrl.cli_util import fail, parse_device, refuse_unless_applies
from specrl.config import MAX_TOP_K
from specrl.errors import one_line
from specrl.jsonl_prompts import Messages, numbered_lines, parse_line, prompt_of, read_capped

if TYPE_CHECKING:
    from specrl.sampling import SamplingParams

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
SiblingsOpt = Annotated[
    int,
    typer.Option(
        "--spec-siblings",
        help="extra first-token candidates per step for a stochastic drafter (eagle3, mtp, "
        "draft), verified losslessly in the same forward; raises acceptance at T > 0",
    ),
]

MAX_N = 65_536  # --n: completions per prompt (each is held in memory to the end)


def register(app: typer.Typer) -> None:
    """Add the ``generate`` command to the main specrl CLI."""
    app.command()(generate)


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
    """The numbered non-blank lines of a UTF-8 text file of at most
    ``jsonl_prompts.MAX_PROMPTS_BYTES``, or one error line and exit."""
    try:
        data = read_capped(path)
    except FileNotFoundError:
        fail(f"prompts file not found: {path}")
    except IsADirectoryError:
        fail(f"prompts file is a directory: {path}")
    except OSError as e:
        fail(f"cannot read prompts file {path}: {e.strerror or e}")
    except ValueError as e:  # larger than the cap
        fail(f"prompts file {e}")
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
    from specrl.rollout_plan import learned_drafter

    needs = f"a --spec that loads a drafter (eagle3, mtp, hybrid, draft), not {spec}"
    refuse_unless_applies(ctx, ["drafter"], learned_drafter(spec), needs)
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


def head_dir(spec: str, drafter: str | None, model: str) -> str | None:
    """``--drafter`` for a learned head (eagle3, mtp, hybrid): as given, else the cached
    trained head; 'untrained' says on stderr that a random head runs."""
    from specrl.bench import default_drafter_path
    from specrl.spec.config import UNTRAINED
    from specrl.spec.proposers import proposer_takes

    if not proposer_takes(spec, "drafter_path"):
        return drafter
    if drafter == UNTRAINED:
        typer.echo(f"warning: --spec {spec} runs an untrained (random) head: lossless, but "
                   "expect acceptance near 1 and no speed-up", err=True)  # fmt: skip
    return drafter or default_drafter_path(model, spec)


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
