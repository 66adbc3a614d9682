"""Settings of ``specrl bench generate`` and ``specrl bench grpo``, read like a run's config.

``GenerateBenchCfg()`` / ``GrpoBenchCfg()`` (each a ``BenchSettings``) are each command's defaults
(its options' defaults). ``Cls.load(path, overrides, values, context)`` (``load_generate_bench``,
``load_grpo_bench``) layers a TOML file, the values the command's options gave (``values``: dotted
key -> value) and ``section.key=value`` overrides over the defaults, validated by
``specrl.settings``: every problem is one ``SettingsError`` line (``bad value for KEY: ...``,
``unknown bench grpo key 'KEY' (did you mean X?); valid keys in [TABLE]: ...``). A field set where
it cannot apply (``GENERATE_APPLIES``, ``GRPO_APPLIES``: ``spec.exact`` needs a drafter in
``spec.drafters``, ``runs.*`` needs ``bench.mode='runs'``, ...) is refused naming both fields,
except one an option gave (``context={"by_option": keys}``), which the command refuses in its
options' words. ``GrpoBenchCfg.train`` is a free table, the training run's own config (``specrl
train``'s keys), which ``specrl.bench_grpo`` validates. What needs more than these models (drafter
names, installed engines, a group dividing the batches) is checked by ``specrl.cli_bench`` before
any work; ``*_COVERAGE`` classifies every field (``settings.Coverage``). ``to_toml()`` reads back
equal. Types and bounds only. A leaf: imports ``settings`` and ``errors`` only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import tomlkit
from pydantic import Field, field_validator

from specrl import settings
from specrl.settings import AppliesOnly, Section, SettingsError, under

MAX_BATCH = 4096  # as the run config's rollout.max_batch (specrl.cli_options.MAX_BATCH)
MAX_NEW_TOKENS = 1_000_000  # specrl.cli_options.MAX_NEW_TOKENS (the context stops them sooner)
MAX_SPEC_TOKENS = 16  # specrl.spec.config.MAX_SPEC_TOKENS (this module stays torch-free)
MAX_REPEATS = 1000
MAX_STEPS = 100_000

Batch = Annotated[int, Field(ge=1, le=MAX_BATCH)]


class BenchSettings(settings.RuledSettings):
    """A bench command's settings (``--config FILE``, ``--set section.key=value``;
    ``settings.RuledSettings``)."""


# --------------------------------------------------------------------------- bench generate


class BgModelCfg(Section):
    """The model generating."""

    name: str = Field(
        "smollm2-135m-instruct",
        min_length=1,
        description="A bundled name, a Hugging Face-style directory or a .gguf file.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "fp32", "bf16"] = Field(
        "auto",
        description="float32, bfloat16 or auto (bfloat16 where the CPU multiplies it natively, "
        "AVX512-BF16/AMX; else float32).",
    )


class BgBenchCfg(Section):
    """What is timed."""

    batch_sizes: list[Batch] = Field(
        [1, 8, 32, 64], min_length=1, max_length=64, description="Batch sizes, one row each."
    )
    new_tokens: int = Field(
        128, ge=1, le=MAX_NEW_TOKENS, description="Tokens generated per sequence (exactly)."
    )
    repeats: int = Field(
        1, ge=1, le=MAX_REPEATS, description="Timed runs per point (the best is kept)."
    )
    group_size: int = Field(
        1,
        ge=1,
        le=MAX_BATCH,
        description="Samples per prompt (GRPO group); divides every batch size >= it.",
    )
    compare: list[Literal["hf", "vllm"]] = Field(
        [], max_length=2, description="Other engines: 'hf' (transformers), 'vllm' (the extra)."
    )


class BgSpecCfg(Section):
    """Speculation compared with none."""

    drafters: list[str] = Field(
        [], max_length=32, description="Drafters, each timed against no speculation."
    )
    num_spec_tokens: int = Field(
        3, ge=0, le=MAX_SPEC_TOKENS, description="Draft tokens per step (k)."
    )
    drafter: str | None = Field(
        None,
        min_length=1,
        description="The one drafter in spec.drafters that takes one: for 'draft' a model "
        "dir/.gguf or prefix:N (the target's first N layers); for 'eagle3'/'mtp' a trained "
        "head's directory, or 'untrained' (a random head) (unset: the head `specrl "
        "train-drafter` cached).",
    )
    exact: Literal["distribution", "sample"] = Field(
        "distribution",
        description="Verification rule: 'distribution' (rejection sampling) or 'sample' (plain "
        "sampling's tokens, one for one with the same seed).",
    )
    controller: bool = Field(
        False,
        description="Each step drafts the k in 0..num_spec_tokens the engine's cost-model "
        "controller picks (as `specrl train` runs by default) instead of num_spec_tokens.",
    )


def _drafts(drafters: list[str]) -> bool:
    return any(d != "none" for d in drafters)


GENERATE_APPLIES: tuple[AppliesOnly, ...] = settings.each(
    under("spec", "num_spec_tokens", "drafter", "exact", "controller"), "spec.drafters", _drafts,
    " naming a drafter",
)  # fmt: skip

GENERATE_COVERAGE = settings.Coverage(
    rules=GENERATE_APPLIES,
    always=(
        *under("model", "name", "dtype"),
        *under("bench", "batch_sizes", "new_tokens", "repeats", "group_size", "compare"),
        "spec.drafters",
    ),
)


class GenerateBenchCfg(BenchSettings):
    """Settings of `specrl bench generate` (--config FILE; --set section.key=value)."""

    WHAT: ClassVar[str] = "bench generate"
    RULES: ClassVar[tuple[AppliesOnly, ...]] = GENERATE_APPLIES

    model: BgModelCfg = Field(default_factory=BgModelCfg, description="The model.")
    bench: BgBenchCfg = Field(default_factory=BgBenchCfg, description="What is timed.")
    spec: BgSpecCfg = Field(default_factory=BgSpecCfg, description="Speculation.")


# --------------------------------------------------------------------------- bench grpo


class GrBenchCfg(Section):
    """What is measured."""

    mode: Literal["runs", "interleaved"] = Field(
        "runs",
        description="'runs': a training run per variant (no speculation, then each of "
        "runs.drafters) from the same weights and seeds, then a rollout sweep by max batch; "
        "'interleaved': one run whose every step is rolled out plain and speculative (the "
        "configured drafter) on the same weights and seeds, order alternating.",
    )
    steps: int = Field(4, ge=1, le=MAX_STEPS, description="RL steps (of each run).")
    warmup: int = Field(
        1, ge=0, le=MAX_STEPS, description="First steps left out of the means and summary."
    )
    threads: int = Field(0, ge=0, le=1024, description="Torch threads (0 = torch's default).")


class GrWorkloadCfg(Section):
    """The training run measured: specrl train's defaults <- preset <- config <- [train]."""

    preset: str | None = Field(
        None,
        min_length=1,
        description="A preset of `specrl train` ('reasoning': long step-by-step replies, "
        "the regime speculation is for; unset: the default run).",
    )
    config: str | None = Field(
        None, min_length=1, description="A run config TOML file (as `specrl train --config`)."
    )

    @field_validator("config")
    @classmethod
    def _config_file(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).expanduser().is_file():
            raise ValueError(f"run config {v} does not exist or is not a file")
        return v


class GrRunsCfg(Section):
    """bench.mode='runs': the variants and the sweep."""

    drafters: list[str] = Field(
        ["ngram", "suffix"],
        min_length=1,
        max_length=32,
        description="Drafters, each its own run beside the one without speculation; NAME/S "
        "runs with rollout.spec_siblings=S.",
    )
    batches: list[Batch] = Field(
        [4, 16, 64],
        max_length=64,
        description="Max batches of the rollout sweep on each drafter's final weights ([] = "
        "no sweep).",
    )


class GrInterleavedCfg(Section):
    """bench.mode='interleaved': the oracle ceiling."""

    ceiling: bool = Field(
        False,
        description="Add a rollout per step by an oracle drafter (it drafts the plain "
        "rollout's tokens, at the cost of a lookup): the ceiling of speculation here.",
    )
    ceiling_k: int = Field(
        8, ge=1, le=MAX_SPEC_TOKENS, description="The oracle's largest k (the controller's)."
    )
    ceiling_accept: list[Annotated[float, Field(gt=0.0, le=1.0)]] = Field(
        [1.0],
        min_length=1,
        max_length=16,
        description="Per-token acceptances in (0, 1] of the oracle, one rollout each (a < 1: "
        "each drafted token kept with probability a).",
    )


def _is(value: Any) -> Callable[[Any], bool]:
    return lambda v: v == value


GRPO_APPLIES: tuple[AppliesOnly, ...] = (
    *settings.each(under("runs", "drafters", "batches"), "bench.mode", _is("runs"), "='runs'"),
    *settings.each(
        under("interleaved", "ceiling", "ceiling_k", "ceiling_accept"), "bench.mode",
        _is("interleaved"), "='interleaved'",
    ),
    *settings.each(
        under("interleaved", "ceiling_k", "ceiling_accept"), "interleaved.ceiling", bool, "=true"
    ),
)  # fmt: skip

GRPO_COVERAGE = settings.Coverage(
    rules=GRPO_APPLIES,
    always=(
        *under("bench", "mode", "steps", "warmup", "threads"),
        *under("workload", "preset", "config"),
        "train",
    ),
)


class GrpoBenchCfg(BenchSettings):
    """Settings of `specrl bench grpo` (--config FILE; --set section.key=value; train.KEY=...)."""

    WHAT: ClassVar[str] = "bench grpo"
    RULES: ClassVar[tuple[AppliesOnly, ...]] = GRPO_APPLIES

    bench: GrBenchCfg = Field(default_factory=GrBenchCfg, description="What is measured.")
    workload: GrWorkloadCfg = Field(default_factory=GrWorkloadCfg, description="The run.")
    runs: GrRunsCfg = Field(default_factory=GrRunsCfg, description="mode 'runs'.")
    interleaved: GrInterleavedCfg = Field(
        default_factory=GrInterleavedCfg, description="mode 'interleaved'."
    )
    train: dict[str, Any] = Field(
        default_factory=dict,
        description="The training run's config table (specrl train's keys, e.g. "
        "train.rollout.prompts_per_step=4), over workload.preset and workload.config.",
    )

    def check_values(self) -> None:
        """Some steps are measured: ``bench.warmup`` < ``bench.steps``."""
        b = self.bench
        if b.warmup >= b.steps:
            raise ValueError(f"bench.warmup={b.warmup} leaves none of bench.steps={b.steps} "
                             "measured: give more steps or less warmup")  # fmt: skip

    def to_toml(self) -> str:
        """A commented TOML document that ``load`` reads back equal (``[train]`` last, as
        given)."""
        sections = _GrpoSections.model_validate(self.model_dump(exclude={"train"}))
        doc = tomlkit.parse(settings.toml_document(sections, self.skipped()))
        if self.train:
            table = tomlkit.table()
            table.comment("the training run's config (specrl train's keys)")
            table.update(self.train)
            doc.add("train", table)
        return tomlkit.dumps(doc)


class _GrpoSections(Section):
    """Settings of `specrl bench grpo` (--config FILE; --set section.key=value; train.KEY=...)."""

    bench: GrBenchCfg
    workload: GrWorkloadCfg
    runs: GrRunsCfg
    interleaved: GrInterleavedCfg


load_generate_bench = GenerateBenchCfg.load
load_grpo_bench = GrpoBenchCfg.load


__all__ = [
    "GenerateBenchCfg",
    "GrpoBenchCfg",
    "SettingsError",
    "load_generate_bench",
    "load_grpo_bench",
]
