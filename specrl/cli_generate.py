"""``specrl generate``: completions of prompts with the native engine (optionally speculative).

``register(app)`` adds the command. Its settings (``config_commands.GenerateCfg``) are read like
``train``'s (``cli_util.Shortcuts``): defaults <- ``--config F.toml`` <- the options, each one
key (``GENERATE``; an option and a ``--set`` of the same key are refused) <- ``--set
section.key=value``; every value is checked before anything loads. Every good prompt is answered
even when others are bad:
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

from specrl.cli_options import HELP, parse_dtype
from specrl.cli_util import Given, Shortcuts, fail, parse_device
from specrl.config_commands import MAX_BATCH, MAX_N, MAX_NEW_TOKENS, MAX_TOP_K, GenerateCfg
from specrl.errors import one_line
from specrl.jsonl_prompts import Messages, numbered_lines, parse_line, prompt_of, read_capped

if TYPE_CHECKING:
    from specrl.sampling import SamplingParams


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
    params: SamplingParams,
    max_batch: int,
    spec: str,
    k: int,
    siblings: int,
    exact: str,
    name: Callable[[str], str] | None = None,
) -> None:
    """Sampling, batch and speculation values, checked before anything is loaded; ``name``
    names a settings key in a message (default: its option)."""
    from specrl.spec.config import SpecConfig

    name = name or (lambda key: GENERATE.flag(key))
    try:
        params.validate()
        SpecConfig(spec, k, siblings=siblings, exact=exact).validate()
    except ValueError as e:
        fail(str(e))
    if max_batch < 1:
        fail(f"{name('engine.max_batch')} must be >= 1, got {max_batch}")
    if spec != "none" and k < 1:
        fail(f"{name('speculation.num_spec_tokens')} {k} drafts nothing with "
             f"{name('speculation.method')} {spec}: give k >= 1")  # fmt: skip


# The options kept beside --config/--set, each the same as one key of GenerateCfg.
GENERATE = Shortcuts(
    GenerateCfg,
    "generate",
    {
        "prompts_file": ("--prompts-file", "prompts.file"),
        "chat_template": ("--chat-template/--no-chat-template", "prompts.chat_template"),
        "model": ("--model", "model.name"),
        "dtype": ("--dtype", "model.dtype"),
        "device": ("--device", "model.device"),
        "temperature": ("--temperature", "sampling.temperature"),
        "top_p": ("--top-p", "sampling.top_p"),
        "top_k": ("--top-k", "sampling.top_k"),
        "max_new_tokens": ("--max-new-tokens", "sampling.max_new_tokens"),
        "n": ("--n", "sampling.n"),
        "seed": ("--seed", "sampling.seed"),
        "as_json": ("--json", "output.jsonl"),
        "max_batch": ("--max-batch", "engine.max_batch"),
        "spec": ("--spec", "speculation.method"),
        "num_spec_tokens": ("--num-spec-tokens", "speculation.num_spec_tokens"),
        "spec_siblings": ("--spec-siblings", "speculation.siblings"),
        "spec_exact": ("--spec-exact", "speculation.exact"),
        "drafter": ("--drafter", "speculation.drafter"),
    },
    rules=GenerateCfg.RULES,
)
opt = GENERATE.option


def generate(
    ctx: typer.Context,
    prompts: Annotated[list[str] | None, typer.Argument(help="prompt texts")] = None,
    config: Annotated[Path | None, GENERATE.config_option()] = None,
    sets: Annotated[
        list[str] | None,
        GENERATE.set_option(
            "sampling.temperature=0, speculation.method=ngram, prompts.file=p.jsonl"
        ),  # fmt: skip
    ] = None,
    prompts_file: Annotated[
        Path | None,
        opt(
            "prompts_file",
            'JSONL: "text", {"prompt": "text"} or {"messages": [{"role", "content"}]}',
        ),  # fmt: skip
    ] = None,
    model: Annotated[str | None, opt("model", HELP["model"])] = None,
    temperature: Annotated[float | None, opt("temperature", "0 = greedy; finite")] = None,
    top_p: Annotated[float | None, opt("top_p", "nucleus mass in (0, 1]")] = None,
    top_k: Annotated[int | None, opt("top_k", "0 = off", max=MAX_TOP_K)] = None,
    max_new_tokens: Annotated[
        int | None, opt("max_new_tokens", ">= 1; stops at the model's context", max=MAX_NEW_TOKENS)
    ] = None,
    n: Annotated[int | None, opt("n", "completions per prompt", max=MAX_N)] = None,
    seed: Annotated[
        int | None, opt("seed", "base seed in [0, 2**63 - 1] (default: random)")
    ] = None,
    chat_template: Annotated[bool | None, opt("chat_template", "wrap prompts as chat")] = None,
    as_json: Annotated[bool | None, opt("as_json", "one JSON object per completion")] = None,
    dtype: Annotated[str | None, opt("dtype", HELP["dtype"])] = None,
    device: Annotated[
        str | None,
        opt(
            "device",
            "auto (CUDA when present, else cpu), cpu, cuda or cuda:N: where the "
            "model, its KV cache, the drafter and the sampler run",
        ),  # fmt: skip
    ] = None,
    max_batch: Annotated[
        int | None, opt("max_batch", "concurrent sequences", max=MAX_BATCH)
    ] = None,
    spec: Annotated[
        str | None, opt("spec", "drafter: none, ngram, suffix, draft, self (test device)")
    ] = None,
    num_spec_tokens: Annotated[int | None, opt("num_spec_tokens", HELP["num_spec_tokens"])] = None,
    spec_siblings: Annotated[
        int | None,
        opt(
            "spec_siblings",
            "extra first-token candidates per step for a stochastic drafter "
            "(eagle3, mtp, draft), verified losslessly in the same forward; raises acceptance "
            "at T > 0",
        ),  # fmt: skip
    ] = None,
    spec_exact: Annotated[str | None, opt("spec_exact", HELP["spec_exact"])] = None,
    drafter: Annotated[str | None, opt("drafter", HELP["drafter"])] = None,
) -> None:
    """Generate completions with the native engine (optionally speculative).

    Settings: defaults <- --config FILE <- the options <- --set section.key=value (every key:
    specrl.config_commands.GenerateCfg; an option and a --set of the same key are refused).
    A bad prompt does not stop the others: it gets one "error: prompt N: ..." line on stderr
    and the exit code is 2 (0 when every prompt was answered).
    """
    given = GENERATE.read(ctx, check=check_settings)
    cfg = given.cfg
    file = None if cfg.prompts.file is None else Path(cfg.prompts.file)
    items = read_prompts(prompts or [], file, chat=cfg.prompts.chat_template)
    run_generate(given, items)


def sampling_params(cfg: GenerateCfg) -> SamplingParams:
    """The sampling settings as the engine takes them (not validated)."""
    from specrl.sampling import SamplingParams

    s = cfg.sampling
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                          max_new_tokens=s.max_new_tokens, n=s.n, seed=s.seed)  # fmt: skip


def check_settings(given: Given[GenerateCfg]) -> None:
    """The values of ``given`` that the settings model leaves to the sampler and the
    speculation config, and a drafter given where none loads (one line each)."""
    from specrl.rollout_plan import learned_drafter

    cfg, sp = given.cfg, given.cfg.speculation
    check_generate_options(sampling_params(cfg), cfg.engine.max_batch, sp.method,
                           sp.num_spec_tokens, sp.siblings, sp.exact, given.name)  # fmt: skip
    needs = (f"a {given.name('speculation.method')} that loads a drafter (eagle3, mtp, hybrid, "
             f"draft), not {sp.method}")  # fmt: skip
    given.refuse_unless_applies(["speculation.drafter"], learned_drafter(sp.method), needs)


def run_generate(given: Given[GenerateCfg], items: list[Prompt]) -> None:
    """Answer ``items`` with the settings ``given`` (checked: ``check_settings``)."""
    from specrl.engine import Engine
    from specrl.models.checkpoints import CheckpointError, load_model, load_tokenizer
    from specrl.rollout_types import Request
    from specrl.spec.config import drafter_spec

    cfg = given.cfg
    sp, model, chat_template = cfg.speculation, cfg.model.name, cfg.prompts.chat_template
    params = sampling_params(cfg)
    where = parse_device(cfg.model.device)
    torch_dtype = parse_dtype(cfg.model.dtype, where)
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
        drafter = head_dir(sp.method, sp.drafter, model)
        spec_cfg, draft = drafter_spec(sp.method, sp.num_spec_tokens, drafter, net, tok)
        spec_cfg = dataclasses.replace(spec_cfg, siblings=sp.siblings, exact=sp.exact)
        spec_cfg = spec_cfg.validate()
        engine = Engine(net, max_batch=cfg.engine.max_batch, spec=spec_cfg, draft_model=draft)
    except (CheckpointError, ValueError) as e:
        fail(str(e))
    requests = [Request(x, params) for x in ids]
    as_json = cfg.output.jsonl
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
