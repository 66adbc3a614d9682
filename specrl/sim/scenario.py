"""Scenarios: the typed input of one simulation, from TOML with ``--set key=value`` overrides.

A Scenario names a model, a hardware profile and a drafter (spec files) and gives the workload,
generation layout, speculation, training efficiency and pipeline mode; a file may ``extends``
another. ``load_scenario(name, overrides)`` validates with ``specrl.settings`` (the run config's
sections, overrides and errors): every bad input raises a one-line ``SimInputError``, and an
input given where it cannot apply (``APPLIES_ONLY``, e.g. ``ASYNC_ONLY`` for a sync run) is
refused naming both keys: given by an override, or in the scenario file while no override
changed what it depends on. ``COVERAGE`` classifies every input (``settings.Coverage``: a rule,
always applying, checked against the specs by validate.py, or kept with its reason).
``field_help()`` renders the fields for ``--help``. Checks across fields: validate.py; the
simulation: runner.py. Details: docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

from specrl import settings
from specrl.costmodel.errors import SimInputError, key_hint
from specrl.costmodel.specs import load_toml
from specrl.settings import AppliesOnly, Section, each, errors_as, under

MAX_GPUS = 65_536  # GPU counts: the simulation's cost grows with them (1e6 took 15 s)
MAX_TOKENS = 10_000_000  # token counts (lengths, caps)


class Workload(Section):
    samples_per_step: int = Field(
        gt=0, le=10_000_000, description="rollouts per RL step (prompts x group size)"
    )
    prompt_len: int = Field(256, ge=1, le=MAX_TOKENS, description="prompt tokens per rollout")
    mean_response_len: float = Field(gt=0, description="mean response tokens (before truncation)")
    response_sigma: float = Field(
        0.8, ge=0, description="log-space sigma of the lognormal response length (the tail)"
    )
    max_response_len: int = Field(
        gt=0, le=MAX_TOKENS, description="response length cap (max_tokens)"
    )
    mean_is_after_cap: bool = Field(
        False,
        description="mean_response_len is the observed mean after the cap (a published average)"
        " rather than the lognormal mean before truncation",
    )
    length_trace: list[int] = Field(
        default_factory=list, description="replay these response lengths instead of sampling"
    )
    rl_step: int = Field(
        0, ge=0, le=1_000_000, description="RL steps since the drafter was last trained"
    )
    seed: int = Field(
        0,
        ge=0,
        le=2**63 - 1,
        description="seed of the length sampler (same draw with and without spec)",
    )
    seeds: int = Field(
        3,
        ge=1,
        le=64,
        description="length draws averaged (seed, seed+1, ...); results give their spread (one"
        " draw when length_trace is given or response_sigma is 0)",
    )


class Generation(Section):
    gpus: int = Field(
        gt=0, le=MAX_GPUS, description="GPUs generating (sync: the whole colocated pool)"
    )
    gpus_per_replica: int = Field(
        1, gt=0, le=MAX_GPUS, description="GPUs per engine replica (TP x EP)"
    )
    max_num_seqs: int = Field(
        256, gt=0, le=1_000_000, description="engine limit on running sequences"
    )
    replan_tokens: int = Field(
        256, gt=0, le=MAX_TOKENS, description="re-choose k every this many tokens"
    )
    routing_locality: float = Field(
        0.0, ge=0, le=1, description="MoE: chance a verify token reuses its sequence's experts"
    )
    prefill_group: int = Field(
        1,
        ge=1,
        le=1_000_000,
        description="sequences sharing one prompt, prefilled once (1: each its own)",
    )
    ep: int = Field(
        1,
        ge=1,
        le=MAX_GPUS,
        description="MoE: expert-parallel degree inside a replica (1: experts tensor-parallel,"
        " vLLM's default; > 1: E/ep experts per GPU, all-to-all dispatch and combine)",
    )
    precision: str = Field("bf16", description="weight precision of the generators: bf16 | fp8")
    routing_skew: float = Field(
        1.0,
        ge=1,
        description="MoE with ep > 1: the busiest rank's token load over a uniform router's",
    )


class Acceptance(Section):
    kind: str = Field("constant", description="constant | positional | drift")
    acceptance_length: float = Field(
        2.26, ge=1, description="mean tokens per verify step at k = at_k (sets per-token rate)"
    )
    at_k: int = Field(3, ge=1, le=64, description="k at which acceptance_length was measured")
    per_position: list[float] = Field(
        default_factory=list, description="positional: acceptance of draft 1, 2, ... given prefix"
    )
    decay_per_1k_tokens: float = Field(0.0, description="drift: rate lost per 1k response tokens")
    decay_per_rl_step: float = Field(0.0, description="drift: rate lost per RL step of staleness")
    floor: float = Field(0.0, ge=0, le=1, description="drift: lowest per-token rate")
    decay_after_tokens: int = Field(
        0, ge=0, le=MAX_TOKENS, description="drift: response tokens before the decay starts"
    )
    position_ratio: float | None = Field(
        None,
        gt=0,
        description="acceptance of draft i+1 over draft i's (None: the drafter spec's profile)",
    )
    measured_over: str = Field(
        "start",
        description="start: acceptance_length holds at response position 0 | rollout: it is the"
        " rollout's mean (tokens per sequence-step, as vLLM reports it) and the start rate is"
        " solved to match it",
    )


class Speculation(Section):
    enabled: bool = Field(True, description="simulate the speculative run (baseline always runs)")
    drafter: str = Field(
        "eagle3", description="drafter spec: eagle3 | mtp | draft-* | ngram | suffix"
    )
    policy: str = Field(
        "fixed", description="fixed (always k) | cost_optimal (best k<=k per batch)"
    )
    k: int = Field(
        3, ge=1, le=64, description="draft tokens per step (upper bound for cost_optimal)"
    )
    tree_width: int = Field(
        1, ge=1, le=64, description="draft tokens per sequence per draft forward"
    )
    tree_verify_tokens: int = Field(
        0, ge=0, le=4096, description="tokens verified per sequence (0: k+1)"
    )
    draft_coverage: list[float] = Field(
        default_factory=list,
        description="per draft position, chance a sequence drafts there (n-gram/suffix may not);"
        " verify is padded to the batch's longest draft ([]: all draft k)",
    )
    acceptance: Acceptance = Field(default_factory=Acceptance)


class Training(Section):
    gpus: int = Field(
        0, ge=0, le=MAX_GPUS, description="training GPUs (async only; sync uses generation.gpus)"
    )
    mfu: float = Field(
        0.0, ge=0, le=1, description="training MFU (0: the model class's, data/training.toml)"
    )
    logprob_mfu: float = Field(
        0.0, ge=0, le=1, description="logprob-pass MFU (0: the model class's, data/training.toml)"
    )
    logprob_passes: int = Field(
        2, ge=0, le=16, description="logprob forwards per token (policy + ref)"
    )
    train_drafter: bool = Field(False, description="train the drafter online every step")


class Pipeline(Section):
    mode: str = Field("sync", description="sync (colocated) | async (disaggregated)")
    staleness: int = Field(1, ge=0, le=64, description="async: max policy versions a batch may lag")
    async_generation: str = Field(
        "continuous",
        description="async: continuous (generators stay full across steps within the staleness"
        " bound, as AReaL / NeMo-RL async with in-flight weight updates) | drain (each step's"
        " batch finishes, long tail included, before the next starts)",
    )
    warmup_periods: int = Field(
        1,
        ge=0,
        le=64,
        description="async: periods of staleness + 1 steps simulated before measuring (the"
        " pipeline filling); sync is exact from the first step",
    )
    measure_periods: int = Field(
        2,
        ge=1,
        le=64,
        description="async: periods of staleness + 1 steps averaged in steady state (step"
        " completions repeat with that period); one more period runs after them",
    )
    framework_overhead_s: float = Field(
        3.0,
        ge=0,
        description="fixed seconds per RL step outside generation/logprobs/train/refit (data,"
        " rewards, orchestration); 3 s = NeMo-RL v0.3 published step breakdowns (total minus"
        " phases: 2-4 s over four models)",
    )
    refit_fixed_s: float = Field(2.0, ge=0, description="fixed seconds per weight refit")
    refit_bandwidth: float = Field(
        100e9, gt=0, description="aggregate bytes/s of a refit (colocated ~1e11, RDMA ~1.5e12)"
    )


class Engine(Section):
    """Overrides of the engine terms of the hardware profile and drafter spec (sensitivity)."""

    step_overhead_s: float | None = Field(
        None, ge=0, description="seconds per engine step (None: the hardware profile's)"
    )
    forward_overhead_s: float | None = Field(
        None, ge=0, description="seconds per drafter forward (None: the hardware profile's)"
    )
    verify_s_per_logit: float | None = Field(
        None, ge=0, description="sampler seconds per verified logit (None: the profile's)"
    )
    cpu_s_per_ctx_token: float | None = Field(
        None, ge=0, description="model-free drafter: CPU s per context token (None: the spec's)"
    )
    graph_capture_tokens: int | None = Field(
        None,
        ge=0,
        le=MAX_TOKENS,
        description="largest CUDA-graph forward, tokens; 0: no limit (None: the profile's)",
    )
    eager_s_per_layer: float | None = Field(
        None,
        ge=0,
        description="host s per layer past graph_capture_tokens (None: the profile's)",
    )
    layer_s: float | None = Field(
        None, ge=0, description="fixed s per decoder layer per forward (None: the profile's)"
    )
    moe_layer_s: float | None = Field(
        None, ge=0, description="MoE model: more fixed s per MoE layer (None: the profile's)"
    )
    expert_s: float | None = Field(
        None, ge=0, description="MoE model: s per touched expert per MoE layer (None: profile's)"
    )
    eta_expert_mem: float | None = Field(
        None,
        ge=0,
        le=1,
        description="MoE model: bandwidth efficiency of routed experts, 0: eta_mem's (None:"
        " the profile's)",
    )


class Scenario(Section):
    name: str = Field(description="scenario name")
    description: str = Field("", description="what the scenario represents")
    sources: list[str] = Field(default_factory=list, description="where the inputs come from")
    model: str = Field(description="model spec name (specrl simulate list)")
    hardware: str = Field(description="hardware profile name (specrl simulate list)")
    workload: Workload
    generation: Generation
    speculation: Speculation = Field(default_factory=Speculation)
    training: Training = Field(default_factory=Training)
    pipeline: Pipeline = Field(default_factory=Pipeline)
    engine: Engine = Field(default_factory=Engine)


MAX_EXTENDS = 8  # depth of `extends` chains (a longer one is a cycle or a mistake)


def scenario_data(name: str, depth: int = 0) -> tuple[dict[str, Any], str]:
    """A scenario file's table with its ``extends`` chain merged in (the base scenario's values,
    then this file's), and the path it came from."""
    data, path = load_toml("scenarios", name)
    base = data.pop("extends", None)
    if base is None:
        return data, path
    if not isinstance(base, str) or depth >= MAX_EXTENDS:
        raise SimInputError(
            f"scenario {path}: extends must name a scenario, at most {MAX_EXTENDS} deep"
            f" (got {base!r})"
        )
    merged, _ = scenario_data(base, depth + 1)
    return settings.merge(merged, data), path


def load_scenario(name: str, overrides: list[str] | None = None) -> Scenario:
    """Load a bundled scenario by name (or a TOML path) and apply overrides; any bad input
    raises SimInputError with a one-line message."""
    overrides = list(overrides or [])
    data, path = scenario_data(name)
    with errors_as(SimInputError):
        data = settings.apply_overrides(data, overrides)
        hint = key_hint(Scenario)
        sc = settings.validate(
            Scenario, data, "scenario", hint=hint, source=path, overrides=overrides
        )
    check_applies(sc, overrides)
    return sc


def _is(value: Any) -> Callable[[Any], bool]:
    return lambda v: v == value


def _empty(values: list[Any]) -> bool:
    return not values


# Pipeline inputs that apply only to an async run (a scenario file's own values stay when an
# override changes the mode: ``--set pipeline.mode=sync`` turns an async scenario into its sync
# baseline).
ASYNC_ONLY = each(
    under("pipeline", "staleness", "async_generation", "warmup_periods", "measure_periods"),
    "pipeline.mode",
    _is("async"),
    "='async'",
)
_ACC = "speculation.acceptance"
MOE_ENGINE_TERMS = ("moe_layer_s", "expert_s", "eta_expert_mem")  # engine terms of MoE models

# Inputs that apply only while another input holds (``check_applies`` refuses them elsewhere).
APPLIES_ONLY: tuple[AppliesOnly, ...] = (
    *ASYNC_ONLY,
    AppliesOnly(f"{_ACC}.per_position", f"{_ACC}.kind", _is("positional"), "='positional'"),
    *each(
        (*under(_ACC, "decay_per_1k_tokens", "decay_per_rl_step", "floor", "decay_after_tokens"),
         "workload.rl_step"), f"{_ACC}.kind", _is("drift"), "='drift'",
    ),
    # rates given per draft position replace the rate these derive
    *each(
        under(_ACC, "acceptance_length", "at_k", "position_ratio", "measured_over"),
        f"{_ACC}.per_position", _empty, " empty",
    ),
    # a replayed trace replaces the sampled lengths
    *each(
        under("workload", "seed", "response_sigma", "mean_is_after_cap"), "workload.length_trace",
        _empty, " empty",
    ),
    AppliesOnly("generation.routing_skew", "generation.ep", lambda ep: ep > 1, " > 1"),
    AppliesOnly("speculation.draft_coverage", "speculation.tree_verify_tokens", _is(0), " = 0"),
)  # fmt: skip

_SPECULATIVE = (  # read only by the speculative run
    *under("speculation", "drafter", "policy", "k", "tree_width", "tree_verify_tokens",
           "draft_coverage"),
    *under(_ACC, *Acceptance.model_fields),
    *under("engine", "forward_overhead_s", "verify_s_per_logit", "cpu_s_per_ctx_token"),
    "training.train_drafter",
    "workload.rl_step",
)  # fmt: skip

# Every input of ``Scenario`` in a class (``settings.Coverage``; tests/sim/test_sim_coverage.py
# walks them). ``always``: read by every simulation (audited where the simulator reads it).
COVERAGE = settings.Coverage(
    rules=APPLIES_ONLY,
    always=(
        "name", "description", "sources", "model", "hardware",
        *under("workload", "samples_per_step", "prompt_len", "length_trace"),
        *under("generation", "gpus", "gpus_per_replica", "max_num_seqs", "replan_tokens",
               "prefill_group", "ep", "precision"),
        "speculation.enabled",
        *under("training", "mfu", "logprob_mfu", "logprob_passes"),
        *under("pipeline", "mode", "framework_overhead_s", "refit_fixed_s", "refit_bandwidth"),
        *under("engine", "step_overhead_s", "graph_capture_tokens", "layer_s"),
    ),
    checked=(
        *((f"engine.{key}", "validate._check_spec_terms: needs a mixture-of-experts model")
          for key in MOE_ENGINE_TERMS),
        ("training.gpus", "validate._check_gpu_counts: a sync run trains on generation.gpus"),
        ("generation.routing_locality", "validate._check_spec_terms: needs a mixture-of-experts "
         "model"),
        ("engine.eager_s_per_layer", "validate._check_spec_terms: needs graph_capture_tokens > 0 "
         "(the override or the hardware profile's)"),
        ("engine.cpu_s_per_ctx_token", "validate._check_spec_terms: needs a model-free drafter"),
        ("training.train_drafter", "validate._check_spec_terms: needs a drafter with weights"),
    ),
    kept=(
        *((key, "ignored with speculation.enabled=false; accepted: the switch to the baseline "
          "keeps the speculative inputs (paper.refit_paper_inputs sets them together)")
          for key in _SPECULATIVE),
        ("engine.forward_overhead_s", "ignored with a model-free drafter; accepted: "
         "paper.refit_paper_inputs passes one set of overrides to every row"),
        ("workload.seeds", "ignored with a length_trace or response_sigma=0 (one draw); accepted: "
         "workload.seeds=1 is how callers ask any scenario for one draw (serving, paper)"),
        *((f"workload.{key}", "ignored with a length_trace; accepted: a required input")
          for key in ("mean_response_len", "max_response_len")),
    ),
)  # fmt: skip


def check_applies(sc: Scenario, overrides: list[str]) -> None:
    """``SimInputError`` naming both keys for each ``APPLIES_ONLY`` input that cannot apply in
    ``sc`` and is given: by an override (whatever its value), or in the scenario file while no
    override changed a key it depends on."""
    by_override = settings.given_by(overrides)

    def given(key: str) -> bool:
        others = (o for rule in APPLIES_ONLY if rule.key == key for o in rule.others)
        moved = any(by_override(other) for other in others)
        return by_override(key) or (settings.was_set(sc, key) and not moved)

    if problems := settings.misapplied(sc, APPLIES_ONLY, given):
        raise SimInputError("; ".join(problems))


def field_help(model: type[BaseModel] = Scenario, prefix: str = "") -> list[str]:
    """One line per input: dotted key, default and description (for --help)."""
    lines: list[str] = []
    for key, info in model.model_fields.items():
        if (sub := settings.submodel(info.annotation)) is not None:
            lines += field_help(sub, f"{prefix}{key}.")
            continue
        default = (
            "required"
            if info.is_required()
            else f"default {info.get_default(call_default_factory=True)!r}"
        )
        lines.append(f"{prefix}{key} ({default}): {info.description}")
    return lines
