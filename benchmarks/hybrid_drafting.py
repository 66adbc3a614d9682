"""Hybrid drafting (suffix where earlier rollouts predict a row, the EAGLE-3 head elsewhere)
against each drafter alone and no speculation, on GRPO groups, side by side.

Usage: python benchmarks/hybrid_drafting.py --head DIR [--prompts 1,4] [--group-size 8]
       [--new-tokens 64] [--k 3] [--repeats 3] [--out benchmarks/results/hybrid_drafting.json]

SmolLM2-135M in bf16, T=1, the RL default task's held-out prompts (basic_arithmetic, eval
split, chat-rendered as ``specrl train-drafter`` renders them), each prompt sampled
``--group-size`` times in one call (a GRPO group: siblings generated together), stopping at
end-of-turn (at most ``--new-tokens``). ``--head`` is an EAGLE-3 head (``specrl train-drafter
--drafter eagle3``). Contenders: plain decoding; suffix, eagle3 and hybrid at a fixed k (every
step drafts k: acceptance comparable across drafters); and each of them under the cost-model
controller (``max_tokens_per_forward='auto'``: where speculation pays). Each contender has its
own engine, warmed by one untimed epoch of the same prompts with other seeds: the suffix index
(suffix, hybrid) then holds an earlier step's rollouts of the same prompts, as in RL where
prompts come back. Timed runs alternate between contenders with the same seeds; the best of
``--repeats`` counts. Every drafter verifies with rejection sampling (the suffix drafter's
drafts with a one-hot q), so the contenders' tokens differ (same distribution); tokens/s counts
each contender's own.
Per point: tokens/s and its ratio to plain decoding, acceptance length (accepted drafts + 1
per verify step), the share of hybrid's drafting rows that took the suffix draft. The
machine's copy bandwidth and GEMM rate are measured in the same run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from specrl.bench import measure_machine, run_metadata, write_result
from specrl.drafters.data import task_prompt_ids
from specrl.engine import Engine
from specrl.models.checkpoints import load_model, load_tokenizer
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams
from specrl.spec.config import SpecConfig

OUT = Path(__file__).parent / "results" / "hybrid_drafting.json"
MODEL = "smollm2-135m-instruct"
DRAFTERS = ("suffix", "eagle3", "hybrid")


def contenders(head: str, k: int) -> dict[str, SpecConfig]:
    """name -> SpecConfig: plain, each drafter at fixed k and under the controller."""
    out = {"none": SpecConfig("none", 0)}
    for adaptive in (False, True):
        for method in DRAFTERS:
            options = {} if method == "suffix" else {"drafter_path": head}
            name = f"{method} {'auto' if adaptive else f'k={k}'}"
            out[name] = SpecConfig(method, k, options=options, adaptive=adaptive)
    return out


def requests(prompts: list[list[int]], group: int, new: int, stops, seed: int) -> list[Request]:
    params = SamplingParams(temperature=1.0, max_new_tokens=new, n=group,
                            stop_token_ids=tuple(stops))  # fmt: skip
    return [Request(p, params.replace(seed=seed + i)) for i, p in enumerate(prompts)]


def record_sources(engine: Engine) -> list[str]:
    """The hybrid drafter's choice for each drafting row, a list filled as the engine drafts."""
    proposer, seen = engine.proposer, []
    propose = proposer.propose

    def recording(batch, k):
        draft = propose(batch, k)
        seen.extend(s for s, n in zip(proposer.last_sources, draft.lengths.tolist(),
                                      strict=True) if n)  # fmt: skip
        return draft

    proposer.propose = recording
    return seen


def run_point(engines: dict[str, Engine], make_reqs, repeats: int) -> dict:
    """Warm every engine with one epoch, then alternate timed runs; best tokens/s each."""
    for engine in engines.values():
        engine.generate(make_reqs(10_000))
    choices = {n: record_sources(e) for n, e in engines.items() if n.startswith("hybrid")}
    rates: dict[str, float] = {}
    accept: dict[str, list[float]] = {n: [] for n in engines}
    for r in range(repeats):
        reqs = make_reqs(1000 * r)
        for name, engine in engines.items():
            t0 = time.perf_counter()
            out = engine.generate(reqs)
            seconds = time.perf_counter() - t0
            rate = sum(len(c.token_ids) for c in out) / seconds
            rates[name] = max(rates.get(name, 0.0), rate)
            accept[name].append(engine.stats.acceptance_length)
    row = {
        "tokens_per_s": rates,
        "vs_none": {n: v / rates["none"] for n, v in rates.items()},
        "acceptance_length": {n: sum(a) / len(a) for n, a in accept.items()},
        "hybrid_suffix_share": {
            n: (seen.count("suffix") / len(seen) if seen else None) for n, seen in choices.items()
        },
    }
    print("  ".join(f"{n} {v:.2f}x (acc {row['acceptance_length'][n]:.2f})"
                    for n, v in row["vs_none"].items()), flush=True)  # fmt: skip
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", required=True, help="an EAGLE-3 head directory")
    ap.add_argument("--prompts", default="1,4", help="prompts per point (x --group-size rows)")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.manual_seed(0)
    tok = load_tokenizer(MODEL)
    model = load_model(MODEL, dtype=torch.bfloat16)
    machine = measure_machine(torch.bfloat16)
    specs = contenders(args.head, args.k)
    points = []
    for n in map(int, args.prompts.split(",")):
        prompts = task_prompt_ids(tok, split="eval", n=n)
        rows = n * args.group_size
        print(f"{n} prompt(s) x {args.group_size} = {rows} rows", flush=True)
        engines = {name: Engine(model, max_batch=rows, spec=s) for name, s in specs.items()}

        def make_reqs(seed, prompts=prompts):
            return requests(prompts, args.group_size, args.new_tokens, tok.stop_token_ids, seed)

        points.append(run_point(engines, make_reqs, args.repeats) | {"prompts": n, "rows": rows})
    meta = run_metadata() | {"args": {k: str(v) for k, v in vars(args).items()},
                             "machine_measured": machine, "model": MODEL}  # fmt: skip
    write_result({"meta": meta, "points": points}, args.out)


if __name__ == "__main__":
    main()
