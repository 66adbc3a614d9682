"""Settings of ``specrl train-drafter``: ``TrainDrafterCfg`` and its TOML, read like a run's config.

``TrainDrafterCfg()`` is the default recipe (sections model, drafter, data, train, eval, run: the
recipe of the cached default drafters). ``load_train_drafter(path, overrides)`` layers a TOML
file and ``section.key=value`` overrides over the defaults, validated by ``specrl.settings``:
every problem is one ``SettingsError`` line (``bad value for KEY: ...``, ``unknown train-drafter
key 'KEY' (did you mean X?); valid keys in [TABLE]: ...``); a field set where it cannot apply
(``APPLIES_ONLY``: ``drafter.head_arch`` needs ``drafter.kind='eagle3'``, ...) is refused,
naming both fields. ``COVERAGE`` classifies every field (``settings.Coverage``): what needs more
than the model (the task's name, the target's layer count and vocabulary, a writable
``run.out``) is checked by ``specrl.drafters.cli``. ``TrainDrafterCfg.to_toml()`` reads back
equal (``train-drafter`` records it as ``OUT/train_drafter.toml``). Types and bounds only. A
leaf: imports ``settings`` and ``errors`` only. Details: docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator

from specrl import settings
from specrl.settings import AppliesOnly, Section, SettingsError, under

# The largest seed: specrl.sampling.MAX_SEED (this module stays torch-free; a test checks).
MAX_SEED = 2**63 - 1
HEAD_DRAFT_VOCAB = 4096  # covers every completion token of the default data (SmolLM2, arithmetic)
TV_STEPS = 300  # total-variation fine-tuning steps of the default head recipe
RECORD_FILE = "train_drafter.toml"  # the settings a drafter directory was made with


class TdModelCfg(Section):
    """The target model whose drafter is trained."""

    name: str = Field(
        "smollm2-135m-instruct",
        min_length=1,
        description="Target model: a bundled name, a Hugging Face-style directory or a .gguf file.",
    )
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="Where the target rolls out and the drafter trains: 'cpu', 'cuda', "
        "'cuda:N' or 'auto' (CUDA when present, else the CPU).",
    )
    threads: int = Field(0, ge=0, le=1024, description="Torch threads (0 = torch's default).")


class TdDrafterCfg(Section):
    """What is trained."""

    kind: Literal["eagle3", "mtp", "block", "draft"] = Field(
        "eagle3",
        description="'eagle3' or 'mtp': a head on the target's features; 'block': a block "
        "drafter on them (DFlash-style: drafter.block_size drafts in one forward); 'draft': a "
        "draft model distilled from the target's first drafter.draft_layers layers.",
    )
    block_size: int = Field(
        8,
        ge=1,
        le=16,
        description="kind='block': the draft positions of its block, trained together (the "
        "most drafts per step it is built for; the training depth, as train.unroll is a "
        "head's).",
    )
    block_layers: int = Field(2, ge=1, le=64, description="kind='block': its decoder layers.")
    head_arch: Literal["proj", "eagle3"] = Field(
        "proj",
        description="kind='eagle3': 'proj' (specrl's layer: inputs projected 2H->H) or 'eagle3' "
        "(the EAGLE-3 paper's and vLLM's layer; `specrl export-drafter` writes it for vLLM).",
    )
    draft_vocab: int | None = Field(
        None,
        ge=0,
        le=1_000_000,
        description="kind 'eagle3'/'mtp': reduced draft vocabulary, the N most frequent "
        "completion tokens of the training rollouts (0 = the target's full vocabulary; at most "
        f"the target's); unset: {HEAD_DRAFT_VOCAB}.",
    )
    draft_layers: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="kind='draft': keep the target's first N layers (at most its layer count); "
        "unset: specrl.drafters.distill.DEFAULT_LAYERS.",
    )


class TdDataCfg(Section):
    """The training data: the target's own completions of train prompts."""

    task: str = Field(
        "basic_arithmetic",
        min_length=1,
        description="Reasoning-gym task: its train split gives the prompts (unless data.prompts "
        "is set), its eval split the held-out prompts of the acceptance report.",
    )
    prompts: str | None = Field(
        None,
        description='Train prompts from a JSONL file instead of data.task: lines "text", '
        '{"prompt": ...} or {"messages": [...]} (unset: the task\'s train split).',
    )
    num_prompts: int = Field(800, ge=1, le=1_000_000, description="Train prompts.")
    samples_per_prompt: int = Field(
        2, ge=1, le=1024, description="Completions per prompt at each temperature above 0."
    )
    max_new_tokens: int = Field(
        96, ge=1, le=32768, description="Most tokens per completion (rollouts and evaluation)."
    )
    temperatures: list[Annotated[float, Field(ge=0.0, le=10.0)]] = Field(
        [1.0, 0.0],
        min_length=1,
        max_length=64,
        description="Rollout temperatures, each in [0, 10] ([1, 0]: sampled and greedy "
        "completions); T=0 takes one completion per prompt.",
    )

    @field_validator("prompts")
    @classmethod
    def _prompts_file(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).expanduser().is_file():
            raise ValueError(f"prompts file {v} does not exist or is not a file")
        return v


class TdTrainCfg(Section):
    """How the drafter trains (resumable: checkpoints in run.out)."""

    steps: int = Field(1500, ge=1, le=1_000_000, description="Training steps.")
    lr: float = Field(1e-3, gt=0.0, le=1.0, description="Learning rate.")
    batch_size: int = Field(8, ge=1, le=4096, description="Sequences per step.")
    unroll: int = Field(3, ge=1, le=16, description="Training-time-test depth.")
    ckpt_every: int = Field(100, ge=1, le=1_000_000, description="Checkpoint every N steps.")
    tv_steps: int = Field(
        TV_STEPS,
        ge=0,
        le=1_000_000,
        description="kind 'eagle3'/'mtp': then fine-tune this many steps on the "
        "total-variation loss (the rejection probability, which sampled acceptance depends "
        "on); 0 = off.",
    )
    tv_lr: float = Field(
        3e-4, gt=0.0, le=1.0, description="kind 'eagle3'/'mtp': learning rate of the TV phase."
    )


class TdEvalCfg(Section):
    """The held-out acceptance report (untrained vs trained, T=0 and T=1)."""

    prompts: int = Field(24, ge=1, le=100_000, description="Eval prompts of data.task.")
    num_spec_tokens: int = Field(3, ge=1, le=16, description="Draft tokens per verify step (k).")


class TdRunCfg(Section):
    """Where the drafter goes, and the seed."""

    out: str | None = Field(
        None,
        description="Output directory: the drafter, its checkpoints and cached data (rerun to "
        "resume); unset: the cache directory specrl's commands look in "
        "(cache_dir()/drafters/<model>-<kind>).",
    )
    seed: int = Field(
        0, ge=0, le=MAX_SEED, description="Seed of prompts, sampling and initialisation."
    )


def _is(value: Any) -> Callable[[Any], bool]:
    return lambda v: v == value


_HEADS = " other than 'draft'"

# Fields that apply only while another holds: set where they cannot apply, they are refused
# (``TrainDrafterCfg``), and ``to_toml`` writes them only as comments there.
APPLIES_ONLY: tuple[AppliesOnly, ...] = (
    AppliesOnly("drafter.head_arch", "drafter.kind", _is("eagle3"), "='eagle3'"),
    AppliesOnly("drafter.draft_layers", "drafter.kind", _is("draft"), "='draft'"),
    *settings.each(("drafter.block_size", "drafter.block_layers"), "drafter.kind",
                   _is("block"), "='block'"),
    AppliesOnly("train.unroll", "drafter.kind", lambda k: k != "block", " other than 'block'"),
    *settings.each(
        ("drafter.draft_vocab", "train.tv_steps", "train.tv_lr"), "drafter.kind",
        lambda k: k != "draft", _HEADS,
    ),
)  # fmt: skip

# Every field of ``TrainDrafterCfg`` in a class (tests/drafters/test_train_drafter_cli.py).
COVERAGE = settings.Coverage(
    rules=APPLIES_ONLY,
    always=(
        *under("model", "name", "device", "threads"),
        "drafter.kind",
        *under("data", "prompts", "num_prompts", "samples_per_prompt", "max_new_tokens",
               "temperatures"),
        *under("train", "steps", "lr", "batch_size", "ckpt_every"),
        *under("eval", "prompts", "num_spec_tokens"),
        *under("run", "out", "seed"),
    ),
    checked=(
        ("data.task", "drafters.cli._check_task: a reasoning-gym task (did-you-mean)"),
        ("drafter.draft_layers", "drafters.cli._draft_layers: at most the target's layer count"),
        ("drafter.draft_vocab", "drafters.cli: at most the target's vocabulary"),
    ),
)  # fmt: skip


class TrainDrafterCfg(settings.RuledSettings):
    """Settings of `specrl train-drafter` (load with --config FILE; --set section.key=value)."""

    WHAT: ClassVar[str] = "train-drafter"
    RULES: ClassVar[tuple[AppliesOnly, ...]] = APPLIES_ONLY

    model: TdModelCfg = Field(default_factory=TdModelCfg, description="The target.")
    drafter: TdDrafterCfg = Field(default_factory=TdDrafterCfg, description="The drafter.")
    data: TdDataCfg = Field(default_factory=TdDataCfg, description="Training data.")
    train: TdTrainCfg = Field(default_factory=TdTrainCfg, description="Training.")
    eval: TdEvalCfg = Field(default_factory=TdEvalCfg, description="Held-out acceptance.")
    run: TdRunCfg = Field(default_factory=TdRunCfg, description="Output and seed.")


# For an unknown dotted key: `` (did you mean X?); valid keys in [TABLE]: ...``.
key_hint = TrainDrafterCfg.hint()


def load_train_drafter(
    path: str | Path | dict[str, Any] | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> TrainDrafterCfg:
    """Defaults <- TOML file (if given; or its table as a dict) <- ``key.sub=value`` overrides,
    validated; ``SettingsError`` (one line) otherwise."""
    return TrainDrafterCfg.load(path, overrides)


__all__ = ["SettingsError", "TrainDrafterCfg", "load_train_drafter"]
