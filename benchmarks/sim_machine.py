"""Measure this machine's rollouts and predict them with the simulator, in one run.

Usage: OMP_NUM_THREADS=1 python benchmarks/sim_machine.py [--rounds 3] [--new-tokens 64]
       [--fit-batches 1,4,16,64] [--heldout-batches 2,8,32] [--drafter ngram] [--k 3]

Contract: on the bundled SmolLM2-135M (bf16, one torch thread) the specrl engine generates GRPO-like
rollouts (groups of ``--group-size`` samples per chat prompt, temperature 1, stop tokens honoured,
at most ``--new-tokens`` new tokens) at every batch size, speculation off and on (a model-free
drafter with k drafts), with ``record_steps`` on; each rollout's wall time is measured.
Configurations run in ``--rounds`` rounds, each in a fresh seeded random order, with the same
seeds in every round, so a configuration repeats exactly the same work (same tokens, checked) and
machine-load drift (this box is shared) hits fitted and held-out runs alike. A configuration's
measured time is its median round (robust to a load spike or lull in one round; use an odd
``--rounds``); every round's wall and CPU time is kept in the JSON, their ratio shows how much of
a core the run got. Then ``specrl.sim.calibrate`` fits a hardware profile (and the
drafter's CPU cost) on the step records of the median rounds of the ``--fit-batches`` runs only,
and the simulator's event-driven rollout model predicts the whole wall time of every run from
that profile and what the run itself measured: its response lengths (a replayed trace; the first
token comes from the prefill, so the simulator decodes length - 1), prompt lengths, per-position
acceptance and per-position draft coverage. The same fit and prediction are repeated on the CPU
clock (each run's records scaled by its CPU/wall ratio, its CPU time as its time): a check that
separates the model's error from the load of other jobs. Prints both tables (predicted vs
measured per configuration) and writes benchmarks/results/sim_machine.json (with run metadata)
and the wall-clock trace that ``specrl simulate calibrate`` reads
(benchmarks/results/sim_machine_trace.json: the median rounds, every record labelled with its
configuration).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from specrl.bench import bench_prompts, group_for, run_metadata, write_result
from specrl.costmodel.specs import load_drafter, load_hardware, load_model
from specrl.sim.calibrate import FitReport, fit_trace, parse_trace
from specrl.sim.machine import MeasuredRollout, error_summary, error_table, replay_seconds

RESULTS = Path(__file__).parent / "results"
MODEL = "smollm2-135m-instruct"  # checkpoint name; its simulator spec is SIM_MODEL
SIM_MODEL = "smollm2-135m"
BASE_HARDWARE = "cpu-2core"


@dataclass(frozen=True)
class Config:
    """One measured configuration: batch size (sequences in the rollout) and speculation."""

    batch: int
    spec: bool

    @property
    def label(self) -> str:
        return f"b{self.batch}-{'spec' if self.spec else 'plain'}"


@dataclass
class Run:
    """One measured rollout: wall time, step records and what the simulator replays."""

    config: Config
    round: int
    wall_s: float
    cpu_s: float  # this thread's CPU seconds: wall_s / cpu_s > 1 when other jobs took the core
    records: list[dict]
    prompt_lens: list[int]
    response_lens: list[int]
    accepted: list[int]  # per draft position: rows whose draft there was accepted
    drafted: list[int]  # per draft position: rows that drafted there
    group: int

    @property
    def spec_rows(self) -> int:
        """(row, speculative step) pairs: the denominator of acceptance and coverage."""
        return sum(r["batch_size"] for r in self.records if r["kind"] == "verify")

    def rollout(self, k: int) -> MeasuredRollout:
        """What the simulator replays of this run (k draft tokens per verify when speculative)."""
        return MeasuredRollout(
            prompt_lens=tuple(self.prompt_lens),
            response_lens=tuple(self.response_lens),
            k=k if self.config.spec else 0,
            accepted=tuple(self.accepted),
            drafted=tuple(self.drafted),
            spec_rows=self.spec_rows,
            group=self.group,
            max_seqs=self.config.batch,
        )


def make_runner(model, tok, cfg: Config, args: argparse.Namespace):
    """A closure running one rollout of ``cfg`` with seeds from ``seed``; returns a Run."""
    from specrl.engine import Engine
    from specrl.rollout_types import Request
    from specrl.sampling import SamplingParams
    from specrl.spec.config import SpecConfig

    group = group_for(cfg.batch, args.group_size)
    prompts = bench_prompts(tok, cfg.batch, group)
    spec = SpecConfig(args.drafter, args.k) if cfg.spec else SpecConfig()
    engine = Engine(model, max_batch=cfg.batch, spec=spec, record_steps=True)
    params = SamplingParams(
        temperature=1.0, max_new_tokens=args.new_tokens, n=group, stop_token_ids=tok.stop_token_ids
    )

    def run(seed: int, round_: int) -> Run:
        requests = [Request(p, params.replace(seed=seed + i)) for i, p in enumerate(prompts)]
        t0, c0 = time.perf_counter(), time.thread_time()
        out = engine.generate(requests)
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        st = engine.stats
        return Run(
            config=cfg,
            round=round_,
            wall_s=wall,
            cpu_s=cpu,
            records=[r.to_json() for r in st.step_records],
            prompt_lens=[len(c.prompt_ids) for c in out],
            response_lens=[len(c.token_ids) for c in out],
            accepted=list(st.per_position_accepted),
            drafted=list(st.per_position_drafted),
            group=group,
        )

    return run


def measure(runners: dict, rounds: int, warmup: bool, seed: int) -> list[Run]:
    """Optional warm-up pass (untimed), then ``rounds`` passes over all configs, each pass in a
    seeded random order; every pass uses the same sampling seeds (identical work)."""
    rng = np.random.default_rng(seed)
    configs = list(runners)
    if warmup:
        for cfg in configs:
            runners[cfg](seed=10_000, round_=-1)
    runs = []
    for r in range(rounds):
        for i in rng.permutation(len(configs)):
            run = runners[configs[i]](seed=1000, round_=r)
            runs.append(run)
            print(
                f"round {r} {run.config.label:>9}: {run.wall_s:6.2f} s wall {run.cpu_s:6.2f} s CPU",
                flush=True,
            )
    return runs


def median_rounds(runs: list[Run]) -> dict[Config, Run]:
    """Each configuration's median round by wall time (the upper median for an even count);
    raises if its rounds did not repeat the same work."""
    by_config: dict[Config, list[Run]] = {}
    for run in runs:
        by_config.setdefault(run.config, []).append(run)
    for cfg, mine in by_config.items():
        if any(r.response_lens != mine[0].response_lens for r in mine):
            raise RuntimeError(f"{cfg.label}: rounds generated different lengths")
    return {
        cfg: sorted(mine, key=lambda r: r.wall_s)[len(mine) // 2] for cfg, mine in by_config.items()
    }


def trace_json(runs: list[Run], drafter: str) -> dict:
    """Runs' step records in the calibration trace format, labelled by configuration."""
    records = [
        {**rec, "config": run.config.label, "step_time_s": round(rec["step_time_s"], 7)}
        for run in runs
        for rec in run.records
    ]
    return {
        "machine": f"cpu-{os.cpu_count()}core, 1 torch thread",
        "model": SIM_MODEL,
        "dtype": "bf16",
        "hardware": BASE_HARDWARE,
        "drafter": drafter,
        "records": records,
    }


def predict(run: Run, report: FitReport, drafter: str, k: int) -> float:
    """Simulated wall time of one measured rollout with the fitted profile and its own replay."""
    spec = run.config.spec
    draft = (report.drafter or load_drafter(drafter)) if spec else None
    return replay_seconds(run.rollout(k), load_model(SIM_MODEL), report.profile, draft)


def row(run: Run, predicted: float, rounds: list[Run], fitted: bool, k: int) -> dict:
    """One configuration's line of the result: median round measured vs predicted."""
    cfg = run.config
    spec_rows, replay = run.spec_rows, run.rollout(k)
    return {
        "config": cfg.label,
        "batch_size": cfg.batch,
        "spec": cfg.spec,
        "fitted": fitted,
        "measured_s": run.wall_s,
        "predicted_s": predicted,
        "error": predicted / run.wall_s - 1.0,
        "measured_rounds_s": [r.wall_s for r in rounds],
        "cpu_rounds_s": [r.cpu_s for r in rounds],
        "steps": sum(r["kind"] in ("decode", "verify") for r in run.records),
        "mean_response_len": float(np.mean(run.response_lens)),
        "acceptance_length": replay.acceptance_length,
        "acceptance_per_position": list(replay.acceptance()) if spec_rows else [],
        "draft_coverage": list(replay.coverage()) if spec_rows else [],
    }


def evaluate(
    runs: list[Run], configs: list[Config], held: tuple[str, ...], args: argparse.Namespace
) -> tuple[dict, dict]:
    """Fit on the median rounds of the fitted configs; predict every config's median round.
    Returns the trace and a JSON-ready {fit, configs, summary}."""
    median = median_rounds(runs)
    trace = trace_json([median[c] for c in configs], args.drafter)
    report = fit_trace(parse_trace(trace), load_hardware(BASE_HARDWARE), 0.0, 0, "", held)
    rows = [
        row(
            median[c],
            predict(median[c], report, args.drafter, args.k),
            [r for r in runs if r.config == c],
            c.label not in held,
            args.k,
        )
        for c in configs
    ]
    return trace, {"fit": report.to_json(), "configs": rows, "summary": error_summary(rows)}


def on_cpu_clock(run: Run) -> Run:
    """The run with its records scaled by its CPU/wall ratio and its CPU time as its time: what
    it would have measured with the core to itself (contention assumed even within a run)."""
    scale = run.cpu_s / run.wall_s
    records = [r | {"step_time_s": r["step_time_s"] * scale} for r in run.records]
    return replace(run, wall_s=run.cpu_s, records=records)


def print_table(rows: list[dict], fit: dict) -> None:
    p = fit["profile"]
    print(
        f"fit on {fit['n_fit']} records: step_overhead_s={p['step_overhead_s']:.4g} "
        f"eta_mem={p['eta_mem']:.3g} eta_compute={p['eta_compute']:.3g} "
        f"verify_s_per_logit={p['verify_s_per_logit']:.3g}, record MAPE "
        f"{fit['fit_mape']:.1%} (held-out records {fit['heldout_mape']:.1%})"
    )
    print(error_table(rows, 10))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit-batches", default="1,4,16,64")
    ap.add_argument("--heldout-batches", default="2,8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", action="store_true", help="one untimed pass first")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--drafter", default="ngram", help="model-free drafter: ngram | suffix")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="seed of the run order")
    ap.add_argument("--out", type=Path, default=RESULTS / "sim_machine.json")
    ap.add_argument("--trace-out", type=Path, default=RESULTS / "sim_machine_trace.json")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # the box is shared; one thread is this benchmark's machine
    from specrl.models.checkpoints import load_model as load_checkpoint
    from specrl.models.checkpoints import load_tokenizer

    tok = load_tokenizer(MODEL)
    model = load_checkpoint(MODEL, dtype=torch.bfloat16)
    fit_b = {int(b) for b in args.fit_batches.split(",")}
    held_b = {int(b) for b in args.heldout_batches.split(",")}
    configs = [Config(b, s) for b in sorted(fit_b | held_b) for s in (False, True)]
    runners = {c: make_runner(model, tok, c, args) for c in configs}
    load_before = os.getloadavg()
    runs = measure(runners, args.rounds, args.warmup, args.seed)
    held = tuple(c.label for c in configs if c.batch not in fit_b)
    wall_trace, wall = evaluate(runs, configs, held, args)
    _, cpu = evaluate([on_cpu_clock(r) for r in runs], configs, held, args)
    for name, res in (("wall time", wall), ("CPU time (load-insensitive check)", cpu)):
        print(f"--- {name}")
        print_table(res["configs"], res["fit"])
        print(json.dumps(res["summary"]))
    result = {
        "meta": run_metadata()
        | {"args": {k: str(v) for k, v in vars(args).items()}}
        | {"loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "heldout_configs": list(held),
        "wall": wall,
        "cpu": cpu,
    }
    write_result(result, args.out)
    args.trace_out.parent.mkdir(parents=True, exist_ok=True)
    args.trace_out.write_text(json.dumps(wall_trace, separators=(",", ":")))
    print(f"wrote {args.trace_out}")


if __name__ == "__main__":
    main()
