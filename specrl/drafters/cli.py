"""``specrl train-drafter``: build data from the target's rollouts, train a head, report acceptance.

Contract: ``register(app)`` adds the command. It generates the target's own completions on the
train split of a reasoning-gym task (or ``--prompts F.jsonl``), records the target features
(``specrl.drafters.data``), trains the head (``specrl.drafters.train``; progress bar, checkpoint
every ``--ckpt-every`` steps in ``--out``; heads are then fine-tuned ``--tv-steps`` steps on the
total-variation loss, checkpointed apart; rerunning the same command resumes, and reuses the
rollouts and examples cached in ``--out/rollouts.json`` and ``--out/examples.pt``), saves
``head.safetensors`` + ``head.json`` in ``--out`` (default ``specrl.paths.drafter_cache_dir``:
``cache_dir()/drafters/<model>-<drafter>``), then prints the held-out acceptance length (k, T=0
and T=1) on the task's eval split, untrained vs trained. ``--drafter draft`` instead distills a
small draft model, the target's first ``--draft-layers`` layers (``specrl.drafters.distill``),
saved in ``--out`` as a model directory for ``--spec draft --drafter DIR``; untrained = the
undistilled layer prefix. The defaults are the recipe of the cached default drafters
(docs/drafters.md). Bad values exit 2 with one ``error:`` line.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from specrl.cli_util import fail
from specrl.paths import drafter_cache_dir


def register(app: typer.Typer) -> None:
    """Add ``train-drafter`` to ``app``."""
    app.command("train-drafter")(train_drafter)


HEAD_DRAFT_VOCAB = 4096  # covers every completion token of the default data (SmolLM2, arithmetic)
TV_STEPS = 300  # total-variation fine-tuning steps of the default head recipe


def train_drafter(
    drafter: Annotated[str, typer.Option("--drafter", help="eagle3 | mtp | draft")] = "eagle3",
    model: Annotated[str, typer.Option("--model", help="target model")] = "smollm2-135m-instruct",
    prompts: Annotated[
        Path | None, typer.Option("--prompts", help='JSONL of {"prompt": ...} (default: task)')
    ] = None,
    task: Annotated[str, typer.Option("--task", help="reasoning-gym task")] = "basic_arithmetic",
    out: Annotated[Path | None, typer.Option("--out", help="output dir")] = None,
    num_prompts: Annotated[int, typer.Option("--num-prompts")] = 800,
    samples_per_prompt: Annotated[int, typer.Option("--samples-per-prompt")] = 2,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 96,
    temperature: Annotated[
        str,
        typer.Option(
            "--temperature",
            help="rollout temperature(s), comma list (e.g. 1,0: sampled and greedy "
            "completions); T=0 takes one completion per prompt",
        ),
    ] = "1,0",
    steps: Annotated[int, typer.Option("--steps")] = 1500,
    lr: Annotated[float, typer.Option("--lr")] = 1e-3,
    tv_steps: Annotated[
        int,
        typer.Option(
            "--tv-steps",
            help="eagle3/mtp: then fine-tune this many steps on the total-variation loss "
            "(the rejection probability, which sampled acceptance depends on); 0 = off",
        ),
    ] = TV_STEPS,
    tv_lr: Annotated[float, typer.Option("--tv-lr", help="learning rate of the TV phase")] = 3e-4,
    batch_size: Annotated[int, typer.Option("--batch-size")] = 8,
    unroll: Annotated[int, typer.Option("--unroll", help="training-time-test depth")] = 3,
    ckpt_every: Annotated[int, typer.Option("--ckpt-every")] = 100,
    eval_prompts: Annotated[int, typer.Option("--eval-prompts")] = 24,
    k: Annotated[int, typer.Option("--num-spec-tokens", help="k for held-out acceptance")] = 3,
    draft_vocab: Annotated[
        int | None,
        typer.Option(
            "--draft-vocab",
            help="reduced draft vocabulary for a head: the N most frequent completion tokens "
            f"of the training rollouts (0 = the target's full vocabulary; default "
            f"{HEAD_DRAFT_VOCAB} for eagle3/mtp, not available for draft)",
        ),
    ] = None,
    draft_layers: Annotated[
        int | None,
        typer.Option(
            "--draft-layers",
            help="--drafter draft: keep the target's first N layers (default: "
            "specrl.drafters.distill.DEFAULT_LAYERS)",
        ),
    ] = None,
    threads: Annotated[int, typer.Option("--threads", help="torch threads (0 = default)")] = 0,
    seed: Annotated[int, typer.Option("--seed")] = 0,
) -> None:
    """Train an EAGLE-3 / MTP drafter or distill a draft model on the target's own rollouts."""
    import torch

    from specrl.drafters import data
    from specrl.drafters.distill import distill, init_draft
    from specrl.drafters.train import TrainConfig, acceptance, train_head
    from specrl.models.checkpoints import load_model, load_tokenizer, resolve_model
    from specrl.models.heads import DraftHead, default_layers, draft_vocab_by_frequency

    if drafter not in ("eagle3", "mtp", "draft"):
        fail(f"unknown --drafter {drafter!r} (choose eagle3, mtp or draft)")
    for name, value in [("steps", steps), ("num-prompts", num_prompts), ("unroll", unroll)]:
        if value < 1:
            fail(f"--{name} must be >= 1, got {value}")
    if tv_steps < 0:
        fail(f"--tv-steps must be >= 0, got {tv_steps}")
    if draft_vocab is None:
        draft_vocab = 0 if drafter == "draft" else HEAD_DRAFT_VOCAB
    if draft_vocab < 0:
        fail(f"--draft-vocab must be >= 0 (0 = full vocabulary), got {draft_vocab}")
    temps = _temperatures(temperature)
    if prompts is not None and not prompts.exists():
        fail(f"--prompts file {prompts} does not exist")
    if threads > 0:
        torch.set_num_threads(threads)
    if drafter == "draft":
        draft_layers = _draft_options(model, draft_layers, draft_vocab)
    out = out or drafter_cache_dir(model, drafter)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    target = load_model(model, dtype=torch.bfloat16)
    tok = load_tokenizer(model)
    stops = tuple(tok.stop_token_ids)
    if draft_vocab > target.config.vocab_size:
        fail(f"--draft-vocab {draft_vocab} exceeds the target's vocabulary "
              f"({target.config.vocab_size})")  # fmt: skip
    feature_layers = () if drafter == "draft" else default_layers(drafter, target.config.num_layers)
    ex_path = out / "examples.pt"
    if ex_path.exists():
        examples = data.load_examples(ex_path)
        typer.echo(f"loaded {len(examples)} examples from {ex_path}")
    else:
        if prompts is not None:
            train_ids = data.jsonl_prompt_ids(tok, prompts)[:num_prompts]
        else:
            train_ids = data.task_prompt_ids(tok, task, "train", num_prompts, seed)
        t0 = time.perf_counter()
        seq_path = out / "rollouts.json"
        if seq_path.exists():
            seqs = [data.Sequence(**d) for d in json.loads(seq_path.read_text())]
        else:
            seqs = [s for t in temps for s in data.rollouts(
                target, train_ids, samples_per_prompt if t > 0 else 1, t, max_new_tokens, stops,
                seed, progress=True)]  # fmt: skip
            seq_path.write_text(json.dumps([vars(s) for s in seqs]))
        examples = data.build_examples(target, seqs, feature_layers, progress=True)
        data.save_examples(examples, ex_path)
        ntok = sum(len(e.tokens) for e in examples)
        typer.echo(f"{len(examples)} examples, {ntok} tokens in {time.perf_counter() - t0:.0f}s")
    eval_ids = data.task_prompt_ids(tok, task, "eval", eval_prompts, seed)
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
        head = DraftHead(target, drafter, feature_layers, vocab).float()  # fp32 master weights

    def measure() -> dict[float, float]:
        return {t: acceptance(target, head, eval_ids, k, t, max_new_tokens, stops, seed)
                for t in (0.0, 1.0)}  # fmt: skip

    before = measure()
    cfg = TrainConfig(steps=steps, lr=lr, batch_size=batch_size, unroll=unroll,
                      ckpt_every=ckpt_every, seed=seed)  # fmt: skip
    t0 = time.perf_counter()
    if drafter == "draft":
        losses = distill(head, target, examples, cfg, out=out, tokenizer_dir=resolve_model(model))
    else:
        losses = train_head(head, examples, cfg, out=out)
    _report("trained", steps, t0, losses)
    if tv_steps and drafter != "draft":
        tv = replace(cfg, steps=tv_steps, lr=tv_lr, warmup=min(10, tv_steps), loss="tv")
        t0 = time.perf_counter()
        losses = train_head(head, examples, tv, out=out, state_name="train_state_tv.pt")
        _report("fine-tuned (total variation)", tv_steps, t0, losses)
    after = measure()
    typer.echo(f"saved {drafter} drafter to {out}")
    typer.echo(f"held-out acceptance length (k={k}, {len(eval_ids)} {task} eval prompts):")
    for t in (0.0, 1.0):
        typer.echo(f"  T={t:g}: untrained {before[t]:.3f}  trained {after[t]:.3f}")


def _report(what: str, steps: int, t0: float, losses: list[float]) -> None:
    tail = losses[-10:]
    typer.echo(f"{what} {steps} steps in {time.perf_counter() - t0:.0f}s, loss "
               f"{losses[0]:.3f} -> {sum(tail) / len(tail):.3f}")  # fmt: skip


def _temperatures(text: str) -> list[float]:
    """``--temperature`` as a list of floats, each in [0, 10] (exit 2 otherwise)."""
    try:
        temps = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        temps = []
    if not temps or not all(0 <= t <= 10 for t in temps):
        fail(f"--temperature must be a comma list of numbers in [0, 10], got {text!r}")
    return temps


def _draft_options(model: str, layers: int | None, draft_vocab: int) -> int:
    """Checks the options of ``--drafter draft``; returns ``--draft-layers`` (default
    ``DEFAULT_LAYERS``), which must fit in the target (its config is read, not its weights)."""
    from specrl.drafters.distill import DEFAULT_LAYERS
    from specrl.models.checkpoints import CheckpointError, load_config, resolve_model

    if draft_vocab:
        fail("--draft-vocab applies to the eagle3 and mtp heads, not to --drafter draft")
    layers = DEFAULT_LAYERS if layers is None else layers
    try:
        top = load_config(resolve_model(model)).num_layers
    except CheckpointError as e:
        fail(str(e))
    if not 1 <= layers <= top:
        fail(f"--draft-layers must be in [1, {top}] (the target's layer count), got {layers}")
    return layers
