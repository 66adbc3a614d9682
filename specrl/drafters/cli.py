"""``specrl train-drafter`` and ``specrl export-drafter``: train a drafter, export it for vLLM.

``register(app)`` adds both commands. ``train-drafter`` generates the target's own completions
on a reasoning-gym task's train split (or ``--prompts F.jsonl``), trains a head (or, with
``--drafter draft``, distills a layer-prefix draft model), resumably with checkpoints and cached
data in ``--out``, saves it, and prints held-out acceptance untrained vs trained. The cached
rollouts and examples are keyed by what made them (``_data_key``: the prompts' source, counts,
lengths, temperatures, seed, the model's fingerprint, tokenizer and chat template; the examples
also by the feature layers): a cache made by anything else, or before keys, is rebuilt with one
``notice:`` line on stderr saying why (and the training states made from it are dropped), never
reused. ``export-drafter`` writes a trained drafter in the layout vLLM loads, after checking
its files against their manifest (``drafters.export``). Bad values, unusable paths, damaged
drafters and OSErrors exit 2 with one ``error:`` line (before any work where they can); a failed
export leaves no output directory it created.
Details: docs/internals.md.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from specrl.cli_util import fail, parse_device
from specrl.errors import unknown
from specrl.fsutil import file_digest, writable_problem
from specrl.paths import drafter_cache_dir

if TYPE_CHECKING:
    from specrl.models.tokenizer import TextTokenizer
    from specrl.models.transformer import Transformer


def register(app: typer.Typer) -> None:
    """Add ``train-drafter`` and ``export-drafter`` to ``app``."""
    resume = " (rerun to resume from what was saved)"
    app.command("train-drafter")(_os_errors_in_one_line(train_drafter, resume))
    app.command("export-drafter")(_os_errors_in_one_line(export_drafter, ""))


def _os_errors_in_one_line(command: Callable, hint: str) -> Callable:
    """``command`` with an OSError (unwritable ``--out``, a full disk) ending in one ``error:``
    line (``hint`` appended) and exit 2 instead of a traceback."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except OSError as e:
            where = f": {e.filename}" if e.filename else ""
            fail(f"{e.strerror or e}{where}{hint}")

    return run


EXAMPLES_FILE = "examples.safetensors"  # specrl.drafters.data.save_examples
TV_STATE_FILE = "train_state_tv.safetensors"  # the TV phase's specrl.drafters.train state
HEAD_DRAFT_VOCAB = 4096  # covers every completion token of the default data (SmolLM2, arithmetic)
TV_STEPS = 300  # total-variation fine-tuning steps of the default head recipe


def train_drafter(
    drafter: Annotated[str, typer.Option("--drafter", help="eagle3 | mtp | draft")] = "eagle3",
    model: Annotated[str, typer.Option("--model", help="target model")] = "smollm2-135m-instruct",
    prompts: Annotated[
        Path | None,
        typer.Option(
            "--prompts",
            help='JSONL: "text", {"prompt": ...} or {"messages": [...]} (default: --task)',
        ),
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
    head_arch: Annotated[
        str,
        typer.Option(
            "--head-arch",
            help="eagle3 heads: proj (specrl's layer: inputs projected 2H->H) or eagle3 "
            "(the EAGLE-3 paper's and vLLM's layer; `specrl export-drafter` writes it for vLLM)",
        ),
    ] = "proj",
    threads: Annotated[int, typer.Option("--threads", help="torch threads (0 = default)")] = 0,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    device: Annotated[
        str,
        typer.Option(
            "--device",
            help="auto (CUDA when present, else cpu), cpu, cuda or cuda:N: where the target "
            "rolls out and the drafter trains",
        ),
    ] = "auto",
) -> None:
    """Train an EAGLE-3 / MTP drafter or distill a draft model on the target's own rollouts."""
    import torch

    from specrl.drafters import data
    from specrl.drafters.distill import distill, init_draft
    from specrl.drafters.train import NonFiniteWeights, TrainConfig, acceptance, train_head
    from specrl.models.checkpoints import resolve_model
    from specrl.models.heads import DraftHead, default_layers, draft_vocab_by_frequency
    from specrl.sampling import MAX_SEED

    if drafter not in ("eagle3", "mtp", "draft"):
        fail(unknown("--drafter", drafter, ["eagle3", "mtp", "draft"]))
    if head_arch not in ("proj", "eagle3"):
        fail(unknown("--head-arch", head_arch, ["proj", "eagle3"]))
    if head_arch != "proj" and drafter != "eagle3":
        fail(f"--head-arch {head_arch} applies to --drafter eagle3, not {drafter}")
    for name, value in [("steps", steps), ("num-prompts", num_prompts), ("unroll", unroll)]:
        if value < 1:
            fail(f"--{name} must be >= 1, got {value}")
    if tv_steps < 0:
        fail(f"--tv-steps must be >= 0, got {tv_steps}")
    if not 0 <= seed <= MAX_SEED:
        fail(f"--seed must be in [0, 2**63 - 1], got {seed}")
    if draft_vocab is None:
        draft_vocab = 0 if drafter == "draft" else HEAD_DRAFT_VOCAB
    if draft_vocab < 0:
        fail(f"--draft-vocab must be >= 0 (0 = full vocabulary), got {draft_vocab}")
    _check_bounds({"num-prompts": num_prompts, "samples-per-prompt": samples_per_prompt,
                   "max-new-tokens": max_new_tokens, "steps": steps, "tv-steps": tv_steps,
                   "batch-size": batch_size, "unroll": unroll, "ckpt-every": ckpt_every,
                   "eval-prompts": eval_prompts, "num-spec-tokens": k,
                   "draft-vocab": draft_vocab, "threads": threads})  # fmt: skip
    _check_lr("lr", lr)
    _check_lr("tv-lr", tv_lr)
    temps = _temperatures(temperature)
    if prompts is not None and not prompts.is_file():
        fail(f"--prompts file {prompts} does not exist or is not a file")
    _check_task(task)
    where = parse_device(device)
    if threads > 0:
        torch.set_num_threads(threads)
    if drafter == "draft":
        draft_layers = _draft_options(model, draft_layers, draft_vocab)
    elif draft_layers is not None:
        fail(f"--draft-layers applies only with --drafter draft, not {drafter}")
    out = out or drafter_cache_dir(model, drafter)
    problem = writable_problem(out, "dir")
    if problem:
        fail(f"cannot use --out: {problem}")
    out.mkdir(parents=True, exist_ok=True)  # an OSError here (a race, a full disk): one line
    torch.manual_seed(seed)
    target, tok = _load_target(model, where)
    stops = tuple(tok.stop_token_ids)
    if draft_vocab > target.config.vocab_size:
        fail(f"--draft-vocab {draft_vocab} exceeds the target's vocabulary "
              f"({target.config.vocab_size})")  # fmt: skip
    feature_layers = () if drafter == "draft" else default_layers(drafter, target.config.num_layers)
    key = _data_key(target, tok, task, prompts, num_prompts, samples_per_prompt,
                    max_new_tokens, temps, seed)  # fmt: skip
    ex_key = key | {"feature_layers": ",".join(map(str, feature_layers))}
    ex_path = out / EXAMPLES_FILE
    examples = _cached_examples(ex_path, ex_key)
    if examples is None:
        _drop_states(out)  # trained on examples that are not these
        if prompts is not None:
            try:
                train_ids = data.jsonl_prompt_ids(tok, prompts)[:num_prompts]
            except (OSError, ValueError) as e:
                fail(str(e))
        else:
            train_ids = data.task_prompt_ids(tok, task, "train", num_prompts, seed)
        t0 = time.perf_counter()
        seq_path = out / "rollouts.json"
        seqs = _cached_rollouts(seq_path, key)
        if seqs is None:
            seqs = [s for t in temps for s in data.rollouts(
                target, train_ids, samples_per_prompt if t > 0 else 1, t, max_new_tokens, stops,
                seed, progress=True)]  # fmt: skip
            data.save_rollouts(seqs, seq_path, key)
        if not seqs:
            fail("the target produced no completions to train on (try more --num-prompts)")
        examples = data.build_examples(target, seqs, feature_layers, progress=True)
        data.save_examples(examples, ex_path, ex_key)
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
        head = DraftHead(target, drafter, feature_layers, vocab, arch=head_arch)
        head = head.float()  # fp32 master weights

    def measure() -> dict[float, float]:
        return {t: acceptance(target, head, eval_ids, k, t, max_new_tokens, stops, seed)
                for t in (0.0, 1.0)}  # fmt: skip

    before = measure()
    cfg = TrainConfig(steps=steps, lr=lr, batch_size=batch_size, unroll=unroll,
                      ckpt_every=ckpt_every, seed=seed)  # fmt: skip
    t0 = time.perf_counter()
    try:
        if drafter == "draft":
            tok_dir = resolve_model(model)
            losses = distill(head, target, examples, cfg, out=out, tokenizer_dir=tok_dir)
        else:
            losses = train_head(head, examples, cfg, out=out)
        _report("trained", steps, t0, losses)
        if tv_steps and drafter != "draft":
            tv = replace(cfg, steps=tv_steps, lr=tv_lr, warmup=min(10, tv_steps), loss="tv")
            t0 = time.perf_counter()
            losses = train_head(head, examples, tv, out=out, state_name=TV_STATE_FILE)
            _report("fine-tuned (total variation)", tv_steps, t0, losses)
    except NonFiniteWeights as e:
        fail(str(e))
    after = measure()
    typer.echo(f"saved {drafter} drafter to {out}")
    typer.echo(f"held-out acceptance length (k={k}, {len(eval_ids)} {task} eval prompts):")
    for t in (0.0, 1.0):
        typer.echo(f"  T={t:g}: untrained {before[t]:.3f}  trained {after[t]:.3f}")


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


# Each integer option's range (a bad value is one line naming it, before anything is written).
BOUNDS = {
    "num-prompts": (1, 1_000_000),
    "samples-per-prompt": (1, 1024),
    "max-new-tokens": (1, 32768),
    "steps": (1, 1_000_000),
    "tv-steps": (0, 1_000_000),
    "batch-size": (1, 4096),
    "unroll": (1, 16),
    "ckpt-every": (1, 1_000_000),
    "eval-prompts": (1, 100_000),
    "num-spec-tokens": (1, 16),
    "draft-vocab": (0, 1_000_000),
    "threads": (0, 1024),
}


def _check_bounds(values: dict[str, int]) -> None:
    """Each option of ``values`` within its ``BOUNDS`` (exit 2 with one line otherwise)."""
    for name, value in values.items():
        lo, hi = BOUNDS[name]
        if not lo <= value <= hi:
            fail(f"--{name} must be in [{lo}, {hi}], got {value}")


def _check_lr(name: str, value: float) -> None:
    """A learning rate: finite, in (0, 1] (exit 2 with one line otherwise)."""
    if not (math.isfinite(value) and 0 < value <= 1):
        fail(f"--{name} must be a finite number in (0, 1], got {value}")


def _check_task(task: str) -> None:
    """``--task`` names a reasoning-gym task (did-you-mean hint; exit 2 otherwise)."""
    from specrl.envs.reasoning_gym_env import check_task

    try:
        check_task(task)
    except ValueError as e:
        fail(f"--task: {e}")


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


EXPORT_DTYPES = ("float32", "bfloat16", "float16")
_VLLM_METHOD = {"eagle3": "eagle3", "draft": "draft_model"}  # vLLM's speculative method


def export_drafter(
    drafter: Annotated[str, typer.Option("--drafter", help="eagle3 | draft")] = "eagle3",
    source: Annotated[
        Path | None,
        typer.Option(
            "--from",
            help="the trained drafter's directory (default: where `specrl train-drafter` "
            "saves it for --model)",
        ),
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", help="output directory (required)")] = None,
    model: Annotated[
        str, typer.Option("--model", help="target model (eagle3: its LM head rows are written)")
    ] = "smollm2-135m-instruct",
    dtype: Annotated[
        str | None,
        typer.Option("--dtype", help="eagle3: float32 | bfloat16 | float16 (default: the head's)"),
    ] = None,
) -> None:
    """Export a trained drafter to the layout vLLM loads (EAGLE-3 head or HF draft model).

    Then serve with vLLM: speculative_config {"method": "eagle3" or "draft_model", "model": OUT}.
    """
    import torch

    from specrl.drafters.export import ExportError, export_draft_model, export_eagle3

    if drafter == "mtp":
        fail("vLLM runs MTP only from the MTP layers built into specific models' own checkpoints "
             "(DeepSeek-V3, MiMo, Qwen3-Next, ...): an MTP head cannot be exported; "
             "use --drafter eagle3 or draft")  # fmt: skip
    if drafter not in ("eagle3", "draft"):
        fail(unknown("--drafter", drafter, ["eagle3", "draft"]))
    if out is None:
        fail("--out is required")
    if dtype is not None and (drafter != "eagle3" or dtype not in EXPORT_DTYPES):
        fail(f"--dtype must be one of {', '.join(EXPORT_DTYPES)} (eagle3 only), got {dtype!r}")
    source = source or drafter_cache_dir(model, drafter)
    if not source.is_dir():
        fail(f"--from {source} is not a directory (train one with specrl train-drafter "
             f"--drafter {drafter})")  # fmt: skip
    problem = writable_problem(out, "dir")
    if problem:
        fail(f"cannot use --out: {problem}")
    try:
        if drafter == "eagle3":
            if out.resolve() == source.resolve():
                fail("--out must differ from --from (the head's own files would be mixed in)")
            export_eagle3(source, model, out, None if dtype is None else getattr(torch, dtype))
        else:
            # the target's tokenizer only when the draft is a model without one (resolving a
            # bundled target converts it once: not for a --from that is no model at all)
            needs = (source / "config.json").is_file() and not (source / "tokenizer.json").is_file()
            export_draft_model(source, out, _tokenizer_dir(model) if needs else None)
    except ExportError as e:
        fail(str(e))
    method = _VLLM_METHOD[drafter]
    typer.echo(f"exported {drafter} drafter {source} to {out} "
               f'(vLLM: speculative_config method "{method}", model {out})')  # fmt: skip


def _tokenizer_dir(model: str) -> Path | None:
    """The target's model directory (for its tokenizer files), or None if it cannot be found."""
    from specrl.models.checkpoints import CheckpointError, resolve_model

    try:
        return resolve_model(model)
    except CheckpointError:
        return None
