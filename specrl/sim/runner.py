"""Run a Scenario: rollouts with and without speculation, RL phases, schedules, speedups.

``run_scenario(sc)`` checks the scenario (``SimInputError`` before any simulation), then per
response-length draw simulates ``speculative``, ``no_spec`` and ``sync_no_spec`` on the same
lengths, and returns a ``ScenarioResult``: mean times, rollout and end-to-end speedups (ratios of
means; ``spread()`` per draw), steady-state step times (the window lengthened until its halves
agree, else a warning) and ``overlap_floor_s``. Details: docs/internals.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from specrl.costmodel.cost import StepCostModel
from specrl.costmodel.errors import SimInputError
from specrl.costmodel.specs import (
    DrafterSpec,
    HardwareSpec,
    load_drafter,
    load_hardware,
    load_model,
    with_overrides,
)
from specrl.sim.acceptance import (
    AcceptanceModel,
    AcceptanceParams,
    alpha_for_length,
    alpha_for_rollout_length,
)
from specrl.sim.continuous import simulate_continuous
from specrl.sim.pipeline import PIPELINES, Schedule, StepPhases, StepWindow, steady_window
from specrl.sim.rollout import (
    EngineConfig,
    RolloutResult,
    sample_lengths,
    sample_lengths_capped_mean,
    simulate_rollout,
)
from specrl.sim.scenario import Scenario
from specrl.sim.training import load_efficiency, logprob_seconds, train_seconds
from specrl.sim.validate import check_scenario


def acceptance_model(sc: Scenario, responses: np.ndarray | None = None) -> AcceptanceModel:
    """The scenario's acceptance model, shaped over draft positions by its drafter's profile.
    With ``measured_over = "rollout"`` the start rate is solved so that a rollout of
    ``responses`` (default: the workload's lengths) reports ``acceptance_length`` at ``at_k``."""
    cfg = sc.speculation.acceptance
    ratio = cfg.position_ratio or load_drafter(sc.speculation.drafter).position_ratio
    params = AcceptanceParams(
        alpha=alpha_for_length(cfg.acceptance_length, cfg.at_k, ratio),
        per_position=tuple(cfg.per_position),
        decay_per_1k_tokens=cfg.decay_per_1k_tokens,
        decay_per_rl_step=cfg.decay_per_rl_step,
        floor=cfg.floor,
        position_ratio=ratio,
        decay_after_tokens=float(cfg.decay_after_tokens),
    )
    model = AcceptanceModel(cfg.kind, params)
    if cfg.measured_over != "rollout":
        return model
    lengths = workload_lengths(sc)[1] if responses is None else responses
    try:
        alpha = alpha_for_rollout_length(
            model, cfg.at_k, lengths, cfg.acceptance_length, sc.workload.rl_step
        )
    except ValueError as e:
        raise SimInputError(f"speculation.acceptance: {e}") from None
    return AcceptanceModel(cfg.kind, replace(params, alpha=alpha))


def hardware(sc: Scenario) -> HardwareSpec:
    """The scenario's hardware profile with its ``engine`` overrides applied."""
    hw = load_hardware(sc.hardware)
    given = sc.engine.model_dump(exclude_none=True)  # the profile's fields among them
    return with_overrides(hw, **{k: v for k, v in given.items() if k in HardwareSpec.model_fields})


def drafter(sc: Scenario) -> DrafterSpec:
    """The scenario's drafter spec with its ``engine`` overrides applied."""
    spec = load_drafter(sc.speculation.drafter)
    if sc.engine.cpu_s_per_ctx_token is None:
        return spec
    return with_overrides(spec, cpu_s_per_ctx_token=sc.engine.cpu_s_per_ctx_token)


def step_costs(sc: Scenario, spec: bool) -> StepCostModel:
    g = sc.generation
    return StepCostModel(
        target=load_model(sc.model),
        hw=hardware(sc),
        gpus=g.gpus_per_replica,
        drafter=drafter(sc) if spec else None,
        tree_width=sc.speculation.tree_width,
        tree_verify_tokens=sc.speculation.tree_verify_tokens,
        routing_locality=g.routing_locality,
        prefill_group=g.prefill_group,
        draft_coverage=tuple(sc.speculation.draft_coverage),
        ep=g.ep,
        precision=g.precision,
        routing_skew=g.routing_skew,
    )


def workload_lengths(sc: Scenario) -> tuple[np.ndarray, np.ndarray]:
    w = sc.workload
    n = w.samples_per_step
    if w.length_trace:
        responses = np.resize(np.asarray(w.length_trace, dtype=np.int64), n)
    else:
        sampler = sample_lengths_capped_mean if w.mean_is_after_cap else sample_lengths
        responses = sampler(w.mean_response_len, w.response_sigma, w.max_response_len, n, w.seed)
    return np.full(n, w.prompt_len, dtype=np.int64), responses


def engine_config(sc: Scenario, spec: bool) -> EngineConfig:
    s = sc.speculation
    return EngineConfig(
        costs=step_costs(sc, spec),
        acceptance=acceptance_model(sc),
        policy=s.policy if spec else "off",
        k=s.k,
        max_num_seqs=sc.generation.max_num_seqs,
        replan_tokens=sc.generation.replan_tokens,
        rl_step=sc.workload.rl_step,
    )


def replica_count(sc: Scenario, gpus: int | None = None) -> int:
    return max(1, (gpus or sc.generation.gpus) // sc.generation.gpus_per_replica)


def simulate_generation(sc: Scenario, spec: bool, gpus: int | None = None) -> RolloutResult:
    """Rollout wall time of one RL step on ``gpus`` generation GPUs (default: the scenario's)."""
    prompts, responses = workload_lengths(sc)
    return simulate_rollout(prompts, responses, engine_config(sc, spec), replica_count(sc, gpus))


def rl_phases(sc: Scenario, generation_s: float, spec: bool, train_gpus: int) -> StepPhases:
    """Seconds of each RL phase for one step given the simulated generation time (training.py
    prices the trainer; the refit moves the generators' weights at their precision)."""
    model, hw, t = load_model(sc.model), load_hardware(sc.hardware), sc.training
    _, responses = workload_lengths(sc)
    n = sc.workload.samples_per_step
    tokens = float(n * sc.workload.prompt_len + responses.sum())
    seq_len = tokens / n
    eff = load_efficiency(model)
    costs = step_costs(sc, spec)
    draft = costs.draft_model if spec else None
    drafter_s = 0.0
    if draft is not None and t.train_drafter:
        drafter_s = train_seconds(draft, hw, train_gpus, tokens, seq_len, eff, t.mfu)
    return StepPhases(
        generation=generation_s,
        logprobs=logprob_seconds(
            model, hw, train_gpus, tokens, seq_len, t.logprob_passes, eff, t.logprob_mfu
        ),
        train=train_seconds(model, hw, train_gpus, tokens, seq_len, eff, t.mfu),
        drafter_train=drafter_s,
        refit=sc.pipeline.refit_fixed_s + costs.weight_bytes() / sc.pipeline.refit_bandwidth,
        overhead=sc.pipeline.framework_overhead_s,
    )


CONVERGENCE_TOL = 0.02  # largest relative gap between the halves of a converged measured window
MAX_WINDOW_SCALE = 8  # an unconverged async run is re-simulated with up to 8x the measured periods


@dataclass(frozen=True)
class PipelineRun:
    rollout: RolloutResult
    phases: StepPhases
    schedule: Schedule
    period: int = 1  # steps per period of the measured window
    floor_s: float = 0.0  # perfect-overlap lower bound on step_time (overlap_floor_s)

    @property
    def half_spread(self) -> float:
        """How far from steady state the measured step time is (Schedule.half_spread)."""
        return self.schedule.half_spread(self.period)

    @property
    def converged(self) -> bool:
        return self.half_spread <= CONVERGENCE_TOL

    def summary(self) -> dict:
        return {
            "step_time_s": self.schedule.step_time,
            "phases_s": self.phases.as_dict(),
            "rollout": self.rollout.summary(),
        }


def scenario_window(sc: Scenario, mode: str, scale: int = 1) -> StepWindow:
    """The scenario's step window with ``scale`` times its measured periods."""
    p = sc.pipeline
    return steady_window(mode, p.staleness, p.warmup_periods, scale * p.measure_periods)


def generation_floor_s(sc: Scenario, spec: bool, gpus: int | None = None) -> float:
    """A lower bound on the seconds one generation replica needs per RL step (its mean share of
    the batch), whatever the scheduling: every decode step costs its fixed part, a part per
    sequence (the smallest per-sequence cost over batch sizes up to ``max_num_seqs``) and a
    part per token of context held; a step holds at most ``max_num_seqs`` sequences and the KV
    capacity's tokens of context. Prefill, preemption and refit pauses are left out (>= 0)."""
    cfg = engine_config(sc, spec)
    prompts, responses = workload_lengths(sc)
    choices = {"off": [0], "fixed": [cfg.k], "cost_optimal": list(range(cfg.k + 1))}
    floors = [_floor_at_k(sc, cfg, k, prompts, responses) for k in choices[cfg.policy]]
    return min(floors) / replica_count(sc, gpus)


def _floor_at_k(
    sc: Scenario, cfg: EngineConfig, k: int, prompts: np.ndarray, responses: np.ndarray
) -> float:
    """The bound of ``generation_floor_s`` at one k, for the whole batch on one replica (before
    the division by the replica count). prompts, responses: [n] prompt and response lengths
    (tokens) of the batch's n sequences."""
    costs, top = cfg.costs, sc.generation.max_num_seqs
    grid = np.arange(0, int(responses.max()) + 1, max(1, sc.generation.replan_tokens))
    tps = float(cfg.acceptance.expected_tokens(k, grid, cfg.rl_step).max())
    lengths = responses.astype(float)  # [n]
    steps = lengths / tps  # [n] decode steps per sequence, at most tps tokens a step
    seq_steps = float(steps.sum())
    # context summed over a sequence's steps: p, p + tps, ..., at least n * (p + (L - tps) / 2)
    ctx_steps = float((steps * np.maximum(prompts + (lengths - tps) / 2.0, 0.0)).sum())
    fixed = costs.step(0, k, 0.0)
    per_seq = min((costs.step(b, k, 0.0) - fixed) / b for b in range(1, top + 1))
    per_ctx = (costs.step(1, k, 1000.0) - costs.step(1, k, 0.0)) / 1000.0
    least_steps = max(ctx_steps / costs.kv_capacity_tokens(), seq_steps / top)
    return least_steps * fixed + seq_steps * per_seq + ctx_steps * per_ctx


def run_pipeline(sc: Scenario, spec: bool, mode: str) -> PipelineRun:
    """One pipeline: sync trains on all generation GPUs; async on separate training GPUs. An
    async run whose measured window is not converged is simulated again with twice the measured
    periods, up to ``MAX_WINDOW_SCALE`` times the scenario's."""
    if mode == "sync":
        gpus = sc.generation.gpus + (sc.training.gpus if sc.pipeline.mode == "async" else 0)
        train_gpus = gpus
    else:
        gpus, train_gpus = sc.generation.gpus, sc.training.gpus
    rollout = simulate_generation(sc, spec, gpus)
    phases = rl_phases(sc, rollout.time_s, spec, train_gpus)
    if mode == "sync":
        return PipelineRun(
            rollout, phases, _schedule(sc, spec, mode, gpus, phases, 1), 1, phases.total
        )
    floor = max(phases.trainer, generation_floor_s(sc, spec, gpus))
    scale = 1
    while True:
        schedule = _schedule(sc, spec, mode, gpus, phases, scale)
        run = PipelineRun(rollout, phases, schedule, scenario_window(sc, mode).period, floor)
        if run.converged or scale >= MAX_WINDOW_SCALE or sc.pipeline.measure_periods < 2:
            return run
        scale *= 2


def _schedule(
    sc: Scenario, spec: bool, mode: str, gpus: int, phases: StepPhases, scale: int
) -> Schedule:
    """The pipeline's schedule over its step window, measured on that window."""
    p, window = sc.pipeline, scenario_window(sc, mode, scale)
    if mode == "async" and p.async_generation == "continuous":
        prompts, responses = workload_lengths(sc)
        cfg, replicas = engine_config(sc, spec), replica_count(sc, gpus)
        cont = simulate_continuous(
            prompts, responses, cfg, replicas, phases, window.steps, p.staleness
        )
        schedule = cont.schedule
    else:
        schedule = PIPELINES[mode](phases, window.steps, p.staleness)
    return replace(schedule, warmup=window.warmup, measured=window.measured)


PIPELINE_KINDS = ("speculative", "no_spec", "sync_no_spec")


@dataclass(frozen=True)
class SeedRun:
    """The three pipelines of one response-length draw (``workload.seed``)."""

    seed: int
    speculative: PipelineRun
    no_spec: PipelineRun
    sync_no_spec: PipelineRun

    def run(self, kind: str) -> PipelineRun:
        return getattr(self, kind)

    @property
    def rollout_speedup(self) -> float:
        return self.no_spec.rollout.time_s / self.speculative.rollout.time_s

    @property
    def end_to_end_speedup(self) -> float:
        return self.no_spec.schedule.step_time / self.speculative.schedule.step_time

    @property
    def end_to_end_speedup_vs_sync_no_spec(self) -> float:
        return self.sync_no_spec.schedule.step_time / self.speculative.schedule.step_time


SPEEDUPS = ("rollout_speedup", "end_to_end_speedup", "end_to_end_speedup_vs_sync_no_spec")


@dataclass(frozen=True)
class ScenarioResult:
    """A scenario over ``workload.seeds`` length draws. Times are means over the draws and the
    speedups ratios of those means; ``spread`` gives each draw's own speedups. ``speculative``,
    ``no_spec`` and ``sync_no_spec`` are the first draw's runs (its Gantt chart and details)."""

    scenario: Scenario
    runs: tuple[SeedRun, ...]
    warnings: tuple[str, ...] = ()

    @property
    def speculative(self) -> PipelineRun:
        return self.runs[0].speculative

    @property
    def no_spec(self) -> PipelineRun:
        return self.runs[0].no_spec

    @property
    def sync_no_spec(self) -> PipelineRun:
        return self.runs[0].sync_no_spec

    def mean_step_time(self, kind: str) -> float:
        return float(np.mean([r.run(kind).schedule.step_time for r in self.runs]))

    def mean_rollout_time(self, kind: str) -> float:
        return float(np.mean([r.run(kind).rollout.time_s for r in self.runs]))

    def mean_phases(self, kind: str) -> dict[str, float]:
        per_seed = [r.run(kind).phases.as_dict() for r in self.runs]
        return {k: float(np.mean([p[k] for p in per_seed])) for k in per_seed[0]}

    @property
    def rollout_speedup(self) -> float:
        return self.mean_rollout_time("no_spec") / self.mean_rollout_time("speculative")

    @property
    def end_to_end_speedup(self) -> float:
        return self.mean_step_time("no_spec") / self.mean_step_time("speculative")

    @property
    def end_to_end_speedup_vs_sync_no_spec(self) -> float:
        return self.mean_step_time("sync_no_spec") / self.mean_step_time("speculative")

    def spread(self) -> dict[str, dict]:
        """Each speedup per length draw, with their mean, std, min and max."""
        out = {}
        for name in SPEEDUPS:
            values = [float(getattr(r, name)) for r in self.runs]
            out[name] = {
                "per_seed": values,
                "mean": float(np.mean(values)),
                "std": float(np.std(values)),
                "min": min(values),
                "max": max(values),
            }
        return out

    def convergence(self) -> dict:
        """Per pipeline: the step window of the first draw and the largest half spread over the
        draws; ``converged`` is False when the run carries a warning."""
        pipelines = {}
        for kind in PIPELINE_KINDS:
            runs = [r.run(kind) for r in self.runs]
            s = runs[0].schedule
            pipelines[kind] = {
                "period_steps": runs[0].period,
                "warmup_steps": s.warmup,
                "measured_steps": s.last_measured - s.warmup,
                "steps_simulated": s.steps,
                "max_half_spread": max(r.half_spread for r in runs),
            }
        return {"converged": not self.warnings, "tolerance": CONVERGENCE_TOL, **pipelines}

    def to_json(self) -> dict:
        sc = self.scenario
        return {
            "scenario": sc.name,
            "model": sc.model,
            "hardware": sc.hardware,
            "mode": sc.pipeline.mode,
            "rollout_speedup": self.rollout_speedup,
            "end_to_end_speedup": self.end_to_end_speedup,
            "end_to_end_speedup_vs_sync_no_spec": self.end_to_end_speedup_vs_sync_no_spec,
            "seeds": [r.seed for r in self.runs],
            "spread": self.spread(),
            "step_time_s": {k: self.mean_step_time(k) for k in PIPELINE_KINDS},
            "overlap_floor_s": {
                k: float(np.mean([r.run(k).floor_s for r in self.runs])) for k in PIPELINE_KINDS
            },
            "phases_s": {k: self.mean_phases(k) for k in PIPELINE_KINDS},
            "rollout": {k: self.runs[0].run(k).rollout.summary() for k in PIPELINE_KINDS},
            "convergence": self.convergence(),
            "warnings": list(self.warnings),
            "inputs": sc.model_dump(),
        }


def length_seeds(sc: Scenario) -> list[int]:
    """The response-length draws to average: one when nothing is random."""
    w = sc.workload
    if w.length_trace or w.response_sigma == 0:
        return [w.seed]
    return [w.seed + i for i in range(w.seeds)]


def _run_seed(sc: Scenario, seed: int) -> SeedRun:
    sc = with_seed(sc, seed)
    mode = sc.pipeline.mode
    spec = run_pipeline(sc, sc.speculation.enabled, mode)
    base = run_pipeline(sc, False, mode) if sc.speculation.enabled else spec
    sync_base = base if mode == "sync" else run_pipeline(sc, False, "sync")
    return SeedRun(seed, spec, base, sync_base)


def convergence_warnings(sc: Scenario, runs: tuple[SeedRun, ...]) -> tuple[str, ...]:
    """Why the measured step times may not be steady state (async only; sync is exact)."""
    if sc.pipeline.mode != "async":
        return ()
    p, out = sc.pipeline, []
    if p.warmup_periods == 0:
        out.append(
            "pipeline.warmup_periods=0: the measured steps include the pipeline filling, so the"
            " step time may not be steady state"
        )
    if p.measure_periods < 2:
        out.append(
            "pipeline.measure_periods=1: convergence is not checked (it compares the halves of"
            " two or more measured periods)"
        )
    worst = max((r.run(k).half_spread, k, r.seed) for r in runs for k in PIPELINE_KINDS[:2])
    if worst[0] > CONVERGENCE_TOL:
        run = next(r for r in runs if r.seed == worst[2]).run(worst[1])
        measured = run.schedule.last_measured - run.schedule.warmup
        out.append(
            f"not converged: the {worst[1]} step time differs by {worst[0]:.1%} between the"
            f" halves of its {measured} measured steps (seed {worst[2]}); raise"
            " pipeline.warmup_periods or pipeline.measure_periods"
        )
    return tuple(out)


def with_seed(sc: Scenario, seed: int) -> Scenario:
    return sc.model_copy(update={"workload": sc.workload.model_copy(update={"seed": seed})})


def check_inputs(sc: Scenario) -> None:
    """Every check that needs the workload's lengths, before any simulation: a measured-over-
    the-rollout acceptance must be reachable on every length draw (SimInputError otherwise)."""
    check_scenario(sc)
    if sc.speculation.enabled and sc.speculation.acceptance.measured_over == "rollout":
        for seed in length_seeds(sc):
            acceptance_model(with_seed(sc, seed))


def run_scenario(sc: Scenario) -> ScenarioResult:
    """Validate the scenario (SimInputError before any work), then simulate each length draw."""
    check_inputs(sc)
    runs = tuple(_run_seed(sc, seed) for seed in length_seeds(sc))
    return ScenarioResult(sc, runs, convergence_warnings(sc, runs))
