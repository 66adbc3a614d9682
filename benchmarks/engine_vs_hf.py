"""specrl's engine vs transformers' generate on SmolLM2-135M, in one run, with ratios.

Usage: python benchmarks/engine_vs_hf.py [--batch-sizes 1,8,32,64] [--new-tokens 128]
Writes benchmarks/results/engine_vs_hf.json. Same prompts, T=1 sampling, exactly new_tokens per
sequence (stop tokens ignored), bf16, both engines in this process. Also reports the fraction of
the roofline (``specrl.bench``'s fixed reference figures and figures measured in the run).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specrl.bench import GenerateBench, run_generate_bench, write_result

OUT = Path(__file__).parent / "results" / "engine_vs_hf.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    bench = GenerateBench(
        dtype=torch.bfloat16,
        batch_sizes=[int(x) for x in args.batch_sizes.split(",")],
        new_tokens=args.new_tokens,
        compare=["hf"],
        repeats=args.repeats,
    )
    write_result(run_generate_bench(bench), args.out)


if __name__ == "__main__":
    main()
