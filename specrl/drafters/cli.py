"""``specrl train-drafter``: train a drafter on the target's own rollouts.

``register(app)`` adds the command (``export-drafter``, which writes a trained drafter in the
layout vLLM loads, is ``specrl.cli_export``'s). ``train-drafter`` reads its settings like every
command (``cli_util.Shortcuts`` over ``specrl.config_drafter.TrainDrafterCfg``: defaults <-
``--config F.toml`` <- the options ``--drafter``/``--model``/``--task``/``--prompts``/``--out``/
``--device``, each one field (``TRAIN_DRAFTER``; the same field by an option and ``--set`` in one
line is refused) <- ``--set section.key=value``), then generates the target's own completions on
a reasoning-gym task's train split (or ``data.prompts``), trains a head (or, with
``drafter.kind='draft'``, distills a layer-prefix draft model), resumably with checkpoints and
cached data in ``run.out``, saves it, and prints held-out acceptance untrained vs trained;
``run.out/train_drafter.toml`` records the settings (``to_toml``, defaults resolved, paths
absolute: ``--config`` on it makes the same drafter). The cached rollouts and examples are keyed
by what made them (``_data_key``: the prompts' source, counts, lengths, temperatures, seed, the
model's fingerprint, tokenizer and chat template; the examples also by the feature layers): a
cache made by anything else, or before keys, is rebuilt with one ``notice:`` line on stderr
saying why (and the training states made from it are dropped), never reused. Bad settings,
unusable paths and OSErrors exit 2 with one ``error:`` line (before any work where they can).
Details: docs/internals.md.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from specrl import settings
from specrl.cli_util import Shortcuts, fail, os_errors_in_one_line, parse_device
from specrl.config_drafter import (
    HEAD_DRAFT_VOCAB,
    RECORD_FILE,
    TrainDrafterCfg,
    key_hint,
    load_train_drafter,
)
from specrl.fsutil import atomic_write, file_digest, writable_problem
from specrl.paths import drafter_cache_dir

if TYPE_CHECKING:
    from specrl.models.tokenizer import TextTokenizer
    from specrl.models.transformer import Transformer


def register(app: typer.Typer) -> None:
    """Add ``train-drafter`` to ``app`` (``export-drafter``: ``specrl.cli_export``)."""
    resume = " (rerun to resume from what was saved)"
    app.command("train-drafter")(os_errors_in_one_line(train_drafter_command, resume))


EXAMPLES_FILE = "examples.safetensors"  # specrl.drafters.data.save_examples
TV_STATE_FILE = "train_state_tv.safetensors"  # the TV phase's specrl.drafters.train state

# The options kept beside --config/--set, each the same as one key (giving both is refused).
TRAIN_DRAFTER = Shortcuts(
    TrainDrafterCfg,
    "train-drafter",
    {
        "drafter": ("--drafter", "drafter.kind"),
        "model": ("--model", "model.name"),
        "task": ("--task", "data.task"),
        "prompts": ("--prompts", "data.prompts"),
        "out": ("--out", "run.out"),
        "device": ("--device", "model.device"),
    },
    hint=key_hint,
)
opt = TRAIN_DRAFTER.option


def train_drafter_command(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        TRAIN_DRAFTER.config_option("; the record OUT/train_drafter.toml of an earlier run too"),
    ] = None,
    sets: Annotated[
        list[str] | None,
        TRAIN_DRAFTER.set_option(
            "train.steps=200, data.temperatures=[1,0], drafter.head_arch=eagle3"
        ),  # fmt: skip
    ] = None,
    drafter: Annotated[str | None, opt("drafter", "eagle3 | mtp | draft")] = None,
    model: Annotated[str | None, opt("model", "target model")] = None,
    task: Annotated[str | None, opt("task", "reasoning-gym task")] = None,
    prompts: Annotated[
        Path | None,
        opt(
            "prompts",
            'JSONL train prompts: "text", {"prompt": ...} or {"messages": [...]} '
            "(default: the task's)",
        ),  # fmt: skip
    ] = None,
    out: Annotated[Path | None, opt("out", "output dir (default: the drafter cache)")] = None,
    device: Annotated[
        str | None,
        opt("device", "auto (CUDA when present, else cpu), cpu, cuda or cuda:N"),
    ] = None,
) -> None:
    """Train an EAGLE-3 / MTP drafter or distill a draft model on the target's own rollouts.

    Settings: defaults <- --config FILE <- the options below <- --set section.key=value (every
    key: specrl.config_drafter.TrainDrafterCfg); the directory gets them as train_drafter.toml.
    """
    train_drafter(TRAIN_DRAFTER.read(ctx).cfg)


def train_drafter(cfg: TrainDrafterCfg) -> None:
    """Train the drafter ``cfg`` describes (``train-drafter``): what the settings model cannot
    check (the task, the device, the target's layers and vocabulary, ``run.out``) is checked
    first, then ``OUT/train_drafter.toml`` records the settings, then the work."""
    import torch

    from specrl.drafters import data
    from specrl.drafters.distill import distill, init_draft
    from specrl.drafters.train import NonFiniteWeights, TrainConfig, acceptance, train_head
    from specrl.models.checkpoints import resolve_model
    from specrl.models.head_kinds import new_head
    from specrl.models.heads import default_layers, draft_vocab_by_frequency

    drafter, model, task, seed = cfg.drafter.kind, cfg.model.name, cfg.data.task, cfg.run.seed
    d, t, ev = cfg.data, cfg.train, cfg.eval
    prompts = None if d.prompts is None else Path(d.prompts).expanduser()
    _check_task(task)
    where = parse_device(cfg.model.device)
    if cfg.model.threads > 0:
        torch.set_num_threads(cfg.model.threads)
    draft_vocab = cfg.drafter.draft_vocab
    if draft_vocab is None:
        draft_vocab = 0 if drafter == "draft" else HEAD_DRAFT_VOCAB
    draft_layers = _draft_layers(model, cfg.drafter.draft_layers) if drafter == "draft" else None
    out = Path(cfg.run.out).expanduser() if cfg.run.out else drafter_cache_dir(model, drafter)
    problem = writable_problem(out, "dir")
    if problem:
        fail(f"cannot use run.out: {problem}")
    out.mkdir(parents=True, exist_ok=True)  # an OSError here (a race, a full disk): one line
    _record(cfg, out, prompts, draft_vocab if drafter != "draft" else None, draft_layers)
    torch.manual_seed(seed)
    target, tok = _load_target(model, where)
    stops = tuple(tok.stop_token_ids)
    if draft_vocab > target.config.vocab_size:
        fail(f"drafter.draft_vocab {draft_vocab} exceeds the target's vocabulary "
              f"({target.config.vocab_size})")  # fmt: skip
    feature_layers = () if drafter == "draft" else default_layers(drafter, target.config.num_layers)
    temps = list(d.temperatures)
    key = _data_key(target, tok, task, prompts, d.num_prompts, d.samples_per_prompt,
                    d.max_new_tokens, temps, seed)  # fmt: skip
    ex_key = key | {"feature_layers": ",".join(map(str, feature_layers))}
    ex_path = out / EXAMPLES_FILE
    examples = _cached_examples(ex_path, ex_key)
    if examples is None:
        _drop_states(out)  # trained on examples that are not these
        if prompts is not None:
            try:
                train_ids = data.jsonl_prompt_ids(tok, prompts)[: d.num_prompts]
            except (OSError, ValueError) as e:
                fail(str(e))
        else:
            train_ids = data.task_prompt_ids(tok, task, "train", d.num_prompts, seed)
        t0 = time.perf_counter()
        seq_path = out / "rollouts.json"
        seqs = _cached_rollouts(seq_path, key)
        if seqs is None:
            seqs = [s for temp in temps for s in data.rollouts(
                target, train_ids, d.samples_per_prompt if temp > 0 else 1, temp,
                d.max_new_tokens, stops, seed, progress=True)]  # fmt: skip
            data.save_rollouts(seqs, seq_path, key)
        if not seqs:
            fail("the target produced no completions to train on (try more data.num_prompts)")
        examples = data.build_examples(target, seqs, feature_layers, progress=True)
        data.save_examples(examples, ex_path, ex_key)
        ntok = sum(len(e.tokens) for e in examples)
        typer.echo(f"{len(examples)} examples, {ntok} tokens in {time.perf_counter() - t0:.0f}s")
    eval_ids = data.task_prompt_ids(tok, task, "eval", ev.prompts, seed)
    vocab = None
    if draft_vocab:
        completions = [e.tokens[e.prompt_len :].tolist() for e in examples]
        vocab = draft_vocab_by_frequency(completions, draft_vocab, target.config.vocab_size)
        covered = torch.isin(torch.cat([torch.tensor(c) for c in completions]), vocab)
        typer.echo(f"draft vocabulary {draft_vocab}: covers {covered.float().mean():.4f} "
                   "of training completion tokens")  # fmt: skip
    torch.manual_seed(seed)
    if drafter == "draft":  # ``head``: the drafter trained below, here a small model
        head = init_draft(target, draft_layers)  # fp32 master weights; the target stays bf16
    else:
        geometry = None
        if drafter == "block":
            geometry = {"layers": cfg.drafter.block_layers, "block_size": cfg.drafter.block_size}
        head = new_head(target, drafter, feature_layers, vocab, cfg.drafter.head_arch, geometry)
        head = head.float()  # fp32 master weights
    k = ev.num_spec_tokens

    def measure() -> dict[float, float]:
        return {temp: acceptance(target, head, eval_ids, k, temp, d.max_new_tokens, stops, seed)
                for temp in (0.0, 1.0)}  # fmt: skip

    before = measure()
    unroll = cfg.drafter.block_size if drafter == "block" else t.unroll  # depths trained
    decay = getattr(head, "decay", TrainConfig.decay)  # a head's recipe (a draft model: unused)
    train_cfg = TrainConfig(steps=t.steps, lr=t.lr, batch_size=t.batch_size, unroll=unroll,
                            decay=decay, ckpt_every=t.ckpt_every, seed=seed)  # fmt: skip
    t0 = time.perf_counter()
    try:
        if drafter == "draft":
            tok_dir = resolve_model(model)
            losses = distill(head, target, examples, train_cfg, out=out, tokenizer_dir=tok_dir)
        else:
            losses = train_head(head, examples, train_cfg, out=out)
        _report("trained", t.steps, t0, losses)
        if t.tv_steps and drafter != "draft":
            tv = replace(train_cfg, steps=t.tv_steps, lr=t.tv_lr, warmup=min(10, t.tv_steps),
                         loss="tv")  # fmt: skip
            t0 = time.perf_counter()
            losses = train_head(head, examples, tv, out=out, state_name=TV_STATE_FILE)
            _report("fine-tuned (total variation)", t.tv_steps, t0, losses)
    except NonFiniteWeights as e:
        fail(str(e))
    after = measure()
    typer.echo(f"saved {drafter} drafter to {out}")
    typer.echo(f"held-out acceptance length (k={k}, {len(eval_ids)} {task} eval prompts):")
    for temp in (0.0, 1.0):
        typer.echo(f"  T={temp:g}: untrained {before[temp]:.3f}  trained {after[temp]:.3f}")


def _record(
    cfg: TrainDrafterCfg,
    out: Path,
    prompts: Path | None,
    draft_vocab: int | None,
    draft_layers: int | None,
) -> None:
    """Write ``OUT/train_drafter.toml``: the settings the drafter is made with (``to_toml``),
    the defaults that depend on others resolved (the output directory, the draft vocabulary
    or layers) and paths absolute, so that ``--config`` on it makes the same drafter."""
    table = cfg.model_dump(mode="json", exclude_unset=True)
    settings.set_path(table, ["run", "out"], str(out.resolve()))
    if prompts is not None:
        settings.set_path(table, ["data", "prompts"], str(prompts.resolve()))
    if draft_vocab is not None:
        settings.set_path(table, ["drafter", "draft_vocab"], draft_vocab)
    if draft_layers is not None:
        settings.set_path(table, ["drafter", "draft_layers"], draft_layers)
    atomic_write(out / RECORD_FILE, load_train_drafter(table).to_toml())


def _load_target(model: str, device) -> tuple[Transformer, TextTokenizer]:
    """(bf16 target model on ``device``, tokenizer); a model that cannot be loaded exits 2
    with one line."""
    import torch

    from specrl.models.checkpoints import CheckpointError, load_model, load_tokenizer

    try:
        return load_model(model, dtype=torch.bfloat16, device=device), load_tokenizer(model)
    except CheckpointError as e:
        fail(str(e))


def _data_key(
    target: Transformer,
    tok: TextTokenizer,
    task: str,
    prompts: Path | None,
    num_prompts: int,
    samples_per_prompt: int,
    max_new_tokens: int,
    temps: list[float],
    seed: int,
) -> dict[str, str]:
    """What the rollouts are made by (strings: safetensors metadata holds only those): the
    prompts' source (the task, or the prompts file's sha256), the counts and lengths, the
    temperatures, the seed, the target's weight fingerprint, and sha256s of its tokenizer and
    chat template."""
    from specrl.models.fingerprint import fingerprint

    source = f"task {task}"
    if prompts is not None:
        source = f"prompts file sha256 {file_digest(prompts)['sha256'][:16]}"
    template = str(tok.config.get("chat_template") or "")
    return {
        "source": source,
        "num_prompts": str(num_prompts),
        "samples_per_prompt": str(samples_per_prompt),
        "max_new_tokens": str(max_new_tokens),
        "temperatures": ",".join(f"{t:g}" for t in temps),
        "seed": str(seed),
        "model": fingerprint(dict(target.named_parameters())),
        "tokenizer": _sha(tok.tok.to_str()),
        "template": _sha(template),
    }


def _sha(text: str) -> str:
    """The first 16 hex digits of the sha256 of ``text``."""
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _notice(line: str) -> None:
    """A ``notice:`` line on stderr (a cache not used, and why)."""
    typer.echo(f"notice: {line}", err=True)


def _cached_examples(path: Path, key: dict[str, str]) -> list | None:
    """The examples saved in ``path`` by an earlier run made by ``key``; None (saying why in
    a notice) if there are none or they are unusable or were made by something else."""
    from specrl.drafters import data

    if not path.exists():
        return None
    try:
        examples = data.load_examples(path, key)
    except ValueError as e:  # StaleData too
        _notice(f"not using {path}: {e}; building the examples again")
        return None
    typer.echo(f"loaded {len(examples)} examples from {path}")
    return examples


def _cached_rollouts(path: Path, key: dict[str, str]) -> list | None:
    """The rollouts saved in ``path`` by an earlier run made by ``key``; None (saying why in a
    notice) if there are none or they are unusable or were made by something else."""
    from specrl.drafters import data

    if not path.exists():
        return None
    try:
        return data.load_rollouts(path, key)
    except ValueError as e:  # StaleData too
        _notice(f"not using {path}: {e}; generating the rollouts again")
        return None


def _drop_states(out: Path) -> None:
    """Remove the training states in ``out`` (a notice if there were any): they were trained
    on examples that are being rebuilt, so training starts again from step 0."""
    from specrl.drafters.train import STATE_FILE

    found = [out / n for n in (STATE_FILE, TV_STATE_FILE) if (out / n).exists()]
    for path in found:
        path.unlink()
    if found:
        names = ", ".join(p.name for p in found)
        _notice(f"removed {names} (trained on other examples); training from step 0")


def _report(what: str, steps: int, t0: float, losses: list[float]) -> None:
    tail = losses[-10:]
    typer.echo(f"{what} {steps} steps in {time.perf_counter() - t0:.0f}s, loss "
               f"{losses[0]:.3f} -> {sum(tail) / len(tail):.3f}")  # fmt: skip


def _check_task(task: str) -> None:
    """``data.task`` names a reasoning-gym task (did-you-mean hint; exit 2 otherwise)."""
    from specrl.envs.reasoning_gym_env import check_task

    try:
        check_task(task)
    except ValueError as e:
        fail(f"data.task: {e}")


def _draft_layers(model: str, layers: int | None) -> int:
    """``drafter.draft_layers`` of ``kind='draft'`` (default ``DEFAULT_LAYERS``), which must fit
    in the target (its config is read, not its weights)."""
    from specrl.drafters.distill import DEFAULT_LAYERS
    from specrl.models.checkpoints import CheckpointError, load_config, resolve_model

    layers = DEFAULT_LAYERS if layers is None else layers
    try:
        top = load_config(resolve_model(model)).num_layers
    except CheckpointError as e:
        fail(str(e))
    if not 1 <= layers <= top:
        fail(f"drafter.draft_layers must be in [1, {top}] (the target's layer count), "
             f"got {layers}")  # fmt: skip
    return layers
