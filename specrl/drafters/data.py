"""Drafter training data: the target's own rollouts on RL task prompts, with its features.

``task_prompt_ids`` / ``jsonl_prompt_ids`` render prompts (a reasoning-gym split or a JSONL file)
with the chat template; ``rollouts`` samples completions with the ``Engine`` (plain decoding:
the target's distribution); ``build_examples`` runs the target teacher-forced and records per
position the captured layer outputs ``feats`` [T, F] and the final normed hidden ``final``
[T, H] (never logits); ``save_examples`` / ``load_examples`` keep them in one safetensors file
written atomically (nothing unpickled; a bad file raises ``ValueError``), ``save_rollouts`` /
``load_rollouts`` the rollouts in a JSON file. Both record ``made_by``, the key of what made
them (the prompts' source, counts and lengths, temperatures, seed, the model's fingerprint, the
tokenizer and chat template, the feature layers: ``specrl.drafters.cli``); loading with a key
refuses a file made by anything else, or made before keys, with ``StaleData`` (a ``ValueError``)
naming the first field that differs: a cache is never reused for other data.
Details: docs/internals.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specrl.errors import one_line
from specrl.fsutil import atomic_write, atomic_writer
from specrl.jsonl_prompts import numbered_lines, parse_line, prompt_of, read_capped
from specrl.models.device import model_device, on
from specrl.models.transformer import Transformer

EXAMPLES_FORMAT = "specrl-drafter-examples"
EXAMPLES_VERSION = 1
ROLLOUTS_FORMAT = "specrl-drafter-rollouts"
MADE_BY = "made_by"  # the metadata (examples) or JSON (rollouts) key of what made a file


class StaleData(ValueError):
    """A cached file was made by something other than what asks for it (one line saying what)."""


@dataclass
class Sequence:
    tokens: list[int]  # prompt + completion
    prompt_len: int


@dataclass
class Example:
    tokens: torch.Tensor  # [T] int64
    prompt_len: int
    feats: torch.Tensor  # [T, F] captured target layers at each position
    final: torch.Tensor  # [T, H] target's final normed hidden at each position


def task_prompt_ids(
    tokenizer, task: str = "basic_arithmetic", split: str = "train", n: int = 64, seed: int = 0
) -> list[list[int]]:
    """Chat-rendered token ids of ``n`` prompts from a reasoning-gym task split."""
    from specrl.envs.reasoning_gym_env import ReasoningGymEnv, task_config_with_preset

    num_train = n if split == "train" else 8
    num_eval = n if split == "eval" else 8
    env = ReasoningGymEnv(
        task, task_config_with_preset(task, None), num_train=num_train, num_eval=num_eval, seed=seed
    )
    prompts = env.prompts(split)[:n]
    return [tokenizer.encode(tokenizer.chat_prompt(list(p.messages))) for p in prompts]


def jsonl_prompt_ids(tokenizer, path: str | Path) -> list[list[int]]:
    """Chat-rendered token ids of the prompts in a JSONL file (``specrl.jsonl_prompts``: a
    string, {"prompt": str} or {"messages": [...]} per line); ``ValueError`` naming the file and
    line for one that is none of these (or a file that is not UTF-8 text, or larger than
    ``jsonl_prompts.MAX_PROMPTS_BYTES``: read at most one byte past it)."""
    out = []
    for n, line in numbered_lines(read_capped(path), path):
        where = f"{path}:{n}"
        prompt = prompt_of(parse_line(line, where), where, chat=True)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        out.append(tokenizer.encode(tokenizer.chat_prompt(messages)))
    return out


def rollouts(
    target: Transformer,
    prompt_ids: list[list[int]],
    samples_per_prompt: int = 1,
    temperature: float = 1.0,
    max_new_tokens: int = 128,
    stop_token_ids: tuple[int, ...] = (),
    seed: int = 0,
    max_batch: int = 32,
    progress: bool = False,
) -> list[Sequence]:
    """The target's own completions (plain decoding through the Engine)."""
    from specrl.engine import Engine
    from specrl.rollout_types import Request
    from specrl.sampling import SamplingParams

    params = SamplingParams(
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        n=samples_per_prompt,
        seed=seed,
        stop_token_ids=tuple(stop_token_ids),
    )
    engine = Engine(target, max_batch=max_batch, seed=seed)
    done = engine.generate([Request(p, params) for p in prompt_ids], progress=progress)
    return [
        Sequence(list(c.prompt_ids) + list(c.token_ids), len(c.prompt_ids))
        for c in done
        if c.error is None and c.token_ids
    ]


@torch.inference_mode()
def build_examples(
    target: Transformer,
    sequences: list[Sequence],
    layers: tuple[int, ...],
    dtype: torch.dtype = torch.bfloat16,
    progress: bool = False,
) -> list[Example]:
    """Record the target's features and final hidden states for every sequence (stored in
    ``dtype`` to halve memory), in input order. Sequences with the same prompt share one prompt
    forward: the prompt is run once into a KV cache and their completions continue from it."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, seq in enumerate(sequences):
        groups.setdefault(tuple(seq.tokens[: seq.prompt_len]), []).append(i)
    out: list[Example | None] = [None] * len(sequences)
    bar = tqdm(total=len(sequences), disable=not progress, desc="features", unit="seq")
    for members in groups.values():
        made = _group_examples(target, [sequences[i] for i in members], layers)
        for i, (feats, final) in zip(members, made, strict=True):
            seq = sequences[i]
            out[i] = Example(torch.tensor(seq.tokens), seq.prompt_len, feats.to(dtype, copy=True),
                             final.to(dtype, copy=True))  # fmt: skip
        bar.update(len(members))
    bar.close()
    return out


def _group_examples(
    target: Transformer, seqs: list[Sequence], layers: tuple[int, ...]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(feats [T, F], final [T, H]) per sequence of ``seqs``, which all share one prompt."""
    n, p = len(seqs), seqs[0].prompt_len
    lens = [len(s.tokens) - p for s in seqs]  # completion lengths
    width = max(max(lens), 1)
    cache = target.new_cache(n, p + width)
    device = model_device(target)  # host-built inputs go where the target is
    prompt, at, slot = on(device, torch.tensor([seqs[0].tokens[:p]]), torch.arange(p)[None],
                          torch.tensor([0]))  # fmt: skip
    pre = _forward(target, prompt, at, layers, cache=cache, slots=slot, prefill=True)  # [1, P]
    for j in range(1, n):
        cache.copy_slot(0, j, p)
    ids = torch.zeros(n, width, dtype=torch.int64)  # [n, C], right-padded
    for j, s in enumerate(seqs):
        ids[j, : lens[j]] = torch.tensor(s.tokens[p:])
    ids, positions = on(device, ids, p + torch.arange(width).expand(n, width))
    rest = _forward(target, ids, positions, layers, cache=cache, kv_len=p + width)
    return [
        tuple(torch.cat([a[0], b[j, : lens[j]]]) for a, b in zip(pre, rest, strict=True))
        for j in range(n)
    ]


def _forward(target: Transformer, ids: torch.Tensor, positions: torch.Tensor, layers, **kw):
    """(feats [B, T, F], final [B, T, H]) of a forward that stops before the LM head (it is
    never called, not even on zero rows: the native GEMV kernel refuses M = 0)."""
    hidden, captured = target.hidden_states(ids, positions, capture=tuple(layers), **kw)
    captured = captured or [hidden.new_zeros(*ids.shape, 0)]  # F = 0: no layers
    return torch.cat(captured, dim=-1), hidden


def save_examples(
    examples: list[Example], path: str | Path, made_by: Mapping[str, str] | None = None
) -> None:
    """Write ``examples`` to one safetensors file (see docs/internals.md), atomically, with
    ``made_by`` (what made them) in its metadata."""
    from safetensors.torch import save_file

    if not examples:
        raise ValueError("no examples to save")
    lengths = [len(e.tokens) for e in examples]
    tensors = {
        "tokens": torch.cat([e.tokens.to(torch.int64) for e in examples]),
        "feats": torch.cat([e.feats for e in examples]),
        "final": torch.cat([e.final for e in examples]),
        "lengths": torch.tensor(lengths, dtype=torch.int64),
        "prompt_lens": torch.tensor([e.prompt_len for e in examples], dtype=torch.int64),
    }
    meta = {"format": EXAMPLES_FORMAT, "version": str(EXAMPLES_VERSION)}
    if made_by is not None:
        meta[MADE_BY] = json.dumps(dict(made_by), sort_keys=True)
    with atomic_writer(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)


def load_examples(path: str | Path, made_by: Mapping[str, str] | None = None) -> list[Example]:
    """The examples ``save_examples`` wrote; ``ValueError`` naming the file if it is missing,
    truncated, not this format or inconsistent, ``StaleData`` if ``made_by`` is given and the
    file records another key (or none). Nothing is unpickled."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") == EXAMPLES_FORMAT and made_by is not None:
                _check_made_by(path, meta.get(MADE_BY), made_by)  # before reading the tensors
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except (OSError, SafetensorError) as e:  # missing / unreadable; damaged or not safetensors
        raise ValueError(f"cannot read examples file {path}: {one_line(e)}") from None
    if meta.get("format") != EXAMPLES_FORMAT or meta.get("version") != str(EXAMPLES_VERSION):
        raise ValueError(f"{path} is not a specrl examples file (version {EXAMPLES_VERSION})")
    problem = _examples_problem(tensors)
    if problem:
        raise ValueError(f"inconsistent examples file {path}: {problem}")
    sizes = tensors["lengths"].tolist()
    parts = [tensors[k].split(sizes) for k in ("tokens", "feats", "final")]
    return [
        Example(tok, int(p), feats, final)
        for tok, feats, final, p in zip(*parts, tensors["prompt_lens"].tolist(), strict=True)
    ]


def save_rollouts(
    seqs: list[Sequence], path: str | Path, made_by: Mapping[str, str] | None = None
) -> None:
    """Write ``seqs`` to the JSON file ``path`` atomically, with ``made_by``."""
    rows = [vars(s) for s in seqs]
    record = {"format": ROLLOUTS_FORMAT, MADE_BY: dict(made_by or {}), "rollouts": rows}
    atomic_write(path, json.dumps(record))


def load_rollouts(path: str | Path, made_by: Mapping[str, str] | None = None) -> list[Sequence]:
    """The rollouts ``save_rollouts`` wrote; ``ValueError`` when the file is unreadable or
    malformed, ``StaleData`` if ``made_by`` is given and the file records another key (or none:
    an older specrl's list of rollouts)."""
    try:
        raw = json.loads(Path(path).read_bytes())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read rollouts file {path}: {one_line(e)}") from None
    record = raw if isinstance(raw, dict) else {}
    if made_by is not None:
        key = record.get(MADE_BY)
        _check_made_by(path, json.dumps(key) if isinstance(key, dict) else None, made_by)
    rows = record.get("rollouts") if isinstance(raw, dict) else raw
    try:
        return [Sequence(list(map(int, d["tokens"])), int(d["prompt_len"])) for d in rows]
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"malformed rollouts file {path}: {one_line(e)}") from None


def _check_made_by(path: str | Path, saved: str | None, wanted: Mapping[str, str]) -> None:
    """``StaleData`` naming the first field of ``wanted`` that ``saved`` (JSON) lacks or
    differs in; ``saved`` None or not a JSON object: made before keys."""
    try:
        found = json.loads(saved) if saved is not None else None
    except ValueError:
        found = None
    if not isinstance(found, dict):
        raise StaleData(f"{path} records no key of what made it (made before keys)")
    for name, value in wanted.items():
        if found.get(name) != value:
            raise StaleData(f"{path} was made with {name} {found.get(name)!r}, not {value!r}")


def _examples_problem(t: dict[str, torch.Tensor]) -> str | None:
    """Why the tensors of an examples file do not fit together (None: they do)."""
    names = {"tokens", "feats", "final", "lengths", "prompt_lens"}
    if set(t) != names:
        return f"tensors {sorted(t)}, expected {sorted(names)}"
    lengths, prompt_lens = t["lengths"], t["prompt_lens"]
    if lengths.dim() != 1 or prompt_lens.shape != lengths.shape or len(lengths) == 0:
        return "lengths and prompt_lens must be two equal non-empty lists"
    total = int(lengths.sum())
    if bool((lengths < 1).any()) or bool((prompt_lens < 0).any() or (prompt_lens > lengths).any()):
        return "a length or prompt length out of range"
    if t["tokens"].shape != (total,) or t["tokens"].dtype != torch.int64:
        return f"tokens {tuple(t['tokens'].shape)} do not add up to {total} int64 ids"
    for name in ("feats", "final"):
        if t[name].dim() != 2 or t[name].shape[0] != total:
            return f"{name} {tuple(t[name].shape)} is not [{total}, width]"
    return None
