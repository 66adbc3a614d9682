"""Typed configuration of a training run: pydantic models, TOML files and ``--set`` overrides.

Contract:
- ``Config()`` is the complete embedded default run (every field has a default); sections are
  ``model``, ``env``, ``rollout``, ``learner``, ``pipeline``, ``run`` and ``cluster``. Every
  field carries a description and its bounds; unknown keys are rejected.
- ``load_config(path | None, overrides)`` reads a TOML file (optional), applies overrides of the
  form ``section.key=value`` (``value`` is parsed as a TOML value when it parses, else taken as a
  string, so ``env.task=leg_counting`` and ``learner.betas=[0.9, 0.95]`` both work), and
  validates. Any problem raises ``ConfigError`` (a ``ValueError``) with one line naming the bad
  key and value.
- Types are strict: an integer field takes only an integer, a boolean field only ``true`` or
  ``false``, a number field an integer or a float but never a boolean or a string
  (``run.steps=true``, ``run.steps=2.0`` and ``learner.lr="1e-5"`` are refused, naming the key
  and the expected type); numbers are finite (no ``inf``/``nan``).
- ``load_config(..., preset=NAME)`` starts from a preset shipped in ``specrl/presets`` (the
  file and the overrides apply over it); an unknown name raises ``ConfigError`` listing them.
- A field that applies only with another (``APPLIES_ONLY``: ``pipeline.max_staleness`` and
  ``pipeline.update`` only in async mode, ``pipeline.in_flight_tokens`` only with in-flight
  updates, ``cluster.*`` only with Ray rollout workers, ``rollout.num_spec_tokens`` /
  ``spec_siblings`` / ``drafter_path`` only with speculation) is refused when it is set (by a
  file or an override, whatever its value; pydantic's ``model_fields_set``) where it cannot
  apply: one line naming both fields.
- ``Config.to_toml()`` writes a TOML document that ``load_config`` reads back to an equal config
  (fields that cannot apply are comments). ``load_run_config`` reads a run directory's
  config.toml, dropping such fields that an older specrl wrote, then applies overrides.
Only types and bounds are checked here: this module is a leaf (it imports nothing from specrl).
Names (task, template, drafter, loss, advantage estimator) are checked against their registries
by ``specrl.pipelines.validate.check_names``, before any work starts.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import tomlkit
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

PRESETS_DIR = Path(__file__).parent / "presets"  # shipped run configs (``--preset NAME``)


class ConfigError(ValueError):
    """An invalid configuration; the message names the key and the offending value."""


# The largest run.seed: keeps every request seed derived from it (``pipelines.step``:
# ((seed * 1_000_003 + step) * 8191 + index) * 4 + stream) below 2**63, the engine's seed range.
MAX_RUN_SEED = 2**28 - 1
MAX_TOP_K = 10_000_000  # rollout.top_k: more than any vocabulary (the same as 0, off)
MAX_TOKENS_PER_FORWARD = 1_000_000  # rollout.max_tokens_per_forward


class _Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        allow_inf_nan=False,
        validate_assignment=True,
        validate_default=True,
    )


class ModelCfg(_Section):
    """The policy model."""

    name: str = Field(
        "smollm2-135m-instruct",
        description="Bundled model name, a Hugging Face-style directory or a .gguf file.",
    )
    dtype: Literal["fp32", "bf16", "auto"] = Field(
        "auto",
        description="Rollout engine precision; 'auto': bf16 where the device multiplies bf16 "
        "natively (a CPU with AVX512-BF16/AMX, a CUDA GPU from Ampere on), else fp32 "
        "(emulated bf16 is ~8x slower on a CPU).",
    )
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="Where the policy, the rollout engine, its drafter and the learner run: "
        "'cpu', 'cuda' (the current GPU), 'cuda:N', or 'auto' (CUDA when present, else the CPU). "
        "On a GPU the engine and the learner share it (colocated, weights copied on the device).",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="On a CUDA device: the share of its memory that everything in use may take "
        "when the rollout engine sizes its KV cache (the learner's weights, gradients and "
        "optimizer state count; the rest is left to the learner's activations). Unused on a CPU.",
    )


class EnvCfg(_Section):
    """The reasoning-gym task, its splits and prompt format."""

    task: str = Field("basic_arithmetic", description="reasoning-gym dataset name.")
    task_config: dict[str, Any] = Field(
        default_factory=dict,
        description="reasoning-gym dataset config kwargs, merged over the task's preset "
        "(basic_arithmetic: 1-digit add/sub, 2 terms).",
    )
    num_train: int = Field(2000, ge=1, le=1_000_000, description="Prompts in the train split.")
    num_eval: int = Field(
        48,
        ge=0,
        le=100_000,
        description="Held-out prompts: distinct questions, disjoint from train.",
    )
    template: str = Field("answer_only", description="Prompt template / answer extractor name.")
    format_bonus: float = Field(
        0.0, ge=0.0, le=1.0, description="Reward added when an answer could be extracted at all."
    )
    seed: int = Field(
        0, ge=0, le=2**63 - 1, description="Seed of the train split (eval uses a derived seed)."
    )


class RolloutCfg(_Section):
    """Generation of the G completions per prompt."""

    group_size: int = Field(8, ge=1, le=1024, description="Completions per prompt (GRPO G).")
    prompts_per_step: int = Field(8, ge=1, le=4096, description="Prompts drawn per RL step.")
    max_new_tokens: int = Field(48, ge=1, le=32768, description="Most tokens per completion.")
    temperature: float = Field(
        1.0, ge=0.0, le=10.0, description="Sampling temperature; 0 = greedy."
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass (1 = off).")
    top_k: int = Field(
        0, ge=0, le=MAX_TOP_K, description="Keep the k most likely tokens (0 = off)."
    )
    spec: str = Field(
        "suffix",
        description="Speculation method: 'none' (plain decoding) or a registered drafter "
        "(ngram, suffix, draft, self, eagle3, mtp as available). Unset with "
        "rollout.backend='vllm' it is 'ngram' (vLLM has no suffix drafter on CPU).",
    )
    num_spec_tokens: int = Field(3, ge=1, le=16, description="Draft tokens per verify step (k).")
    max_tokens_per_forward: int | Literal["auto"] | None = Field(
        "auto",
        description="How many of the k draft tokens a step drafts. 'auto': the cost-model "
        "controller picks 0..k per step for the most expected tokens/s, from the engine's "
        "measured step times (timed at engine start, refitted as it runs), the drafter's cost "
        "and running acceptance per draft position (speculation turns itself off at large "
        "batch and on in the tail; with spec_exact='distribution' the choices follow timings, "
        "so a seed reproduces the distribution, not the tokens; on vLLM 'auto' is the fixed "
        "cap 4 for bf16, else 16). An integer: draft min(k, this // live_rows - 1), plain "
        "decoding when < 1. None = always k.",
    )
    spec_siblings: int = Field(
        0,
        ge=0,
        le=16,  # specrl.sampling.MAX_SIBLINGS (this module stays torch-free; a test checks)
        description="Extra candidates for the first draft token of a stochastic drafter "
        "(eagle3, mtp, draft), verified in the same forward by recursive rejection sampling "
        "(lossless); used only while live_rows * (k + 1 + this) <= an integer "
        "max_tokens_per_forward (with 'auto' or None at every speculative step).",
    )
    spec_exact: Literal["auto", "distribution", "sample"] = Field(
        "auto",
        description="Verification rule: 'distribution' (rejection sampling: outputs follow the "
        "policy's distribution) or 'sample' (outputs are plain sampling's, token for token with "
        "the same seed, whatever k each step drafts; a stochastic drafter draws with plain "
        "sampling's random numbers, which costs it acceptance). Native backend only; no "
        "spec_siblings with 'sample'. 'auto': 'sample' for a deterministic drafter (ngram, "
        "suffix: it costs them nothing, and keeps a seed's rollouts identical under the "
        "timing-driven controller) on the native backend without siblings, else 'distribution'.",
    )
    drafter_path: str | None = Field(
        None,
        description="Drafter weights (must exist): a model directory for 'draft', a head "
        "directory for 'eagle3'/'mtp' (default: the one `specrl train-drafter` cached).",
    )
    max_batch: int = Field(64, ge=1, le=4096, description="Most sequences decoded at once.")
    backend: Literal["native", "vllm"] = Field(
        "native",
        description="Rollout engine: 'native' (specrl's engine: every drafter, in-flight "
        "updates) or 'vllm' (vLLM's engine in the trainer's process; the vllm extra; "
        "speculation 'none', 'ngram', 'draft' or 'eagle3' with a head exported by `specrl "
        "export-drafter`).",
    )
    placement: Literal["auto", "inline", "process"] = Field(
        "auto",
        description="Where the native engine runs: 'inline' (in the trainer's process) or "
        "'process' (its own worker process with its own torch threads; weights are pushed "
        "through shared memory, so rollouts and the learner can run on different cores); "
        "'auto': process for pipeline.mode='async', inline for sync (and always inline for "
        "rollout.backend='vllm').",
    )
    threads: int = Field(
        0,
        ge=0,
        le=1024,
        description="Torch threads of a 'process' engine worker (0 = half the cores, >= 1).",
    )
    alarm_action: Literal["warn", "disable_spec"] = Field(
        "warn",
        description="What the acceptance alarm does when acceptance collapses to ~1.0 or falls "
        "far below its running level right after a weight update (a stale or dropped drafter): "
        "'warn' (a warning in the metrics row and on the console) or 'disable_spec' (warn, then "
        "decode without speculation for the rest of the run).",
    )

    @model_validator(mode="after")
    def _vllm_default_spec(self) -> RolloutCfg:
        if self.backend == "vllm" and "spec" not in self.model_fields_set:
            self.__dict__["spec"] = "ngram"  # no re-validation loop (validate_assignment)
        return self

    @field_validator("max_tokens_per_forward", mode="before")
    @classmethod
    def _tokens_cap(cls, v: Any) -> Any:
        number = isinstance(v, int) and not isinstance(v, bool)
        ok = v is None or v == "auto" or (number and 1 <= v <= MAX_TOKENS_PER_FORWARD)
        if not ok:
            raise ValueError(
                f"must be 'auto', an integer in [1, {MAX_TOKENS_PER_FORWARD}] or unset"
            )
        return v

    @field_validator("drafter_path")
    @classmethod
    def _drafter_exists(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).expanduser().exists():
            raise ValueError(f"drafter file not found: {v}")
        return v


class LearnerCfg(_Section):
    """Policy loss, advantages and optimizer."""

    loss: str = Field("grpo", description="Registered policy loss (grpo, dr_grpo, dapo).")
    advantage: str = Field(
        "grpo", description="Registered advantage estimator (grpo, dr_grpo, rloo)."
    )
    normalize_std: bool = Field(True, description="grpo advantages: divide by the group std.")
    lr: float = Field(2e-5, gt=0.0, le=1.0, description="AdamW learning rate.")
    betas: tuple[StrictFloat, StrictFloat] = Field(
        (0.9, 0.99), strict=False, description="AdamW betas, each in [0, 1)."
    )  # strict=False: TOML gives a list; each element stays a strict number
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW decoupled weight decay.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient-norm clipping threshold.")
    micro_batch_tokens: int = Field(
        2048,
        ge=16,
        le=10_000_000,
        description="Token budget per micro-batch (gradient accumulation).",
    )
    kl_coef: float = Field(0.0, ge=0.0, description="k3 KL-to-reference coefficient (0 = off).")
    share_prompts: bool = Field(
        True,
        description="Pack a GRPO group's completions after one copy of their prompt (the "
        "prompt runs once per micro-batch, not once per sample; same logprobs and gradients).",
    )
    clip_eps_low: float = Field(0.2, gt=0.0, lt=1.0, description="Lower ratio clip epsilon.")
    clip_eps_high: float | None = Field(
        None, gt=0.0, description="Upper clip epsilon; None = the loss's default."
    )
    dtype: Literal["fp32", "bf16", "auto"] = Field(
        "auto",
        description="Trainer precision: bf16 autocast with fp32 master weights, or fp32; "
        "'auto': bf16 where the CPU multiplies bf16 natively, else fp32.",
    )
    logprob_chunk: int = Field(
        256, ge=1, le=1_000_000, description="Positions per LM-head/log-softmax chunk."
    )
    correction: str = Field(
        "ppo",
        description="Off-policy correction (registered): 'ppo' clips the ratio to the "
        "behaviour logprobs the engine returned; 'tis' (decoupled PPO) clips against the "
        "learner's own pre-update logprobs and weights each token by the truncated importance "
        "ratio min(pi_learner / pi_behaviour, is_cap).",
    )
    is_cap: float = Field(
        2.0, gt=0.0, le=1000.0, description="'tis': cap of the per-token importance weight."
    )
    bf16_mode: Literal["autocast", "params"] = Field(
        "autocast",
        description="How dtype='bf16' trains (refused as 'params' when the precision is fp32): "
        "'autocast' keeps float32 parameters and runs the trunk under bf16 autocast; 'params' "
        "holds the model's parameters in bf16 for forward and backward plus a float32 master "
        "copy of each that AdamW updates (the bf16 weights are refreshed from it after every "
        "step and are what the rollout engine receives; checkpoints keep the masters).",
    )
    head_precision: Literal["auto", "fp32"] = Field(
        "auto",
        description="LM head product of the learner's logprobs (always float32 logits and "
        "log-softmax): 'auto' takes bf16 inputs with float32 accumulation on a CUDA device in "
        "bf16 (a float32 product over a large vocabulary costs more than the bf16 trunk), "
        "float32 elsewhere; 'fp32' always multiplies in float32.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder block in backward instead of keeping its "
        "activations: less activation memory (longer rows, bigger micro-batches) for about "
        "one more forward pass of compute per step.",
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each beta must be in [0, 1), got {list(v)}")
        return v


class PipelineCfg(_Section):
    """How rollouts and learning are scheduled."""

    mode: Literal["sync", "async"] = Field(
        "sync",
        description="'sync': generate, then learn, one step at a time; 'async': a producer "
        "keeps generating groups with the newest weights it has while the learner trains.",
    )
    max_staleness: int = Field(
        1,
        ge=0,
        le=64,
        description="async: a group is admitted only if learner_version - behaviour_version "
        "<= this (0 = on-policy: exactly the sync pipeline).",
    )
    update: Literal["between_steps", "in_flight"] = Field(
        "between_steps",
        description="async: new weights reach the engine between its generate calls, or "
        "'in_flight' between decode steps (unfinished sequences continue under them).",
    )
    in_flight_tokens: Literal["reverify", "keep", "discard"] = Field(
        "reverify",
        description="in_flight: what happens to an unfinished sequence's tokens from older "
        "weights: 'reverify' (a draft the new weights verify with the exact rejection rule), "
        "'keep' (stale, off-policy), 'discard' (regenerate).",
    )


class DrafterCfg(_Section):
    """Training a learned drafter (rollout.spec = eagle3, mtp or draft) during RL."""

    mode: Literal["auto", "frozen", "online", "refresh"] = Field(
        "auto",
        description="'frozen': the drafter is never trained during RL; 'online': trained on every "
        "step's rollouts (the learner's training forward provides the target's features), "
        "within drafter.time_share of the step time; 'refresh': trained only when measured "
        "drift asks for it (the drafter's KL to the policy on the step's fresh tokens above its "
        "best level, draft acceptance below its running level, or drafter.max_lag policy "
        "versions since the last training), with the same time budget. 'auto': 'refresh' for a "
        "learned drafter (eagle3, mtp, draft), nothing for the others. Without trained weights "
        "(none cached, no rollout.drafter_path) 'online' and 'refresh' start from a random head "
        "(a draft model: the policy's first layers) and train it from the first step; 'frozen' "
        "then refuses to run.",
    )
    time_share: float = Field(
        0.1,
        gt=0.0,
        le=1.0,
        description="Most drafter training time as a share of the step time, on average "
        "(unused time carries over for refresh bursts, up to 4 steps' worth).",
    )
    lr: float = Field(5e-4, gt=0.0, le=1.0, description="AdamW learning rate of the drafter.")
    batch_tokens: int = Field(
        1024, ge=16, le=1_000_000, description="Tokens per drafter training mini-batch."
    )
    buffer_steps: int = Field(
        4, ge=1, le=1024, description="Rollouts of the last N RL steps are the training data."
    )
    max_updates: int = Field(
        16, ge=1, le=10_000, description="Most head optimizer steps per RL step."
    )
    drift_tolerance: float = Field(
        0.1,
        gt=0.0,
        le=10.0,
        description="refresh: train when the head's KL on fresh tokens exceeds (1 + this) x "
        "its best level, or draft acceptance falls below (1 - this) x its running level.",
    )
    max_lag: int = Field(
        8, ge=1, le=1_000_000, description="refresh: train at least every N policy versions."
    )
    vocab: int = Field(
        4096,
        ge=0,
        le=1_000_000,
        description="Draft vocabulary of a head started from scratch: the N most frequent "
        "tokens of the first step's rollouts (0 = the full vocabulary).",
    )


class RunCfg(_Section):
    """Length, cadence and place of the run."""

    steps: int = Field(16, ge=1, le=1_000_000, description="RL steps (learner updates).")
    eval_every: int = Field(
        8, ge=0, le=1_000_000, description="Evaluate every N steps (0 = never)."
    )
    checkpoint_every: int = Field(
        8, ge=0, le=1_000_000, description="Checkpoint every N steps (0 = never)."
    )
    keep_checkpoints: int = Field(
        3,
        ge=1,
        le=1_000_000,
        description="Checkpoints kept: after each save the oldest beyond this many are removed "
        "(the one just written always stays; each takes ~12 bytes per policy parameter, "
        "1.6 GB for SmolLM2-135M).",
    )
    seed: int = Field(
        0,
        ge=0,
        le=MAX_RUN_SEED,
        description="Seed of sampling, prompt order and initialisation (< 2**28).",
    )
    run_dir: str = Field("runs/default", description="Directory for config, metrics, checkpoints.")
    tensorboard: bool = Field(
        False,
        description="Also write the step and eval metrics as TensorBoard event files into "
        "<run_dir>/tensorboard (offline; metrics.jsonl stays the record).",
    )
    wandb: bool = Field(
        False,
        description="Also log the step and eval metrics to Weights & Biases in offline mode, "
        "into <run_dir>/wandb (the wandb extra; upload later with `wandb sync`).",
    )


class ClusterCfg(_Section):
    """Where the run's parts live: one process, or Ray actors."""

    rollout_workers: int = Field(
        0,
        ge=0,
        le=1024,
        description="Rollout backends run as Ray actors (the ray extra), with the learner as "
        "another actor; weights reach them through Ray's object store. 0 = no Ray: the "
        "backend runs in the trainer's process or its worker process (rollout.placement).",
    )
    address: str | None = Field(
        None,
        description="Ray cluster to join (as ray.init's address, e.g. '10.0.0.5:6379' or "
        "'auto'); unset: a local Ray bound to 127.0.0.1 is started and shut down with the run.",
    )
    threads: int = Field(
        0,
        ge=0,
        le=1024,
        description="Torch threads of each Ray actor (the learner and every rollout worker); "
        "0 = the cores of its node // (rollout_workers + 1), at least 1.",
    )
    worker_cpus: float = Field(
        0.0,
        ge=0.0,
        le=1024.0,
        description="CPUs Ray reserves for each rollout worker when placing it (0 = none, so "
        "any number of workers fit one node; on a cluster, set it to spread them out).",
    )
    worker_gpus: float = Field(
        0.0,
        ge=0.0,
        le=64.0,
        description="GPUs Ray reserves for each rollout worker (e.g. 1 for a vLLM worker on a "
        "GPU node; 0 on a CPU).",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        le=1000,
        description="How many times each rollout worker that died (killed, crashed) is replaced "
        "over the run; its unfinished requests run again. One more death ends the run with "
        "an error.",
    )


def _is(value: Any) -> Callable[[Any], bool]:
    return lambda v: v == value


# Fields that apply only while another field holds: (field, other field, test of the other's
# value, what that test asks). Setting one where it cannot apply is refused (``Config``), and
# ``Config.to_toml`` writes it only as a comment there.
APPLIES_ONLY: tuple[tuple[str, str, Callable[[Any], bool], str], ...] = (
    ("pipeline.max_staleness", "pipeline.mode", _is("async"), "='async'"),
    ("pipeline.update", "pipeline.mode", _is("async"), "='async'"),
    ("pipeline.in_flight_tokens", "pipeline.update", _is("in_flight"), "='in_flight'"),
    *(
        (f"cluster.{key}", "cluster.rollout_workers", lambda n: n > 0, " > 0")
        for key in ("address", "threads", "worker_cpus", "worker_gpus", "max_restarts")
    ),
    *(
        (f"rollout.{key}", "rollout.spec", lambda m: m != "none", " other than 'none'")
        for key in ("num_spec_tokens", "spec_siblings", "drafter_path")
    ),
    ("model.gpu_memory_utilization", "model.device", lambda d: d != "cpu", " other than 'cpu'"),
)


def _value(cfg: BaseModel, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


class Config(_Section):
    """A whole training run."""

    model: ModelCfg = Field(default_factory=ModelCfg, description="The policy model.")
    env: EnvCfg = Field(default_factory=EnvCfg, description="Task and prompts.")
    rollout: RolloutCfg = Field(default_factory=RolloutCfg, description="Generation.")
    learner: LearnerCfg = Field(default_factory=LearnerCfg, description="Learning.")
    pipeline: PipelineCfg = Field(default_factory=PipelineCfg, description="Scheduling.")
    drafter: DrafterCfg = Field(
        default_factory=DrafterCfg, description="Drafter training during RL."
    )
    run: RunCfg = Field(default_factory=RunCfg, description="Run management.")
    cluster: ClusterCfg = Field(default_factory=ClusterCfg, description="Ray placement.")

    @model_validator(mode="after")
    def _only_what_applies(self, info: ValidationInfo) -> Config:
        """A field set (in a file or an override, whatever its value) where it cannot apply
        is refused, naming both fields (see ``APPLIES_ONLY``)."""
        if info.context and info.context.get("check_applies") is False:
            return self
        problems = [
            f"{key}={_value(self, key)!r} needs {other}{needs} (it is set, and {other} is "
            f"{_value(self, other)!r})"
            for key, other, _, needs in self.inapplicable()
            if key.split(".")[1] in getattr(self, key.split(".")[0]).model_fields_set
        ]
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def inapplicable(self) -> list[tuple[str, str, Callable[[Any], bool], str]]:
        """The ``APPLIES_ONLY`` rules whose field cannot apply in this config."""
        return [rule for rule in APPLIES_ONLY if not rule[2](_value(self, rule[1]))]

    def to_toml(self) -> str:
        """A TOML document (each field's description as a comment above it) that
        ``load_config`` reads back to an equal config; a field that cannot apply here
        (``APPLIES_ONLY``) is only a comment."""
        doc = tomlkit.document()
        doc.add(tomlkit.comment(type(self).__doc__ or ""))
        skipped = {key: f"{other}{needs}" for key, other, _, needs in self.inapplicable()}
        for name in type(self).model_fields:
            doc.add(tomlkit.nl())
            doc.add(name, _section_toml(getattr(self, name), name, skipped))
        return tomlkit.dumps(doc)


# --------------------------------------------------------------------------- loading


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    preset: str | None = None,
) -> Config:
    """Defaults <- preset (if named) <- TOML file (if given) <- ``key.sub=value`` overrides,
    validated."""
    data = _read_toml(preset_path(preset)) if preset is not None else {}
    if path is not None:
        _merge(data, _read_toml(Path(path)))
    for item in overrides:
        key, value = parse_override(item)
        _set_path(data, key, value)
    return validate_config(data)


def preset_names() -> list[str]:
    """The presets shipped with specrl (``specrl/presets/<name>.toml``)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


def preset_path(name: str) -> Path:
    """The TOML file of preset ``name``; ``ConfigError`` naming the valid ones if unknown."""
    path = PRESETS_DIR / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r} (presets: {', '.join(preset_names())})")
    return path


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"invalid TOML in {path}: {e}") from None


def _merge(base: dict[str, Any], top: dict[str, Any]) -> None:
    """Merge ``top`` into ``base`` in place, table by table (``top``'s values win)."""
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def load_run_config(path: Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """A run directory's config.toml (``Config.to_toml``) <- overrides, validated. The file
    was written whole: fields of it that cannot apply (``APPLIES_ONLY``; an older specrl wrote
    them) are dropped, having had no effect; an override is checked like any other."""
    data = _read_toml(path)
    for key, *_ in validate_config(data, check_applies=False).inapplicable():
        section, name = key.split(".")
        if isinstance(data.get(section), dict):
            data[section].pop(name, None)
    for item in overrides:
        key, value = parse_override(item)
        _set_path(data, key, value)
    return validate_config(data)


def validate_config(data: dict[str, Any], check_applies: bool = True) -> Config:
    """``Config`` from TOML data (``ConfigError`` in one line); ``check_applies=False`` skips
    the refusal of fields set where they cannot apply."""
    try:
        return Config.model_validate(data, context={"check_applies": check_applies})
    except ValidationError as e:
        raise ConfigError("; ".join(_describe(err) for err in e.errors())) from None


def _describe(err: dict[str, Any]) -> str:
    key = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if not key:  # a rule between fields: the message names them
        return msg
    if err["type"] == "extra_forbidden":
        return f"unknown config key {key!r}"
    msg = _EXPECTED.get(err["type"], msg)
    return f"bad value for {key}: {msg} (got {_shown(err.get('input'))})"


def _shown(value: Any) -> str:
    """A bad value as the user wrote it (JSON, but ``inf``/``nan`` as in TOML)."""
    if isinstance(value, float) and not math.isfinite(value):
        return tomlkit.item(value).as_string()
    return json.dumps(value, default=str)


# Pydantic's type errors, said as the expected TOML type.
_EXPECTED = {
    "int_type": "expected an integer",
    "float_type": "expected a number",
    "finite_number": "expected a finite number",
    "bool_type": "expected true or false",
    "string_type": "expected a string",
    "tuple_type": "expected a list",
    "dict_type": "expected a table",
    "model_type": "expected a table",
}


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"learner.lr=1e-5"`` -> (["learner", "lr"], 1e-5); the value is parsed as TOML if it can."""
    key, sep, raw = item.partition("=")
    parts = [p.strip() for p in key.strip().split(".")]
    if not sep or not all(parts):
        raise ConfigError(f"bad override {item!r}: expected section.key=value")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return parts, value


def _set_path(data: dict[str, Any], key: list[str], value: Any) -> None:
    node = data
    for i, part in enumerate(key[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(
                f"cannot set {'.'.join(key)}: {'.'.join(key[: i + 1])} is not a table"
            )
        node = child
    node[key[-1]] = value


# --------------------------------------------------------------------------- writing TOML


def _section_toml(
    section: BaseModel, name: str = "", skipped: dict[str, str] | None = None
) -> tomlkit.items.Table:
    """One section as a TOML table: each field's description as a comment above it, unset
    fields and those in ``skipped`` (``"section.key"``: what they apply with) as comments,
    dict-valued fields as sub-tables after the scalars."""
    table = tomlkit.table()
    table.comment(type(section).__doc__ or "")
    dumped = section.model_dump(mode="json")
    fields_ = type(section).model_fields
    nested = [k for k in fields_ if isinstance(dumped[k], dict)]
    for key in (k for k in fields_ if k not in nested):
        if (needs := (skipped or {}).get(f"{name}.{key}")) is not None:
            table.add(tomlkit.comment(f"{key}: {fields_[key].description} (applies only "
                                      f"with {needs})"))  # fmt: skip
        elif dumped[key] is None:
            table.add(tomlkit.comment(f"{key}: {fields_[key].description} (unset)"))
        else:
            table.add(tomlkit.comment(fields_[key].description or key))
            table.add(key, dumped[key])
    for key in nested:
        sub = tomlkit.table()
        sub.comment(fields_[key].description or key)
        sub.update(dumped[key])
        table.add(key, sub)
    return table
