"""Settings of ``specrl bench gpu``: ``GpuBenchCfg`` and its TOML, read like a run's config.

``GpuBenchCfg()`` is the default: the whole GPU check (``run.mode='check'``, every section of
``check.sections``) on the device at hand. ``load_gpubench(path, overrides, values, context)``
layers a TOML file, the values the command's options gave (``values``: dotted key -> value) and
``section.key=value`` overrides over the defaults, validated by ``specrl.settings``: every
problem is one ``SettingsError`` line (``bad value for KEY: ...``, ``unknown bench gpu key 'KEY'
(did you mean X?); valid keys in [TABLE]: ...``). A field set where it cannot apply
(``APPLIES_ONLY``: ``check.*`` needs ``run.mode='check'``, ``calibrate.*`` needs
``run.mode='calibrate'``, ...) is refused naming both fields, except one an option gave
(``context={"by_option": keys}``), which the command refuses in its options' words.
``COVERAGE`` classifies every field (``settings.Coverage``): what needs more than the model (the
device, a writable ``run.out``) is checked by ``specrl.gpubench.common.prepare``. Unset fields
(``None``) take their default from the mode and ``run.smoke`` (``specrl.gpubench``).
``to_toml()`` reads back equal (a run records it in its JSON: ``meta.settings``). Types and
bounds only. A leaf: imports ``settings`` and ``errors`` only (no torch: ``--help`` stays fast).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator

from specrl import settings
from specrl.settings import AppliesOnly, Section, SettingsError, under

# The check's sections, in the order they run: the exactness tests right after the floors, so
# that a slow section cannot crowd them out of the budget (docs/gpu.md).
SECTIONS = ("floors", "exactness", "engine", "learner", "grpo")
SectionName = Literal["floors", "exactness", "engine", "learner", "grpo"]
# specrl.engine.engine.STEP_GRAPHS (this module stays torch-free; a test checks they agree)
StepGraphs = Literal["auto", "capture", "static", "off"]
MAX_SPEC_TOKENS = 16  # specrl.spec.config.MAX_SPEC_TOKENS (likewise checked by a test)
MAX_BUDGET_S = 86400.0
WHAT = "bench gpu"  # ``unknown bench gpu key``, ``cannot read bench gpu config``
MAX_K = 64  # calibrate.ks: verify shapes of up to 65 tokens per row


class GbRunCfg(Section):
    """What runs, where, and where its result goes."""

    mode: Literal["check", "calibrate"] = Field(
        "check",
        description="'check': the GPU check, one JSON of the sections in check.sections; "
        "'calibrate': the engine's forward timed over a grid of shapes, a calibration trace "
        "for `specrl simulate calibrate`.",
    )
    smoke: bool = Field(
        False,
        description="Tiny sizes: the same code path in well under a minute, on the CPU too "
        "(without it a CUDA GPU is needed).",
    )
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="'auto' (CUDA when present, else the CPU), 'cpu', 'cuda' or 'cuda:N'.",
    )
    out: str | None = Field(
        None,
        min_length=1,
        description="Result JSON; unset: benchmarks/results/gpu_check.json (mode 'check') or "
        "benchmarks/results/gpu_calibrate_trace.json ('calibrate') of the checkout, and with "
        "run.smoke a temporary file (a smoke run never writes those committed results).",
    )
    budget_s: float | None = Field(
        None,
        gt=0.0,
        le=MAX_BUDGET_S,
        description="Time budget in seconds, a ceiling: repeats and points stop early; unset: "
        "390 for the check (300 with run.smoke), 270 for calibrate.",
    )


class GbCheckCfg(Section):
    """The GPU check (run.mode='check')."""

    sections: list[SectionName] = Field(
        list(SECTIONS),
        min_length=1,
        description="The sections to run (they run in the order floors, exactness, engine, "
        "learner, grpo whatever the order here; a section not run is null in the JSON).",
    )
    oracle_accept: float = Field(
        0.8,
        gt=0.0,
        le=1.0,
        description="The grpo section's oracle drafter: per-token acceptance, in (0, 1].",
    )
    oracle_k: int = Field(
        6, ge=1, le=MAX_SPEC_TOKENS, description="The grpo section's oracle drafter: largest k."
    )
    step_graphs: StepGraphs | None = Field(
        None,
        description="The engine section's rollout.step_graphs ('auto', 'capture', 'static', "
        "'off'); its decode points also run with 'off'; unset: 'capture' ('static' with "
        "run.smoke).",
    )

    @field_validator("sections")
    @classmethod
    def _once_each(cls, v: list[str]) -> list[str]:
        if twice := sorted({s for s in v if v.count(s) > 1}):
            raise ValueError(f"a section is listed twice: {', '.join(twice)}")
        return v


class GbCalibrateCfg(Section):
    """The calibration grid (run.mode='calibrate'): forwards of a random Llama-3.1-8B."""

    ks: list[Annotated[int, Field(ge=1, le=MAX_K)]] = Field(
        [3],
        min_length=1,
        max_length=16,
        description=f"Draft lengths k of the verify shapes (T = k + 1 tokens per row), each in "
        f"[1, {MAX_K}] (run.smoke: the small grid's verify shapes too).",
    )
    max_kv_tokens: int = Field(
        300_000,
        ge=1,
        le=1 << 30,
        description="Keep the grid points whose KV cache, batch x (context + T), fits this "
        "many tokens (300k: 39 GB of bf16 KV beside 16 GB of weights; the smoke grid has its "
        "own).",
    )
    warmup: int = Field(2, ge=0, le=1000, description="Untimed forwards before each point.")
    repeats: int = Field(5, ge=1, le=1000, description="Timed forwards per point (the median).")


def _is(value: Any) -> Callable[[Any], bool]:
    return lambda v: v == value


def _holds(section: str) -> Callable[[Any], bool]:
    return lambda sections: section in sections


# Fields that apply only while another holds: set where they cannot apply, they are refused.
APPLIES_ONLY: tuple[AppliesOnly, ...] = (
    *settings.each(under("check", "sections", "oracle_accept", "oracle_k", "step_graphs"),
                   "run.mode", _is("check"), "='check'"),
    *settings.each(under("calibrate", "ks", "max_kv_tokens", "warmup", "repeats"),
                   "run.mode", _is("calibrate"), "='calibrate'"),
    AppliesOnly("calibrate.max_kv_tokens", "run.smoke", _is(False), "=false"),
    *settings.each(("check.oracle_accept", "check.oracle_k"), "check.sections", _holds("grpo"),
                   " to hold 'grpo'"),
    AppliesOnly("check.step_graphs", "check.sections", _holds("engine"), " to hold 'engine'"),
)  # fmt: skip

# Every field of ``GpuBenchCfg`` in a class (tests/test_bench_gpu_cli.py).
COVERAGE = settings.Coverage(
    rules=APPLIES_ONLY,
    always=(*under("run", "mode", "smoke", "budget_s"),),
    checked=(
        ("run.device", "gpubench.common.prepare: present here; CUDA unless run.smoke"),
        ("run.out", "gpubench.common.prepare: writable; not a committed result with run.smoke"),
    ),
)


class GpuBenchCfg(settings.RuledSettings):
    """Settings of `specrl bench gpu` (load with --config FILE; --set section.key=value)."""

    WHAT: ClassVar[str] = WHAT
    RULES: ClassVar[tuple[AppliesOnly, ...]] = APPLIES_ONLY

    run: GbRunCfg = Field(default_factory=GbRunCfg, description="What runs and where.")
    check: GbCheckCfg = Field(default_factory=GbCheckCfg, description="The GPU check.")
    calibrate: GbCalibrateCfg = Field(
        default_factory=GbCalibrateCfg, description="The calibration grid."
    )


def load_gpubench(
    path: str | Path | dict[str, Any] | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    values: dict[str, Any] | None = None,
    context: dict[str, Any] | None = None,
) -> GpuBenchCfg:
    """Defaults <- TOML file (or its table as a dict) <- ``values`` ({dotted key: value}: the
    command's options) <- ``key.sub=value`` overrides, validated; ``SettingsError`` (one line)
    otherwise, an unknown key with the did-you-mean and the valid keys of its table."""
    return GpuBenchCfg.load(path, overrides, values, context)


__all__ = ["SECTIONS", "WHAT", "GpuBenchCfg", "SettingsError", "load_gpubench"]
