"""Speculative decoding with each drafter vs no speculation, SmolLM2-135M, GRPO-like groups.

Usage: python benchmarks/spec_drafters.py [--batch-sizes 1,4,16,64] [--group-size 4] [--k 3]
Writes benchmarks/results/spec_drafters.json: tokens/s, acceptance length and ratio to the
no-speculation engine at each batch size, all in one run. Before timing, each engine generates
the same prompts once (untimed): for the suffix drafter that is one earlier "epoch" of rollouts
for these prompts, as in RL where prompts recur; the other drafters keep no history.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specrl.bench import GenerateBench, run_generate_bench, write_result

OUT = Path(__file__).parent / "results" / "spec_drafters.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--methods", default="ngram,suffix")
    ap.add_argument("--drafter", default=None, help="for method draft: path or prefix:N")
    ap.add_argument("--max-tokens-per-forward", type=int, default=None, help="adaptive k cap")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    bench = GenerateBench(
        dtype=torch.bfloat16,
        batch_sizes=[int(x) for x in args.batch_sizes.split(",")],
        new_tokens=args.new_tokens,
        methods=args.methods.split(","),
        k=args.k,
        group_size=args.group_size,
        drafter=args.drafter,
        max_tokens_per_forward=args.max_tokens_per_forward,
    )
    write_result(run_generate_bench(bench), args.out)


if __name__ == "__main__":
    main()
