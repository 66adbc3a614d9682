"""Run a Scenario: rollouts with and without speculation, RL phases, schedules, speedups.

Contract: ``run_scenario(sc)`` simulates three pipelines on the same sampled lengths:
``speculative`` (the scenario as given), ``no_spec`` (same pipeline, speculation off) and
``sync_no_spec`` (colocated synchronous, speculation off, on all the scenario's GPUs: the baseline
of the combined "speculation + async" claim). ``rollout_speedup`` and ``end_to_end_speedup`` compare
``speculative`` with ``no_spec``; ``end_to_end_speedup_vs_sync_no_spec`` compares it with the third.
Training costs 6 * N_active * tokens FLOPs (logprobs 2 * N_active * tokens per pass) over
GPUs * peak * MFU; a refit costs a fixed time plus weight bytes over the refit bandwidth; online
drafter training costs 6 * N_drafter * tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrl.sim.acceptance import AcceptanceModel, AcceptanceParams, alpha_for_length
from specrl.sim.continuous import simulate_continuous
from specrl.sim.cost import StepCostModel
from specrl.sim.pipeline import PIPELINES, Schedule, StepPhases
from specrl.sim.rollout import (
    EngineConfig,
    RolloutResult,
    sample_lengths,
    sample_lengths_capped_mean,
    simulate_rollout,
)
from specrl.sim.scenario import Acceptance, Scenario
from specrl.sim.specs import load_drafter, load_hardware, load_model


def acceptance_model(cfg: Acceptance) -> AcceptanceModel:
    params = AcceptanceParams(
        alpha=alpha_for_length(cfg.acceptance_length, cfg.at_k),
        per_position=tuple(cfg.per_position),
        decay_per_1k_tokens=cfg.decay_per_1k_tokens,
        decay_per_rl_step=cfg.decay_per_rl_step,
        floor=cfg.floor,
    )
    return AcceptanceModel(cfg.kind, params)


def step_costs(sc: Scenario, spec: bool) -> StepCostModel:
    return StepCostModel(
        target=load_model(sc.model),
        hw=load_hardware(sc.hardware),
        gpus=sc.generation.gpus_per_replica,
        drafter=load_drafter(sc.speculation.drafter) if spec else None,
        tree_width=sc.speculation.tree_width,
        tree_verify_tokens=sc.speculation.tree_verify_tokens,
        routing_locality=sc.generation.routing_locality,
        prefill_group=sc.generation.prefill_group,
        draft_coverage=tuple(sc.speculation.draft_coverage),
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
        acceptance=acceptance_model(s.acceptance),
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
    """Seconds of each RL phase for one step given the simulated generation time."""
    model, hw = load_model(sc.model), load_hardware(sc.hardware)
    _, responses = workload_lengths(sc)
    tokens = float(sc.workload.samples_per_step * sc.workload.prompt_len + responses.sum())
    rate = train_gpus * hw.peak_flops * (sc.training.mfu or hw.train_mfu(model))
    costs = step_costs(sc, spec)
    draft = costs.draft_model if spec else None
    drafter_flops = 6.0 * draft.params_active * tokens if draft and sc.training.train_drafter else 0
    weight_bytes = model.weight_bytes + (draft.weight_bytes if draft else 0.0)
    return StepPhases(
        generation=generation_s,
        logprobs=2.0 * model.params_active * tokens * sc.training.logprob_passes / rate,
        train=6.0 * model.params_active * tokens / rate,
        drafter_train=drafter_flops / rate,
        refit=sc.pipeline.refit_fixed_s + weight_bytes / sc.pipeline.refit_bandwidth,
        overhead=sc.pipeline.framework_overhead_s,
    )


@dataclass(frozen=True)
class PipelineRun:
    rollout: RolloutResult
    phases: StepPhases
    schedule: Schedule

    def summary(self) -> dict:
        return {
            "step_time_s": self.schedule.step_time,
            "phases_s": self.phases.as_dict(),
            "rollout": self.rollout.summary(),
        }


def run_pipeline(sc: Scenario, spec: bool, mode: str) -> PipelineRun:
    """One pipeline: sync trains on all generation GPUs; async on separate training GPUs."""
    if mode == "sync":
        gpus = sc.generation.gpus + (sc.training.gpus if sc.pipeline.mode == "async" else 0)
        train_gpus = gpus
    else:
        gpus, train_gpus = sc.generation.gpus, sc.training.gpus
        if train_gpus <= 0:
            raise ValueError("async pipelines need training.gpus > 0")
    rollout = simulate_generation(sc, spec, gpus)
    phases = rl_phases(sc, rollout.time_s, spec, train_gpus)
    p = sc.pipeline
    if mode == "async" and p.async_generation == "continuous":
        prompts, responses = workload_lengths(sc)
        cont = simulate_continuous(
            prompts,
            responses,
            engine_config(sc, spec),
            replica_count(sc, gpus),
            phases,
            p.steps,
            p.staleness,
        )
        return PipelineRun(rollout, phases, cont.schedule)
    if p.async_generation not in ("continuous", "drain"):
        raise KeyError(f"unknown async_generation {p.async_generation!r}: continuous | drain")
    schedule = PIPELINES[mode](phases, p.steps, p.staleness)
    return PipelineRun(rollout, phases, schedule)


@dataclass(frozen=True)
class ScenarioResult:
    scenario: Scenario
    speculative: PipelineRun
    no_spec: PipelineRun
    sync_no_spec: PipelineRun

    @property
    def rollout_speedup(self) -> float:
        return self.no_spec.rollout.time_s / self.speculative.rollout.time_s

    @property
    def end_to_end_speedup(self) -> float:
        return self.no_spec.schedule.step_time / self.speculative.schedule.step_time

    @property
    def end_to_end_speedup_vs_sync_no_spec(self) -> float:
        return self.sync_no_spec.schedule.step_time / self.speculative.schedule.step_time

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
            "step_time_s": {k: r.schedule.step_time for k, r in self._runs().items()},
            "phases_s": {k: r.phases.as_dict() for k, r in self._runs().items()},
            "rollout": {k: r.rollout.summary() for k, r in self._runs().items()},
            "inputs": sc.model_dump(),
        }

    def _runs(self) -> dict[str, PipelineRun]:
        return {
            "speculative": self.speculative,
            "no_spec": self.no_spec,
            "sync_no_spec": self.sync_no_spec,
        }


def run_scenario(sc: Scenario) -> ScenarioResult:
    mode = sc.pipeline.mode
    if mode not in PIPELINES:
        raise KeyError(f"unknown pipeline mode {mode!r}; known: {sorted(PIPELINES)}")
    spec = run_pipeline(sc, sc.speculation.enabled, mode)
    base = run_pipeline(sc, False, mode)
    sync_base = base if mode == "sync" else run_pipeline(sc, False, "sync")
    return ScenarioResult(sc, spec, base, sync_base)
