"""Typed configuration of a training run: the sections of ``Config``, presets and run files.

``Config()`` is the complete default run (sections model, env, reward, rollout, learner,
pipeline, drafter, run, cluster). ``load_config(path, overrides, preset)`` layers a preset, a
TOML file and ``section.key=value`` overrides, validated by ``specrl.settings``; every problem is a
one-line ``ConfigError`` (a field set where it cannot apply too: ``APPLIES_ONLY``). ``COVERAGE``
classifies every field: a rule, always applying, checked at build (``rollout_plan``) or kept
with its reason (``settings.Coverage``; a test fails on a field in no class).
``Config.to_toml()`` reads back equal; ``load_run_config`` reads a run's config.toml. Types and
bounds only (names: ``pipelines.validate.check_names``). A leaf: imports ``settings``,
``config_task`` (the env and reward sections) and ``config_training`` only. Details:
docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from specrl import settings
from specrl.config_task import EnvCfg, RewardCfg
from specrl.config_training import DrafterCfg, LearnerCfg
from specrl.settings import AppliesOnly, Section, each, errors_as, read_toml, under

PRESETS_DIR = Path(__file__).parent / "presets"  # shipped run configs (``--preset NAME``)


class ConfigError(ValueError):
    """An invalid configuration; the message names the key and the offending value."""


# The largest run.seed: keeps every request seed derived from it (``pipelines.step``:
# ((seed * 1_000_003 + step) * 8191 + index) * 4 + stream) below 2**63, the engine's seed range.
MAX_RUN_SEED = 2**28 - 1
MAX_TOP_K = 10_000_000  # rollout.top_k: more than any vocabulary (the same as 0, off)
MAX_TOKENS_PER_FORWARD = 1_000_000  # rollout.max_tokens_per_forward


class ModelCfg(Section):
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


class RolloutCfg(Section):
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
        "(ngram, suffix, draft, self, eagle3, mtp, block as available; block: a DFlash-style "
        "head drafting k tokens in one forward, best with num_spec_tokens=8). Unset with "
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
        "directory for 'eagle3'/'mtp'/'block' (default: the one `specrl train-drafter` "
        "cached).",
    )
    max_batch: int = Field(64, ge=1, le=4096, description="Most sequences decoded at once.")
    backend: str = Field(
        "native",
        min_length=1,
        description="Rollout engine, a name in specrl.backends.REGISTRY: 'native' (specrl's "
        "engine: every drafter, in-flight "
        "updates) or 'vllm' (vLLM's engine in the trainer's process; the vllm extra; "
        "speculation 'none', 'ngram', 'draft', 'eagle3' with a head exported by `specrl "
        "export-drafter`, or a trained 'block' head served frozen as vLLM's dflash).",
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
    step_graphs: Literal["auto", "capture", "static", "off"] = Field(
        "auto",
        description="How the native engine runs decode and verify steps: 'capture' (rows padded "
        "to a batch bucket over a static KV cache, each step one captured CUDA graph with "
        "sampling and verification on the device; CUDA only), 'static' (the same static steps "
        "run eagerly, any device), 'off' (shapes as they come), 'auto' (capture on CUDA, off "
        "elsewhere). Greedy completions match 'off' token for token in float32 (tested); in bf16 "
        "on a GPU a different attention kernel may round differently.",
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


class PipelineCfg(Section):
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


class RunCfg(Section):
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
    final_checkpoint: Literal["full", "weights"] = Field(
        "full",
        description="The run's last checkpoint: 'full' (resumable: policy and AdamW state) or "
        "'weights' (the policy alone, a third of the bytes of a float32 learner's: it exports, "
        "it does not continue the run; a resume goes back to the newest full one kept).",
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


class ClusterCfg(Section):
    """Where the run's parts live: one process, or Ray actors."""

    rollout_workers: int = Field(
        0,
        ge=0,
        le=1024,
        description="Rollout backends run as Ray actors (the ray extra), with the learner as "
        "another actor; weights reach them through Ray's object store. 0 = no Ray: the "
        "backend runs in the trainer's process or its worker process (rollout.placement).",
    )
    train_workers: int = Field(
        1,
        ge=1,
        le=1024,
        description="Learner processes: 1 = the learner in the trainer's process; N > 1 = N Ray "
        "actors (the ray extra) sharing one FSDP2-sharded learner (torch.distributed: gloo on "
        "CPU, NCCL with one GPU each on CUDA), each holding ~1/N of the weights, gradients and "
        "AdamW state; the trainer's process keeps one full copy to send to the rollout backends.",
    )
    placement: Literal["pack", "spread"] = Field(
        "pack",
        description="How the train workers are placed over the Ray cluster's nodes: 'pack' "
        "(as few nodes as fit them) or 'spread' (one per node as far as nodes go). Every train "
        "worker's node must see the run directory (shared storage); a run whose workers cannot "
        "is refused before its first step.",
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
        description="Torch threads of each Ray actor (the learner, every rollout worker and "
        "every train worker); 0 = the cores of its node // (rollout_workers + 1) for the learner "
        "and rollout workers, // (rollout_workers + train_workers) for train workers, at least 1.",
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


def _not(value: Any) -> Callable[[Any], bool]:
    return lambda v: v != value


# rollout.spec values that draft with nothing specrl can train or load (``rollout_plan.
# learned_drafter`` is False for them; a test checks it against the registry). A drafter
# registered later counts as learned here; ``rollout_plan`` refuses what it cannot use.
UNLEARNED_SPECS = ("none", "ngram", "suffix", "self")
_LEARNED = " of a learned drafter (not 'none', 'ngram', 'suffix' or 'self')"
_RAY = ("cluster.rollout_workers", "cluster.train_workers")  # either starts Ray actors
_TRAINED = under("drafter", "time_share", "lr", "batch_tokens", "buffer_steps", "max_updates")
_REFRESH = under("drafter", "drift_tolerance", "max_lag")
_ENV_FILE = under(
    "env", "train_file", "eval_file", "prompt_column", "answer_column", "system_prompt",
    "max_prompt_tokens",
)  # fmt: skip
_ENV_RG = under("env", "task", "task_config", "template", "format_bonus", "seed")

# Fields that apply only while another field holds. Setting one where it cannot apply is refused
# (``Config``), and ``Config.to_toml`` writes it only as a comment there. A field may have
# several rules (each is checked). Every field is classified in ``COVERAGE``.
APPLIES_ONLY: tuple[AppliesOnly, ...] = (
    AppliesOnly("pipeline.max_staleness", "pipeline.mode", _is("async"), "='async'"),
    AppliesOnly("pipeline.update", "pipeline.mode", _is("async"), "='async'"),
    AppliesOnly("pipeline.in_flight_tokens", "pipeline.update", _is("in_flight"), "='in_flight'"),
    *each(
        under("cluster", "address", "threads"), _RAY, lambda v: v[0] > 0 or v[1] > 1,
        "cluster.rollout_workers > 0 or cluster.train_workers > 1",
    ),
    *each(
        under("cluster", "worker_cpus", "worker_gpus", "max_restarts"), "cluster.rollout_workers",
        lambda n: n > 0, " > 0",
    ),
    *each(
        under("rollout", "num_spec_tokens", "spec_siblings", "spec_exact",
              "max_tokens_per_forward", "alarm_action"),
        "rollout.spec", _not("none"), " other than 'none'",
    ),
    AppliesOnly("rollout.step_graphs", "rollout.backend", _is("native"), "='native'"),
    # vLLM returns no routing to replay
    AppliesOnly("learner.routing_replay", "rollout.backend", _is("native"), "='native'"),
    *each(_ENV_FILE, "env.kind", _is("file"), "='file'"),
    *each(_ENV_RG, "env.kind", _is("reasoning_gym"), "='reasoning_gym'"),
    AppliesOnly("run.final_checkpoint", "run.checkpoint_every", lambda n: n > 0, " > 0"),
    AppliesOnly("cluster.placement", "cluster.train_workers", lambda n: n > 1, " > 1"),
    # train workers write one sharded (DCP) checkpoint with the optimizer's shards, always whole
    AppliesOnly("run.final_checkpoint", "cluster.train_workers", lambda n: n <= 1, " <= 1"),
    AppliesOnly("reward.timeout_s", "reward.workers", lambda n: n > 0, " > 0"),
    AppliesOnly("reward.pattern", "reward.funcs", lambda f: "regex" in f, " holding 'regex'"),
    AppliesOnly("learner.is_cap", "learner.correction", _not("ppo"), " other than 'ppo'"),
    AppliesOnly("learner.normalize_std", "learner.advantage", _is("grpo"), "='grpo'"),
    *each(
        under("learner", "bf16_mode", "head_precision"), "learner.dtype", _not("fp32"),
        " other than 'fp32'",
    ),
    *each(
        ("model.gpu_memory_utilization", "learner.head_precision"), "model.device", _not("cpu"),
        " other than 'cpu'",
    ),
    *each(
        ("rollout.drafter_path", *_TRAINED, *_REFRESH, "drafter.vocab"), "rollout.spec",
        lambda s: s not in UNLEARNED_SPECS, _LEARNED,
    ),
    *each(_TRAINED, "drafter.mode", _not("frozen"), " other than 'frozen'"),
    # only a head trained from nothing picks a vocabulary (``rollout_plan``, ``fresh_head``)
    AppliesOnly(
        "drafter.vocab", ("drafter.mode", "rollout.spec", "rollout.drafter_path"),
        lambda v: v[0] != "frozen" and v[1] != "draft" and v[2] is None,
        "drafter.mode other than 'frozen', rollout.spec other than 'draft' and no "
        "rollout.drafter_path (a head trained from nothing)",
    ),
    *each(_REFRESH, "drafter.mode", lambda m: m in ("auto", "refresh"), " 'refresh' or 'auto'"),
)  # fmt: skip

# Every field of ``Config`` in a class (``settings.Coverage``; tests/test_config_coverage.py walks
# them). ``always``: read in every configuration (audited where the code reads it).
COVERAGE = settings.Coverage(
    rules=APPLIES_ONLY,
    always=(
        *under("model", "name", "dtype", "device"),
        *under("env", "kind", "num_train", "num_eval"),
        *under("reward", "funcs", "weights", "workers", "on_error"),
        *under("rollout", "group_size", "prompts_per_step", "max_new_tokens", "temperature",
               "top_p", "top_k", "spec", "max_batch", "backend", "placement"),
        *under("learner", "loss", "advantage", "lr", "betas", "weight_decay", "max_grad_norm",
               "micro_batch_tokens", "kl_coef", "share_prompts", "clip_eps_low", "clip_eps_high",
               "dtype", "logprob_chunk", "correction", "activation_checkpointing"),
        "pipeline.mode",
        # keep_checkpoints: a stopped run's checkpoint prunes too (``loop.stop_checkpoint``)
        *under("run", "steps", "eval_every", "checkpoint_every", "keep_checkpoints", "seed",
               "run_dir", "tensorboard", "wandb"),
        *under("cluster", "rollout_workers", "train_workers"),
    ),
    checked=(
        ("rollout.threads", "rollout_plan._ignored: needs the engine in a worker process "
         "(rollout.placement resolved)"),
        ("rollout.spec_siblings", "rollout_plan._check_names: a deterministic drafter takes none"),
        ("drafter.mode", "rollout_plan._training_mode: an explicit mode needs a learned drafter "
         "(the proposer registry)"),
        ("learner.routing_replay", "rl.learner.Learner: a mixture-of-experts policy"),
        ("learner.moe_aux_loss_coef", "rl.learner.Learner: > 0 needs a mixture-of-experts "
         "policy"),
    ),
)  # fmt: skip


class Config(Section):
    """A whole training run."""

    model: ModelCfg = Field(default_factory=ModelCfg, description="The policy model.")
    env: EnvCfg = Field(default_factory=EnvCfg, description="Task and prompts.")
    reward: RewardCfg = Field(default_factory=RewardCfg, description="Rewards.")
    rollout: RolloutCfg = Field(default_factory=RolloutCfg, description="Generation.")
    learner: LearnerCfg = Field(default_factory=LearnerCfg, description="Learning.")
    pipeline: PipelineCfg = Field(default_factory=PipelineCfg, description="Scheduling.")
    drafter: DrafterCfg = Field(
        default_factory=DrafterCfg, description="Drafter training during RL."
    )
    run: RunCfg = Field(default_factory=RunCfg, description="Run management.")
    cluster: ClusterCfg = Field(default_factory=ClusterCfg, description="Ray placement.")

    @model_validator(mode="after")
    def _something_to_evaluate(self) -> Config:
        if self.run.eval_every > 0 and self.env.num_eval == 0:
            raise ValueError(
                f"env.num_eval=0 with run.eval_every={self.run.eval_every}: there is nothing to "
                "evaluate; set run.eval_every=0 or env.num_eval >= 1"
            )
        return self

    @model_validator(mode="after")
    def _only_what_applies(self, info: ValidationInfo) -> Config:
        """A field set (in a file or an override, whatever its value) where it cannot apply
        is refused, naming both fields (see ``APPLIES_ONLY``)."""
        if info.context and info.context.get("check_applies") is False:
            return self
        if problems := settings.misapplied(self, APPLIES_ONLY):
            raise ValueError("; ".join(problems))
        return self

    def inapplicable(self) -> list[AppliesOnly]:
        """The ``APPLIES_ONLY`` rules whose field cannot apply in this config."""
        return settings.inapplicable(self, APPLIES_ONLY)

    def to_toml(self) -> str:
        """A TOML document (each field's description as a comment above it) that
        ``load_config`` reads back to an equal config; a field that cannot apply here
        (``APPLIES_ONLY``) is only a comment."""
        return settings.toml_document(
            self, {rule.key: rule.condition for rule in self.inapplicable()}
        )


# --------------------------------------------------------------------------- loading


def load_config(
    path: str | Path | dict[str, Any] | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    preset: str | None = None,
) -> Config:
    """Defaults <- preset (if named) <- TOML file (if given; or its table as a dict) <-
    ``key.sub=value`` overrides, validated."""
    with errors_as(ConfigError):
        data = read_toml(preset_path(preset)) if preset is not None else {}
        if path is not None:
            table = path if isinstance(path, dict) else read_toml(Path(path))
            data = settings.merge(data, table)
        return validate_config(settings.apply_overrides(data, overrides))


def preset_names() -> list[str]:
    """The presets shipped with specrl (``specrl/presets/<name>.toml``)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


def preset_path(name: str) -> Path:
    """The TOML file of preset ``name``; ``ConfigError`` naming the valid ones if unknown."""
    path = PRESETS_DIR / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r} (presets: {', '.join(preset_names())})")
    return path


def load_run_config(path: Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """A run directory's config.toml (``Config.to_toml``) <- overrides, validated. The file
    was written whole: fields of it that cannot apply once the overrides are in
    (``APPLIES_ONLY``; an older specrl wrote them, or ``--set reward.workers=0`` made the stored
    ``reward.timeout_s`` moot) are dropped, having had no effect; an override is checked like
    any other."""
    with errors_as(ConfigError):
        data = settings.apply_overrides(read_toml(path), overrides)
        given = {".".join(parse_override(item)[0]) for item in overrides}
        for key, *_ in validate_config(data, check_applies=False).inapplicable():
            section, name = key.split(".")
            if key not in given and isinstance(data.get(section), dict):
                data[section].pop(name, None)  # written whole, never set: it had no effect
        return validate_config(data)


def validate_config(data: dict[str, Any], check_applies: bool = True) -> Config:
    """``Config`` from TOML data (``ConfigError`` in one line); ``check_applies=False`` skips
    the refusal of fields set where they cannot apply."""
    with errors_as(ConfigError):
        context = {"check_applies": check_applies}
        return settings.validate(Config, data, "config", context=context)


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"learner.lr=1e-5"`` -> (["learner", "lr"], 1e-5) (``specrl.settings.parse_override``,
    raising ``ConfigError``)."""
    with errors_as(ConfigError):
        return settings.parse_override(item)
