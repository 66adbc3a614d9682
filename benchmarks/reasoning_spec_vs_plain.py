"""Speculation inside real RL steps on the reasoning preset: rollout and step speedup, interleaved.

Usage: python benchmarks/reasoning_spec_vs_plain.py [--steps 8] [--warmup 1] [--ceiling]
    [--ceiling-accept 1.0,0.8,...] [--set k=v ...]

One synchronous GRPO run of ``specrl train --preset reasoning`` (SmolLM2-135M, bf16 engine, the
configured drafter: suffix by default, with the cost-model controller and sample-exact
verification). Every step rolls its prompts out twice on the same weights with the same request
seeds: once plain (timing only) and once with speculation (the step's real rollout, which the
learner trains on), the order alternating from step to step so drift on the machine cancels.
With sample-exact verification both rollouts emit the same tokens (checked: ``same_tokens``),
so the plain step is the same RL step without speculation. Per step: generation seconds plain
and speculative, learner seconds, the share of a plain sync step spent generating, response
length percentiles (p10/p50/p90/max), the share of plain rollout time spent with <= 4 live rows
(from the engine's step records), acceptance, the controller's share of speculative steps, and
reward. Summary over the steps after ``--warmup``: rollout speedup (sum plain / sum spec
generation time), step speedup ((plain gen + learn) / (spec gen + learn)), the free-drafter
ceiling (speculative time less drafting time). With ``--ceiling`` each step's prompts are rolled
out a third time by an engine over the same weights whose drafter is an oracle: it drafts the
very tokens of the plain rollout (looked up by sample seed: under sample-exact verification
every draft is accepted while the row's tokens equal the plain rollout's, ``oracle_same``; a row
that left them would draft nothing from there) at the cost of a lookup, under the cost-model
controller (k up to ``--ceiling-k``): the ceiling of speculation on this machine and workload
(a perfect, free drafter and the controller's choice of k), reported as rollout and step
speedups. ``--ceiling-accept`` lists per-token acceptances a: for a < 1 the oracle keeps each
drafted token with probability a (drawn per sample seed and position, so reruns agree) and
replaces the first one it does not keep by another token, which verification rejects (the
tokens after it stay: a draft's length says nothing of where it goes wrong, as with a real
drafter); so its drafts are accepted position by position with probability a, at no drafting
cost: the ceiling of a free drafter of that acceptance (acceptance length 1 + a + ... + a^k at
k drafts), one rollout per a, summarised per a under ``ceilings``.
Writes benchmarks/results/reasoning_spec_vs_plain.json.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from specrl.backends.native import NativeBackend
from specrl.bench import run_metadata, write_result
from specrl.config import load_config
from specrl.engine import Engine
from specrl.pipelines.build import build_run
from specrl.pipelines.state import StepState, TrainStream
from specrl.pipelines.step import collect, learn, rollout
from specrl.spec.config import SpecConfig
from specrl.spec.proposers import Draft, Proposer, register_proposer

OUT = Path(__file__).parent / "results" / "reasoning_spec_vs_plain.json"
FEW_ROWS = 4


@register_proposer("oracle")
class OracleProposer(Proposer):
    """Drafts the tokens plain sampling will draw: ``book`` maps a sample seed to the plain
    rollout's prompt + completion; a row whose history has left it drafts nothing, or with
    ``off_book`` k copies of token 0 (rejected unless sampling draws it: the row's steps keep
    the shape of drafted ones). With ``accept`` < 1 each drafted token is kept with that
    probability (one uniform per sample seed and position, drawn once) and the first one not
    kept is replaced by a neighbouring token id, which verification rejects; the draft keeps
    its length."""

    deterministic = True

    def __init__(
        self, book: dict[int, list[int]] | None = None, accept: float = 1.0, off_book: bool = False
    ) -> None:
        self.book = {} if book is None else book
        self.accept = accept
        self.off_book = off_book
        self.uniforms = {s: np.random.default_rng(s).random(len(f)) for s, f in self.book.items()}

    def propose(self, batch, k: int) -> Draft:
        rows = []
        for seed, history in zip(batch.seeds.tolist(), batch.histories, strict=True):
            full = self.book.get(seed, [])
            n = len(history)
            if full[:n] == history:
                rows.append(self._spoil(full[n : n + k], seed, n))
            else:
                rows.append([0] * k if self.off_book else [])
        return Draft.from_lists(rows, k)

    def _spoil(self, draft: list[int], seed: int, position: int) -> list[int]:
        """``draft`` with its first token not kept replaced by a wrong id."""
        if self.accept >= 1.0 or not draft:
            return draft
        kept = self.uniforms[seed][position : position + len(draft)] < self.accept
        if kept.all():
            return draft
        j = int(np.argmin(kept))  # the first position not kept
        wrong = draft[j] - 1 if draft[j] > 0 else draft[j] + 1
        return [*draft[:j], wrong, *draft[j + 1 :]]


def oracle_rollout(
    parts, engine: Engine, prompts: list, step: int, plain: list, k: int, accept: float = 1.0
) -> tuple[float, float, bool]:
    """Seconds, acceptance length and same-tokens check of the step's prompts rolled out by
    ``engine`` (over the run's shared, current weights) drafting with ``OracleProposer`` at
    per-token acceptance ``accept``."""
    book = {c.seed: list(c.prompt_ids) + list(c.token_ids) for c in plain}
    options = {"book": book, "accept": accept}
    spec = SpecConfig("oracle", k, options=options, exact="sample", adaptive=True)
    engine.spec, engine.proposer = spec, engine.make_proposer(spec)
    oracle = replace(parts, backend=NativeBackend(engine))
    t0 = time.perf_counter()
    out = rollout(oracle, prompts, step)
    seconds = time.perf_counter() - t0
    same = [c.token_ids for c in out.completions] == [c.token_ids for c in plain]
    return seconds, out.stats.acceptance_length, same


def few_rows_share(records) -> float:
    """Share of decode time spent in steps with <= FEW_ROWS live rows."""
    steps = [r for r in records if r.kind in ("decode", "verify", "draft")]
    total = sum(r.step_time_s for r in steps)
    few = sum(r.step_time_s for r in steps if r.batch_size <= FEW_ROWS)
    return few / total if total else 0.0


def plain_rollout(parts, prompts: list, step: int) -> tuple[float, list, float]:
    """Seconds, completions and the <= 4 rows share of the step's prompts rolled out plain."""
    engine = parts.backend.engine
    engine.record_steps = True
    t0 = time.perf_counter()
    out = rollout(parts, prompts, step, spec=SpecConfig("none", 0))
    seconds = time.perf_counter() - t0
    engine.record_steps = False
    return seconds, out.completions, few_rows_share(out.stats.step_records)


def one_step(
    parts, stream: TrainStream, step: int, oracles: dict[float, Engine], ceiling_k: int
) -> dict:
    """Both rollouts of ``step`` (order alternating), one per ``oracles`` engine (keyed by
    per-token acceptance), then the learner on the speculative one."""
    prompts = stream.draw(step)  # outside every timed window
    if step % 2 == 0:
        plain_s, plain, few = plain_rollout(parts, prompts, step)
    t0 = time.perf_counter()
    batch = collect(parts, prompts, step)
    spec_s = time.perf_counter() - t0
    if step % 2 == 1:
        plain_s, plain, few = plain_rollout(parts, prompts, step)
    ceilings = {
        a: oracle_rollout(parts, e, prompts, step, plain, ceiling_k, a) for a, e in oracles.items()
    }
    t1 = time.perf_counter()
    learned = learn(parts, StepState(step, step), batch, spec_s)  # a fresh run: version = step
    learn_s = time.perf_counter() - t1
    m = batch.metrics
    lengths = [len(c.token_ids) for c in batch.completions]
    return {
        "step": step,
        "plain_gen_s": plain_s,
        "spec_gen_s": spec_s,
        "learn_s": learn_s,
        "spec_draft_s": m["draft_s"],
        "gen_share_of_plain_step": plain_s / (plain_s + learn_s),
        "same_tokens": [c.token_ids for c in plain] == [c.token_ids for c in batch.completions],
        "tokens": sum(lengths),
        "length_p10_p50_p90_max": [float(x) for x in np.percentile(lengths, [10, 50, 90, 100])],
        "plain_time_share_at_most_4_rows": few,
        "acceptance_length": m["acceptance_length"],
        "spec_step_share": m["spec_step_share"],
        "reward_mean": m["reward_mean"],
        "accuracy": m["accuracy"],
        "loss": learned.get("learner_loss"),
        "oracle": {
            str(a): {"gen_s": s, "acceptance_length": acc, "same": same}
            for a, (s, acc, same) in ceilings.items()
        },
    }


def summarize(rows: list[dict]) -> dict:
    plain = sum(r["plain_gen_s"] for r in rows)
    spec = sum(r["spec_gen_s"] for r in rows)
    learn_s = sum(r["learn_s"] for r in rows)
    undrafted = spec - sum(r["spec_draft_s"] for r in rows)
    ceilings = {}
    for a in rows[0]["oracle"]:
        runs = [r["oracle"][a] for r in rows]
        oracle = sum(x["gen_s"] for x in runs)
        ceilings[a] = {
            "rollout_speedup": plain / oracle,
            "step_speedup": (plain + learn_s) / (oracle + learn_s),
            "acceptance_length_mean": float(np.mean([x["acceptance_length"] for x in runs])),
            "same_tokens": all(x["same"] for x in runs),
        }
    return {"ceilings": ceilings} | {
        "steps": len(rows),
        "rollout_speedup": plain / spec,
        "step_speedup": (plain + learn_s) / (spec + learn_s),
        "free_drafter_rollout_speedup": plain / undrafted,
        "free_drafter_step_speedup": (plain + learn_s) / (undrafted + learn_s),
        "gen_share_of_plain_step": plain / (plain + learn_s),
        "plain_time_share_at_most_4_rows": float(
            np.mean([r["plain_time_share_at_most_4_rows"] for r in rows])
        ),
        "all_same_tokens": all(r["same_tokens"] for r in rows),
        "acceptance_length_mean": float(np.mean([r["acceptance_length"] for r in rows])),
    }


def ceiling_accepts(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[float]:
    """``--ceiling-accept`` as numbers, refused (naming the value) when malformed, outside
    (0, 1] or given without ``--ceiling``."""
    if args.ceiling_accept is None:
        return [1.0]
    if not args.ceiling:
        ap.error("--ceiling-accept needs --ceiling")
    try:
        accepts = [float(x) for x in args.ceiling_accept.split(",")]
    except ValueError:
        ap.error(f"--ceiling-accept: not a list of numbers: {args.ceiling_accept!r}")
    bad = [a for a in accepts if not 0 < a <= 1]
    if bad:
        ap.error(f"--ceiling-accept: {bad[0]} is outside (0, 1]")
    return accepts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of the summary")
    ap.add_argument("--preset", default="reasoning")
    ap.add_argument("--set", action="append", default=[], help="config override key=value")
    ap.add_argument("--ceiling", action="store_true", help="add the oracle-drafter rollout")
    ap.add_argument("--ceiling-k", type=int, default=8, help="the oracle's largest k")
    ap.add_argument(
        "--ceiling-accept",
        default=None,
        help="comma-separated per-token acceptances in (0, 1] of the oracle drafter, one "
        "rollout each (with --ceiling; default 1.0)",
    )
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    accepts = ceiling_accepts(ap, args)
    sets = [*args.set, f"run.steps={args.steps}", "run.eval_every=0", "run.checkpoint_every=0"]
    cfg = load_config(None, sets, preset=args.preset)
    torch.manual_seed(cfg.run.seed)
    with tempfile.TemporaryDirectory() as d:
        cfg.run.run_dir = d
        parts = build_run(cfg)
        oracles = {}
        if args.ceiling:  # over the run's engine model, shared: it follows every weight update
            model = parts.backend.engine.model
            for a in accepts:
                oracles[a] = Engine(model, max_batch=cfg.rollout.max_batch, seed=cfg.run.seed)
        rows, stream = [], TrainStream.of(parts.plan, parts.env)
        for step in range(args.steps):
            row = one_step(parts, stream, step, oracles, args.ceiling_k)
            rows.append(row)
            print(
                f"step {step}: gen plain {row['plain_gen_s']:.1f}s spec {row['spec_gen_s']:.1f}s "
                f"learn {row['learn_s']:.1f}s | accept {row['acceptance_length']:.2f} "
                f"spec steps {row['spec_step_share']:.0%} | lengths "
                f"{row['length_p10_p50_p90_max']} | <=4 rows "
                f"{row['plain_time_share_at_most_4_rows']:.0%}"
                f" | reward {row['reward_mean']:.3f} | same tokens {row['same_tokens']}"
                + "".join(f" | oracle {a}: {o['gen_s']:.1f}s acc {o['acceptance_length']:.2f}"
                          for a, o in row["oracle"].items()),
                flush=True,
            )  # fmt: skip
    summary = summarize(rows[args.warmup :] or rows)
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()})
    meta = run_metadata() | {"args": vars(args) | {"out": str(args.out)}, "config": cfg.to_toml()}
    write_result({"meta": meta, "summary": summary, "steps": rows}, args.out)


if __name__ == "__main__":
    main()
