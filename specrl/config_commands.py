"""Settings of ``specrl generate``, ``export``, ``export-drafter``, ``report``, ``simulate
validate`` and ``simulate calibrate``: read as a run's.

Each command's settings are a ``CommandSettings`` (sections of strict fields, ``WHAT`` naming the
command): ``Cls.load(path, overrides, values)`` layers a TOML file, the command's options
(``values``) and ``section.key=value`` overrides over the defaults (``settings.load``): every
problem is one ``SettingsError`` line (``bad value for KEY: ...``, ``unknown generate key 'KEY'
(did you mean X?); valid keys in [TABLE]: ...``); a field set where it cannot apply (``RULES``)
is refused naming both fields, except one given by an option (``context={"by_option": keys}``),
which the command refuses in its options' words. ``COVERAGE`` classifies every field
(``settings.Coverage``): a field checked by the library the command calls (sampling and
speculation bounds, dtypes, devices, paths) is ``checked`` there, with the messages tests pin.
``to_toml()`` reads back equal; ``RECORD`` names the file a command that writes a directory
records its settings in. Types and bounds only. A leaf: imports ``settings`` and ``errors``
only. Details: docs/internals.md.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from specrl import settings
from specrl.settings import Coverage, Section, SettingsError

# Bounds shared with the options (specrl.cli_options re-exports them): the same as the config's
# rollout.max_batch, and more new tokens than any context holds.
MAX_BATCH = 4096  # --max-batch, --batch-sizes, --group-size
MAX_NEW_TOKENS = 1_000_000  # --max-new-tokens, --new-tokens (the context stops them sooner)
MAX_N = 65_536  # generate --n: completions per prompt (each is held in memory to the end)
MAX_TOP_K = 10_000_000  # specrl.config.MAX_TOP_K (this module imports no config; a test checks)
MAX_STEP = 1_000_000  # export --step: run.steps' bound
MODEL = "smollm2-135m-instruct"  # the bundled default model


class CommandSettings(settings.RuledSettings):
    """A command's settings (``--config FILE``, ``--set section.key=value``;
    ``settings.RuledSettings``)."""

    RECORD: ClassVar[str | None] = None  # the file a command records these settings in


# --------------------------------------------------------------------------- generate


class GenModelCfg(Section):
    """The model that generates."""

    name: str = Field(MODEL, min_length=1, description="A bundled name, a model directory or "
                      "a .gguf file.")  # fmt: skip
    dtype: str = Field(
        "auto",
        description="float32, bfloat16 or auto (bfloat16 where the CPU multiplies it natively, "
        "AVX512-BF16/AMX, and on CUDA; else float32).",
    )
    device: str = Field(
        "auto",
        description="auto (CUDA when present, else cpu), cpu, cuda or cuda:N: where the model, "
        "its KV cache, the drafter and the sampler run.",
    )


class GenPromptsCfg(Section):
    """Prompts besides the PROMPT arguments."""

    file: str | None = Field(
        None,
        description='A JSONL file: lines "text", {"prompt": "text"} or {"messages": '
        '[{"role", "content"}]} (unset: the arguments only).',
    )
    chat_template: bool = Field(True, description="Wrap prompts in the model's chat template.")


class GenSamplingCfg(Section):
    """How each completion is sampled (bounds: specrl.sampling.SamplingParams.validate)."""

    temperature: float = Field(0.7, description="0 = greedy; finite, >= 0.")
    top_p: float = Field(1.0, description="Nucleus mass in (0, 1].")
    top_k: int = Field(0, le=MAX_TOP_K, description="Keep the k most likely tokens (0 = off).")
    max_new_tokens: int = Field(
        128, le=MAX_NEW_TOKENS, description="Most tokens per completion (>= 1; the context "
        "stops them sooner)."
    )  # fmt: skip
    n: int = Field(1, le=MAX_N, description="Completions per prompt (>= 1).")
    seed: int | None = Field(None, description="Base seed in [0, 2**63 - 1] (unset: random).")


class GenSpeculationCfg(Section):
    """Speculative decoding (lossless; bounds: specrl.spec.config.SpecConfig.validate)."""

    method: str = Field(
        "none",
        description="The drafter: none, ngram, suffix, eagle3, mtp, hybrid, draft, self (test "
        "device).",
    )
    num_spec_tokens: int = Field(3, description="Draft tokens per step (k); method not 'none'.")
    siblings: int = Field(
        0,
        description="Extra first-token candidates per step for a stochastic drafter (eagle3, "
        "mtp, draft), verified losslessly in the same forward; raises acceptance at T > 0.",
    )
    exact: str = Field(
        "distribution",
        description="Verification rule: 'distribution' (rejection sampling, the policy's "
        "distribution) or 'sample' (plain sampling's tokens, one for one with the same seed); "
        "method not 'none'.",
    )
    drafter: str | None = Field(
        None,
        description="A method that loads a drafter: a draft model dir/.gguf or prefix:N (the "
        "target's first N layers); for eagle3/mtp a head dir or 'untrained' (unset: the head "
        "`specrl train-drafter` cached).",
    )


class GenEngineCfg(Section):
    """The native engine."""

    max_batch: int = Field(64, le=MAX_BATCH, description="Concurrent sequences (>= 1).")


class GenOutputCfg(Section):
    """What is printed."""

    jsonl: bool = Field(False, description="One JSON object per completion (else text blocks).")


_SPEC = " other than 'none'"


class GenerateCfg(CommandSettings):
    """Settings of `specrl generate` (load with --config FILE; --set section.key=value)."""

    WHAT = "generate"
    RULES = settings.each(
        ("speculation.num_spec_tokens", "speculation.exact"), "speculation.method",
        lambda m: m != "none", _SPEC,
    )  # fmt: skip

    model: GenModelCfg = Field(default_factory=GenModelCfg, description="The model.")
    prompts: GenPromptsCfg = Field(default_factory=GenPromptsCfg, description="Prompts.")
    sampling: GenSamplingCfg = Field(default_factory=GenSamplingCfg, description="Sampling.")
    speculation: GenSpeculationCfg = Field(
        default_factory=GenSpeculationCfg, description="Speculative decoding."
    )
    engine: GenEngineCfg = Field(default_factory=GenEngineCfg, description="The engine.")
    output: GenOutputCfg = Field(default_factory=GenOutputCfg, description="Output.")


GENERATE_COVERAGE = Coverage(
    rules=GenerateCfg.RULES,
    always=("model.name", "prompts.chat_template", "output.jsonl"),
    checked=(
        ("model.dtype", "cli_options.parse_dtype: float32, bfloat16 or auto"),
        ("model.device", "cli_util.parse_device: a device this machine has"),
        ("prompts.file", "cli_generate.read_prompts: a readable JSONL file"),
        *((f"sampling.{k}", "sampling.SamplingParams.validate") for k in
          ("temperature", "top_p", "top_k", "max_new_tokens", "n", "seed")),
        ("speculation.method", "spec.config.SpecConfig.validate: a registered method"),
        ("speculation.num_spec_tokens", "SpecConfig.validate, cli_generate: k >= 1 to draft"),
        ("speculation.siblings", "SpecConfig.validate: only a stochastic drafter's"),
        ("speculation.exact", "SpecConfig.validate: a verification rule"),
        ("speculation.drafter", "cli_generate: only a method that loads a drafter"),
        ("engine.max_batch", "cli_generate.check_generate_options: >= 1"),
    ),
)  # fmt: skip


# --------------------------------------------------------------------------- export


class ExportSectionCfg(Section):
    """What of the run is exported, and how."""

    step: int | None = Field(
        None, description="Export checkpoint step_N, in [0, 1000000] (unset: the newest "
        "checkpoint that verifies)."
    )  # fmt: skip
    merge_drafter: bool = Field(
        False,
        description="Also write the EAGLE-3 head the run trained, in the layout vLLM loads, to "
        "OUT/drafter (vLLM: speculative_config method 'eagle3', model OUT/drafter).",
    )
    shard_size: str | int = Field(
        "5GB",
        description="Largest weights file: 5GB, 500MB, 2GiB or bytes; above it the weights "
        "are sharded as Hugging Face does.",
    )


class ExportCfg(CommandSettings):
    """Settings of `specrl export RUN OUT` (load with --config FILE; --set export.key=value)."""

    WHAT = "export"
    RECORD = "specrl_export.toml"

    export: ExportSectionCfg = Field(default_factory=ExportSectionCfg, description="Export.")


EXPORT_COVERAGE = Coverage(
    rules=(),
    always=(),
    checked=(
        ("export.step", "cli_export: in [0, MAX_STEP], a checkpoint of the run"),
        ("export.merge_drafter", "pipelines.export.resolve_export: the run trained a head"),
        ("export.shard_size", "pipelines.export.parse_size: a size of at least 1 byte"),
    ),
)


# --------------------------------------------------------------------------- export-drafter


class XdDrafterCfg(Section):
    """The trained drafter exported."""

    kind: str = Field(
        "eagle3",
        description="eagle3 (a head), block (a block head, as vLLM's dflash) or draft (a draft "
        "model).",
    )
    source: str | None = Field(
        None,
        description="The trained drafter's directory (unset: where `specrl train-drafter` "
        "saves it for model.name).",
    )


class XdModelCfg(Section):
    """The target the drafter was trained for."""

    name: str = Field(MODEL, min_length=1, description="Target model (eagle3, block: its LM "
                      "head rows are written; draft: its tokenizer, when the draft has "
                      "none).")  # fmt: skip


class XdExportCfg(Section):
    """Where and how the drafter is written."""

    out: str | None = Field(None, description="Output directory (required).")
    dtype: str | None = Field(
        None,
        description="kind 'eagle3' or 'block': float32, bfloat16 or float16 (unset: the head's).",
    )


class ExportDrafterCfg(CommandSettings):
    """Settings of `specrl export-drafter` (load with --config FILE; --set section.key=value)."""

    WHAT = "export-drafter"
    RECORD = "export_drafter.toml"

    drafter: XdDrafterCfg = Field(default_factory=XdDrafterCfg, description="The drafter.")
    model: XdModelCfg = Field(default_factory=XdModelCfg, description="The target.")
    export: XdExportCfg = Field(default_factory=XdExportCfg, description="The export.")


EXPORT_DRAFTER_COVERAGE = Coverage(
    rules=(),
    always=("model.name",),
    checked=(
        ("drafter.kind", "cli_export: eagle3, block or draft (mtp: why not)"),
        ("drafter.source", "cli_export: a directory; drafters.export: a drafter of the kind"),
        ("export.out", "cli_export: given, writable, not drafter.source (eagle3, block)"),
        ("export.dtype", "cli_export: one of EXPORT_DTYPES, kind 'eagle3' or 'block' only"),
    ),
)


# --------------------------------------------------------------------------- report


class ReportSectionCfg(Section):
    """Where the report goes, and what it compares."""

    out: str | None = Field(None, description="Output directory (unset: RUN_DIR).")
    compare: list[str] = Field(
        [],
        max_length=1024,
        description="Other run dirs: reward curves of all runs on one plot (compare.png), "
        "x = completions trained on.",
    )


class ReportCfg(CommandSettings):
    """Settings of `specrl report RUN_DIR` (load with --config FILE; --set report.key=value)."""

    WHAT = "report"

    report: ReportSectionCfg = Field(default_factory=ReportSectionCfg, description="Report.")


REPORT_COVERAGE = Coverage(
    rules=(),
    always=(),
    checked=(
        ("report.out", "pipelines.runconfig.require_writable_dir"),
        ("report.compare", "pipelines.report.read_runs: each a run dir with metrics"),
    ),
)

# --------------------------------------------------------------------------- simulate validate

# specrl.sim.accuracy.SECTIONS, in the order they run (this leaf imports no simulator; a test
# checks they agree)
VALIDATE_SECTIONS = ("fits", "paper", "heldout", "physics", "nemo_rl", "tornado")
ValidateSection = Literal["fits", "paper", "heldout", "physics", "nemo_rl", "tornado"]


class ValidateSectionCfg(Section):
    """Which validation sections run, and where the record goes."""

    sections: list[ValidateSection] = Field(
        list(VALIDATE_SECTIONS),
        min_length=1,
        max_length=64,
        description="The sections to run (they run in the order fits, paper, heldout, "
        "physics, nemo_rl, tornado whatever the order here; fits, heldout and nemo_rl take "
        "seconds, paper, physics and tornado minutes).",
    )
    refit: bool = Field(
        False,
        description="The fits section: re-derive the paper's fitted workload inputs (minutes) "
        "instead of reading them from the scenario TOMLs.",
    )
    tornado: bool = Field(
        True, description="The sensitivity sweep of the paper scenarios (false: drop the "
        "tornado section)."
    )  # fmt: skip
    out: str | None = Field(
        None,
        min_length=1,
        description="Write the record (command, date, machine, versions and every section's "
        "rows) to this JSON file, atomically (unset: print the tables only).",
    )


_FITS = "the fits section (--sections fits)"


class ValidateCfg(CommandSettings):
    """Settings of `specrl simulate validate` (--config FILE; --set validation.key=value)."""

    WHAT = "simulate validate"
    RULES = (
        settings.AppliesOnly(
            "validation.refit", ("validation.sections",), lambda v: "fits" in v[0], _FITS
        ),
    )

    validation: ValidateSectionCfg = Field(
        default_factory=ValidateSectionCfg, description="The validation."
    )


VALIDATE_COVERAGE = Coverage(
    rules=ValidateCfg.RULES,
    always=("validation.sections",),
    checked=(("validation.out", "sim.cli: fsutil.result_file_problem, a writable file"),),
    kept=(
        ("validation.tornado", "sim.cli: drops the tornado section; without it there is nothing "
         "to drop (only tornado and tornado=false: nothing to run, refused)"),
    ),
)  # fmt: skip


# --------------------------------------------------------------------------- simulate calibrate

MAX_SEED = 2**63 - 1  # calibrate.seed


class CalibrateSectionCfg(Section):
    """The fit of a hardware profile to an engine trace (TRACE, the argument)."""

    base: str | None = Field(
        None,
        description="Hardware profile whose peak/bandwidth the fit scales (unset: the trace's "
        "'hardware', else cpu-2core).",
    )
    out: str = Field("calibrated.toml", description="Where to write the fitted hardware "
                     "profile TOML.")  # fmt: skip
    drafter_out: str | None = Field(
        None,
        description="Model-free drafter traces: where to write the fitted drafter TOML (unset: "
        "out with a -drafter suffix).",
    )
    name: str | None = Field(
        None, description="Name of the fitted profile (unset: BASE-calibrated)."
    )
    heldout: float = Field(
        0.25, ge=0.0, lt=1.0, description="Fraction of records held out to report the error, "
        "in [0, 1) (a random split)."
    )  # fmt: skip
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed of the random held-out split.")
    heldout_configs: list[str] = Field(
        [],
        max_length=4096,
        description="Record 'config' labels held out as whole runs (instead of heldout).",
    )
    fit_configs: list[str] = Field(
        [],
        max_length=4096,
        description="Record 'config' labels to fit on; every other config is held out as a "
        "whole run (bench gpu: ['bs1', 'bs64'] fits on batches 1 and 64).",
    )
    json_report: bool = Field(False, description="Print the fit report as JSON (else lines).")


_SPLIT = "a random held-out split (no heldout_configs, no fit_configs)"


class CalibrateCfg(CommandSettings):
    """Settings of `specrl simulate calibrate TRACE` (--config FILE; --set calibrate.key=...)."""

    WHAT = "simulate calibrate"
    RULES = settings.each(
        ("calibrate.heldout", "calibrate.seed"),
        ("calibrate.heldout_configs", "calibrate.fit_configs"),
        lambda v: not any(v),
        _SPLIT,
    )

    calibrate: CalibrateSectionCfg = Field(
        default_factory=CalibrateSectionCfg, description="The fit."
    )


CALIBRATE_COVERAGE = Coverage(
    rules=CalibrateCfg.RULES,
    always=("calibrate.name", "calibrate.json_report"),
    checked=(
        ("calibrate.base", "costmodel.specs.load_hardware: a bundled profile or a file"),
        ("calibrate.out", "sim.cli: a file name, writable"),
        ("calibrate.drafter_out", "sim.cli: writable; written for a model-free drafter only"),
        ("calibrate.heldout_configs", "sim.cli: not with fit_configs; sim.calibrate: configs "
         "of the trace"),
        ("calibrate.fit_configs", "sim.cli: not with heldout_configs; sim.holdout.complement: "
         "configs of the trace"),
    ),
)  # fmt: skip

# --------------------------------------------------------------------------- upcycle

MAX_EXPERTS = 256  # models.upcycle.MAX_EXPERTS (a test checks they agree)


class UpModelCfg(Section):
    """The dense model upcycled."""

    name: str = Field(MODEL, min_length=1, description="A bundled name, a model directory or a "
                      ".gguf file: a Llama, Mistral, Qwen2 or Qwen3 decoder.")  # fmt: skip


class UpcycleSectionCfg(Section):
    """The mixture of experts made."""

    experts: int = Field(4, ge=2, le=MAX_EXPERTS, description="Experts per layer, each a copy of "
                         "the dense MLP, in [2, 256].")  # fmt: skip
    top_k: int = Field(
        2,
        ge=1,
        le=MAX_EXPERTS,
        description="Experts per token, in [1, experts] (their weights renormalised to sum to "
        "1: the dense output at step 0).",
    )
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed of the router's random weights.")
    router_std: float = Field(
        0.02,
        ge=0.0,
        le=1e6,
        allow_inf_nan=False,
        description="Standard deviation of the router's weights (0: every token routed alike).",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="float32 or bfloat16: the weights written."
    )


class UpcycleCfg(CommandSettings):
    """Settings of `specrl upcycle OUT` (--config FILE; --set upcycle.key=value)."""

    WHAT = "upcycle"
    RECORD = "specrl_upcycle.toml"

    model: UpModelCfg = Field(default_factory=UpModelCfg, description="The dense model.")
    upcycle: UpcycleSectionCfg = Field(
        default_factory=UpcycleSectionCfg, description="The experts."
    )

    def check_values(self) -> None:
        up = self.upcycle
        if up.top_k > up.experts:
            raise ValueError(f"upcycle.top_k ({up.top_k}) must be <= upcycle.experts "
                             f"({up.experts})")  # fmt: skip


UPCYCLE_COVERAGE = Coverage(
    rules=(),
    always=(
        "upcycle.experts",
        "upcycle.top_k",
        "upcycle.seed",
        "upcycle.router_std",
        "upcycle.dtype",
    ),  # fmt: skip
    checked=(
        (
            "model.name",
            "models.checkpoints.resolve_model; models.upcycle: a dense Llama, "
            "Mistral, Qwen2 or Qwen3",
        ),
    ),  # fmt: skip
)

COMMANDS: dict[str, tuple[type[CommandSettings], Coverage]] = {
    "generate": (GenerateCfg, GENERATE_COVERAGE),
    "export": (ExportCfg, EXPORT_COVERAGE),
    "export-drafter": (ExportDrafterCfg, EXPORT_DRAFTER_COVERAGE),
    "report": (ReportCfg, REPORT_COVERAGE),
    "simulate validate": (ValidateCfg, VALIDATE_COVERAGE),
    "simulate calibrate": (CalibrateCfg, CALIBRATE_COVERAGE),
    "upcycle": (UpcycleCfg, UPCYCLE_COVERAGE),
}


__all__ = ["COMMANDS", "CommandSettings", "SettingsError"]
