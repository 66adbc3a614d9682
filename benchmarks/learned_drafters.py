"""Tokens/s with learned drafters (EAGLE-3, MTP, distilled draft model) vs no speculation and
the suffix drafter.

Usage: python benchmarks/learned_drafters.py [--batch-sizes 1,4,16,64] [--k 3] [--temperature 1]
    [--eagle3 DIR] [--mtp DIR] [--draft DIR] [--threads 2]
Drafters default to ``cache_dir()/drafters/smollm2-135m-instruct-{eagle3,mtp,draft}`` (made by
``specrl train-drafter``); a missing one is skipped. Prompts come from the basic_arithmetic eval
split (never used for training). At batch size b the engine keeps b rows busy over
max(b, --min-requests) requests (continuous batching). Every engine runs once untimed first
(warm-up; gives the suffix drafter one earlier epoch), then --rounds timed rounds interleave the
methods, and the median is reported. Writes benchmarks/results/learned_drafters.json (with
``specrl.bench.run_metadata()``): per batch size and method, tokens/s, acceptance length and
the ratio to no speculation, all in one run. With ``--siblings S`` (default 3; 0 = off) the
EAGLE-3 head also runs as ``eagle3+sS``: S extra first-token candidates per step
(``SpecConfig.siblings``), at every batch size (no adaptive rule here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specrl.bench import run_metadata, write_result
from specrl.drafters.data import task_prompt_ids
from specrl.engine import Engine
from specrl.models.checkpoints import load_draft_model, load_model, load_tokenizer
from specrl.paths import drafter_cache_dir
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams
from specrl.spec.config import SpecConfig

OUT = Path(__file__).parent / "results" / "learned_drafters.json"
MODEL = "smollm2-135m-instruct"
EVAL_POOL = (
    48  # distinct eval prompts (the default task's eval split holds ~59); larger batches cycle
)


def make_engine(target, spec: SpecConfig, draft, batch: int, requests) -> Engine:
    """An engine with ``batch`` rows, run once untimed (warm-up; primes the suffix index)."""
    engine = Engine(target, max_batch=batch, spec=spec, draft_model=draft)
    engine.generate(requests)
    return engine


def timed(engine: Engine, requests) -> tuple[float, float]:
    """(tokens/s, acceptance length) of one generate call."""
    t0 = time.perf_counter()
    out = engine.generate(requests)
    wall = time.perf_counter() - t0
    return sum(len(c.token_ids) for c in out) / wall, engine.stats.acceptance_length


def bench_batch(target, methods: dict, requests, batch: int, rounds: int) -> list[dict]:
    """Rows for one batch size: median tokens/s over ``rounds`` interleaved rounds."""
    engines = {name: make_engine(target, spec, draft, batch, requests)
               for name, (spec, draft) in methods.items()}  # fmt: skip
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for _ in range(rounds):  # interleaved: machine-load drift hits every method alike
        for name, engine in engines.items():
            runs[name].append(timed(engine, requests))
    base = statistics.median(t for t, _ in runs["none"])
    rows = []
    for name, rs in runs.items():
        tps = statistics.median(t for t, _ in rs)
        acc = statistics.fmean(a for _, a in rs)
        row = {"batch": batch, "method": name, "tok_s": round(tps, 1)}
        rows.append(row | {"acceptance_length": round(acc, 3), "ratio": round(tps / base, 3)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--eagle3", type=Path, default=drafter_cache_dir(MODEL, "eagle3"))
    ap.add_argument("--mtp", type=Path, default=drafter_cache_dir(MODEL, "mtp"))
    ap.add_argument("--draft", type=Path, default=drafter_cache_dir(MODEL, "draft"))
    ap.add_argument("--siblings", type=int, default=3, help="eagle3 first-token siblings (0: off)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds (median reported)")
    ap.add_argument("--min-requests", type=int, default=16, help="requests per batch size")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(MODEL, dtype=torch.bfloat16)
    tok = load_tokenizer(MODEL)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    pool = task_prompt_ids(tok, "basic_arithmetic", "eval", EVAL_POOL, seed=0)  # cycled
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.new_tokens,
                            stop_token_ids=tuple(tok.stop_token_ids))  # fmt: skip
    methods = {"none": (SpecConfig(), None), "suffix": (SpecConfig("suffix", args.k), None)}
    for kind in ("eagle3", "mtp"):
        path = getattr(args, kind)
        if (path / "head.json").exists():
            methods[kind] = (SpecConfig(kind, args.k, options={"drafter_path": str(path)}), None)
            if kind == "eagle3" and args.siblings:
                spec = SpecConfig(kind, args.k, options={"drafter_path": str(path)},
                                  siblings=args.siblings)  # fmt: skip
                methods[f"eagle3+s{args.siblings}"] = (spec, None)
        else:
            print(f"skipping {kind}: no head at {path}")
    if (args.draft / "config.json").exists():
        draft = load_draft_model(str(args.draft), target, tok)
        methods["draft"] = (SpecConfig("draft", args.k), draft)
    else:
        print(f"skipping draft: no draft model at {args.draft}")
    rows = []
    for b in sizes:
        n = max(b, args.min_requests)  # more requests than rows: continuous batching at b rows
        requests = [Request(pool[i % len(pool)], params.replace(seed=i)) for i in range(n)]
        rows += bench_batch(target, methods, requests, b, args.rounds)
    config = {"k": args.k, "temperature": args.temperature, "new_tokens": args.new_tokens,
              "threads": args.threads, "dtype": "bfloat16", "rounds": args.rounds,
              "min_requests": args.min_requests,
              "siblings": args.siblings,
              "drafters": {name: str(getattr(args, name, "")) for name in methods}}  # fmt: skip
    meta = run_metadata("benchmarks/learned_drafters.py " + " ".join(sys.argv[1:]))
    write_result({"meta": meta, "config": config, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
