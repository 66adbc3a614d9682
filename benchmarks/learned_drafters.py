"""Tokens/s with learned drafters (EAGLE-3, MTP, distilled draft model) vs no speculation and
the suffix drafter.

Usage: python benchmarks/learned_drafters.py [--batch-sizes 1,4,16,64] [--k 3] [--temperature 1]
    [--eagle3 DIR] [--mtp DIR] [--draft DIR] [--threads 2]
Drafters default to ``cache_dir()/drafters/smollm2-135m-instruct-{eagle3,mtp,draft}`` (made by
``specrl train-drafter``); a missing one is skipped. Prompts come from the basic_arithmetic eval
split (never used for training). Writes benchmarks/results/learned_drafters.json: per batch size
and method, tokens/s, acceptance length and the ratio to no speculation, all in one run. Each
engine runs once untimed first (warm-up; gives the suffix drafter one earlier epoch).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specrl.cli import load_drafter
from specrl.drafters.cli import default_out
from specrl.drafters.data import task_prompt_ids
from specrl.engine import Engine, Request
from specrl.models.checkpoints import load_model, load_tokenizer
from specrl.sampling import SamplingParams
from specrl.spec.config import SpecConfig

OUT = Path(__file__).parent / "results" / "learned_drafters.json"
MODEL = "smollm2-135m-instruct"


def run_one(target, spec: SpecConfig, prompts, params, draft=None) -> tuple[float, float]:
    """(tokens/s, acceptance length) of one engine on ``prompts`` (after one warm-up run)."""
    engine = Engine(target, max_batch=len(prompts), spec=spec, draft_model=draft)
    requests = [Request(p, params) for p in prompts]
    engine.generate(requests)
    t0 = time.perf_counter()
    out = engine.generate(requests)
    wall = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for c in out)
    return tokens / wall, engine.stats.acceptance_length


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--eagle3", type=Path, default=default_out(MODEL, "eagle3"))
    ap.add_argument("--mtp", type=Path, default=default_out(MODEL, "mtp"))
    ap.add_argument("--draft", type=Path, default=default_out(MODEL, "draft"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(MODEL, dtype=torch.bfloat16)
    tok = load_tokenizer(MODEL)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    pool = task_prompt_ids(tok, "basic_arithmetic", "eval", max(sizes), seed=0)
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.new_tokens,
                            stop_token_ids=tuple(tok.stop_token_ids))  # fmt: skip
    methods = {"none": (SpecConfig(), None), "suffix": (SpecConfig("suffix", args.k), None)}
    for kind in ("eagle3", "mtp"):
        path = getattr(args, kind)
        if (path / "head.json").exists():
            methods[kind] = (SpecConfig(kind, args.k, options={"drafter_path": str(path)}), None)
        else:
            print(f"skipping {kind}: no head at {path}")
    if (args.draft / "config.json").exists():
        methods["draft"] = (SpecConfig("draft", args.k), load_drafter(str(args.draft), target, tok))
    else:
        print(f"skipping draft: no draft model at {args.draft}")
    rows = []
    for b in sizes:
        prompts = [pool[i % len(pool)] for i in range(b)]
        base = None
        for name, (spec, draft) in methods.items():
            tps, acc = run_one(target, spec, prompts, params, draft)
            base = tps if name == "none" else base
            row = {"batch": b, "method": name, "tok_s": round(tps, 1),
                   "acceptance_length": round(acc, 3), "ratio": round(tps / base, 3)}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"k": args.k, "temperature": args.temperature, "new_tokens": args.new_tokens,
            "threads": args.threads, "dtype": "bfloat16"}  # fmt: skip
    args.out.write_text(json.dumps({"config": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
