"""This machine's RL steps, measured and predicted by the simulator, in one run.

Usage: python benchmarks/sim_rl_steps.py [--steps 5] [--fit-prompts 2,8] [--heldout-prompts 4]
       [--set section.key=value ...]

Contract: runs specrl's own GRPO loop (the default ``specrl train`` config: SmolLM2-135M, bf16
engine, the default torch threads) for ``--steps`` steps per configuration, every configuration
with the same seed and prompts: prompts per step (groups of ``rollout.group_size`` samples) from
``--fit-prompts`` and ``--heldout-prompts``, the sync pipeline and the async one (staleness 1,
weights pushed between steps), speculation off and on (the suffix drafter drafting k = 3 at
every step: a fixed k, so the simulator replays the same policy). Evaluation and checkpoints are
off. The process keeps freed memory as ``specrl train`` does (``specrl.malloc``). Configurations
run in ``--rounds`` rounds, each in a seeded random order, and each
configuration's measurement is its median round (the whole run: its steps, records and wall
time): the process keeps what it learnt of the shapes it ran (the learner's first step at a new
shape is slower), and the order spreads that over configurations. The async pipeline runs its
generator thread in the learner's process (``rollout.placement=inline``; both share the torch
threads): the default async placement puts the engine in a worker process on half the cores,
whose records this benchmark cannot read.
The engine records every forward (``record_steps``); each step's rollout is captured, and the
shapes the learner ran on it (its own micro-batching and packing) are computed.

The simulator then predicts every configuration's wall time over its steps after the first (the
first holds one-time costs: packing weights, the controller's start-up timing) from terms fitted
on the ``--fit-prompts`` configurations only:
- the engine profile (``calibrate.fit_trace``) on the sync runs' step records;
- the learner's trunk and LM-head MFUs and fixed per-step time (``machine.fit_learner``) on the
  sync runs' steps;
- the async overlap slowdowns (``machine.fit_overlap``) on the async runs' wall times;
and every step's generation by replaying its measured rollout (``machine.replay_seconds``: its
lengths, per-position acceptance and coverage), its learning from the shapes it ran. Held-out
configurations (``--heldout-prompts``, sync and async, spec off and on) use nothing of their own
timings. Prints the table and writes benchmarks/results/sim_rl_steps.json (with run metadata).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from specrl.bench import run_metadata, write_result
from specrl.config import load_config
from specrl.costmodel.specs import load_drafter, load_hardware, load_model
from specrl.malloc import keep_freed_memory
from specrl.pipelines.build import build_run
from specrl.pipelines.train import train
from specrl.rl.learner import Learner, TrainSample, micro_batches, pack_sequences
from specrl.sim.calibrate import fit_trace, parse_trace
from specrl.sim.machine import (
    LearnerShape,
    MeasuredRollout,
    MeasuredStep,
    error_summary,
    error_table,
    fit_learner,
    fit_overlap,
    predict_run,
    replay_seconds,
)
from specrl.sim.shared import Overlap

RESULTS = Path(__file__).parent / "results"
SIM_MODEL = "smollm2-135m"
BASE_HARDWARE = "cpu-2core"
DRAFTER = "suffix"
K = 3
STALENESS = 1


@dataclass(frozen=True)
class Config:
    """One measured configuration."""

    prompts: int
    mode: str  # sync | async
    spec: bool

    @property
    def label(self) -> str:
        return f"p{self.prompts}-{self.mode}-{'spec' if self.spec else 'plain'}"

    def overrides(self, steps: int) -> list[str]:
        return [
            f"run.steps={steps}",
            "run.eval_every=0",
            "run.checkpoint_every=0",
            f"rollout.prompts_per_step={self.prompts}",
            f"rollout.spec={DRAFTER if self.spec else 'none'}",
            f"rollout.num_spec_tokens={K}",
            "rollout.max_tokens_per_forward=1000000",  # k every step: a fixed policy
            f"pipeline.mode={self.mode}",
            f"pipeline.max_staleness={STALENESS}",
            "rollout.placement=inline",  # one process: the engine's records reach the trace
        ]


@dataclass
class Run:
    """One configuration's measured steps and the engine records of its rollouts."""

    config: Config
    steps: list[MeasuredStep]
    records: list[dict]
    wall_s: float  # the loop's wall time over the steps after the first
    rounds_s: list[float] = field(default_factory=list)  # every round's wall_s (median runs)

    @property
    def staleness(self) -> int:
        return STALENESS if self.config.mode == "async" else 0


def measured_rollout(out, group: int, max_seqs: int, k: int) -> MeasuredRollout:
    """A backend Rollout as the simulator replays it."""
    st = out.stats
    spec_rows = sum(r.batch_size for r in st.step_records if r.kind == "verify")
    return MeasuredRollout(
        prompt_lens=tuple(len(c.prompt_ids) for c in out.completions),
        response_lens=tuple(len(c.token_ids) for c in out.completions),
        k=k,
        accepted=tuple(st.per_position_accepted),
        drafted=tuple(st.per_position_drafted),
        spec_rows=spec_rows,
        group=group,
        max_seqs=max_seqs,
    )


def learner_shape(learner: Learner, completions) -> LearnerShape:
    """The shapes the learner's step over ``completions`` runs (its own micro-batching and
    packing: rows of max(row_len, longest sequence), GRPO groups sharing their prompt)."""
    samples = [TrainSample(c.prompt_ids, c.token_ids, 0.0) for c in completions if c.token_ids]
    positions = attended = 0
    for group in micro_batches(samples, learner.micro_batch_tokens, learner.share_prompts):
        seqs = [(samples[i].prompt_ids, samples[i].completion_ids) for i in group]
        rows, width = pack_sequences(seqs, learner.row_len, learner.share_prompts).ids.shape
        positions, attended = positions + rows * width, attended + rows * width * width
    return LearnerShape(positions, attended, sum(len(s.completion_ids) for s in samples))


def measure(cfg: Config, steps: int, sets: list[str]) -> Run:
    """Train ``steps`` steps of ``cfg``; capture every rollout and step row."""
    config = load_config(None, cfg.overrides(steps) + sets)
    parts = build_run(config)
    parts.backend.engine.record_steps = True
    captured = []
    generate = parts.backend.generate

    def recording(requests, spec=None):
        out = generate(requests, spec=spec)
        captured.append(out)
        return out

    parts.backend.generate = recording
    with tempfile.TemporaryDirectory() as tmp:
        rows = train(parts, tmp, progress=False)
    r = config.rollout
    k = K if cfg.spec else 0
    measured = [
        MeasuredStep(
            rollout=measured_rollout(out, r.group_size, r.max_batch, k),
            learner=learner_shape(parts.learner, out.completions),
            gen_s=row["gen_time_s"],
            learn_s=row["step_time_s"] - row["gen_time_s"],
            step_s=row["step_time_s"],
        )
        for out, row in zip(captured, rows, strict=True)
    ]
    records = [
        rec.to_json() | {"config": cfg.label, "step": i}
        for i, out in enumerate(captured)
        for rec in out.stats.step_records
    ]
    wall = sum(s.step_s for s in measured[1:])
    print(f"{cfg.label:>18}: {wall:7.2f} s over steps 1..{steps - 1}", flush=True)
    return Run(cfg, measured, records, wall)


def measure_rounds(configs: list[Config], args: argparse.Namespace) -> dict[Config, list[Run]]:
    """``--rounds`` passes over the configurations, each in a seeded random order (a process
    keeps what it learnt of shapes it has run: the first run of a shape is slower, and the order
    spreads that over configurations)."""
    rng = np.random.default_rng(args.seed)
    every: dict[Config, list[Run]] = {c: [] for c in configs}
    for r in range(args.rounds):
        for i in rng.permutation(len(configs)):
            print(f"round {r} ", end="")
            every[configs[i]].append(measure(configs[i], args.steps, args.set))
    return every


def median_round(runs: list[Run]) -> Run:
    """The median round by wall time; raises unless every round of a sync configuration
    generated the same lengths (an async batch's policy version depends on timing)."""
    lengths = [[s.rollout.response_lens for s in r.steps] for r in runs]
    if runs[0].config.mode == "sync" and any(x != lengths[0] for x in lengths):
        raise RuntimeError(f"{runs[0].config.label}: rounds generated different lengths")
    ordered = sorted(runs, key=lambda r: r.wall_s)
    median = ordered[len(ordered) // 2]
    median.rounds_s = [r.wall_s for r in runs]
    return median


def fit(runs: list[Run], fitted: set[str]):
    """The machine's terms from the fitted configurations (see the module docstring)."""
    model, base = load_model(SIM_MODEL), load_hardware(BASE_HARDWARE)
    sync = [r for r in runs if r.config.label in fitted and r.config.mode == "sync"]
    trace = {
        "machine": f"cpu-{os.cpu_count()}core",
        "model": SIM_MODEL,
        "hardware": BASE_HARDWARE,
        "drafter": DRAFTER,
        "records": [rec for r in sync for rec in r.records if rec["step"] > 0],
    }
    report = fit_trace(parse_trace(trace), base, 0.0, 0, "cpu-rl-steps")
    learner = fit_learner(model, report.profile, [s for r in sync for s in r.steps[1:]])
    drafter = report.drafter or load_drafter(DRAFTER)
    phases = {r.config.label: predicted_phases(r, model, report.profile, drafter, learner)
              for r in runs}  # fmt: skip
    asyncs = [r for r in runs if r.config.label in fitted and r.config.mode == "async"]
    overlap = fit_overlap([(*phases[r.config.label], r.staleness, r.wall_s) for r in asyncs])
    return report, learner, overlap, phases


def predicted_phases(run: Run, model, profile, drafter, learner) -> tuple[list, list]:
    """Predicted solo generation and learning seconds of every step of ``run``."""
    gen = [replay_seconds(s.rollout, model, profile, drafter) for s in run.steps]
    learn = [learner.seconds(model, profile, s.learner) for s in run.steps]
    return gen, learn


def result_row(run: Run, phases: tuple[list, list], overlap: Overlap, fitted: bool) -> dict:
    gen, learn = phases
    predicted = predict_run(gen, learn, run.staleness, overlap)
    steps = run.steps[1:]
    return {
        "config": run.config.label,
        "prompts": run.config.prompts,
        "mode": run.config.mode,
        "spec": run.config.spec,
        "fitted": fitted,
        "measured_s": run.wall_s,
        "predicted_s": predicted,
        "error": predicted / run.wall_s - 1.0,
        "measured_gen_s": sum(s.gen_s for s in steps),
        "predicted_solo_gen_s": sum(gen[1:]),
        "measured_learn_s": sum(s.learn_s for s in steps),
        "predicted_solo_learn_s": sum(learn[1:]),
        "acceptance_length": float(np.mean([s.rollout.acceptance_length for s in steps])),
        "mean_response_len": float(np.mean([np.mean(s.rollout.response_lens) for s in steps])),
        "rounds_s": run.rounds_s,
        "steps": [
            {
                "step_s": s.step_s,
                "gen_s": s.gen_s,
                "learn_s": s.learn_s,
                "predicted_solo_gen_s": g,
                "predicted_solo_learn_s": lrn,
            }
            | asdict(s.learner)
            for s, g, lrn in zip(run.steps, gen, learn, strict=True)
        ],  # fmt: skip
    }


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="odd: the median round is measured")
    ap.add_argument("--seed", type=int, default=0, help="seed of the run order")
    ap.add_argument("--fit-prompts", default="2,8")
    ap.add_argument("--heldout-prompts", default="4")
    ap.add_argument("--set", action="append", default=[], help="config override for every run")
    ap.add_argument("--out", type=Path, default=RESULTS / "sim_rl_steps.json")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    keep_freed_memory()  # as ``specrl train`` runs its learner (specrl.malloc)
    fit_p = [int(p) for p in args.fit_prompts.split(",")]
    held_p = [int(p) for p in args.heldout_prompts.split(",")]
    configs = [
        Config(p, mode, spec)
        for p in sorted(set(fit_p + held_p))
        for mode in ("sync", "async")
        for spec in (False, True)
    ]
    load_before, t0 = os.getloadavg(), time.perf_counter()
    every = measure_rounds(configs, args)
    runs = [median_round(every[c]) for c in configs]
    fitted = {c.label for c in configs if c.prompts in fit_p}
    report, learner, overlap, phases = fit(runs, fitted)
    rows = [result_row(r, phases[r.config.label], overlap, r.config.label in fitted) for r in runs]
    print(error_table(rows, 18))
    summary = error_summary(rows)
    print(summary)
    print(f"learner: {learner}; overlap {overlap}")
    result = {
        "meta": run_metadata()
        | {"args": {k: str(v) for k, v in vars(args).items()}}
        | {"loadavg_before": load_before, "loadavg_after": os.getloadavg()}
        | {"seconds": time.perf_counter() - t0},
        "fit": {
            "engine": report.to_json(),
            "learner": {k: v if np.isfinite(v) else None for k, v in asdict(learner).items()},
            "overlap": {"generation": overlap.generation, "learning": overlap.learning},
        },
        "configs": rows,
        "summary": summary,
    }
    write_result(result, args.out)


if __name__ == "__main__":
    main()
