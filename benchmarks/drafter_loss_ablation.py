"""Which loss raises held-out acceptance: more cross-entropy steps or total-variation steps?

Starts every arm from the same trained head (``--head DIR``, default: the cached default EAGLE-3
head; its ``examples.safetensors`` is the training data) and trains ``--steps`` more steps with
each loss of ``--losses`` (``specrl.drafters.train.HEAD_LOSSES``; same lr, seed and
mini-batches), then
measures held-out acceptance through the engine exactly as ``drafter_acceptance.py`` does (k=3,
basic_arithmetic eval prompts, T=0 one completion each, T=1 ``--samples``). The starting head is
measured too. Acceptance does not depend on speed, so this may share the machine.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/drafter_loss_ablation.py --threads 1 \
        --head ~/.cache/specrl/drafters/exp-eagle3-default-v1

Writes benchmarks/results/drafter_loss_ablation.json (with ``specrl.bench.run_metadata()``).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
from drafter_acceptance import MODEL, temperature_rows

from specrl.bench import run_metadata, write_result
from specrl.drafters.data import load_examples, task_prompt_ids
from specrl.drafters.train import TrainConfig, train_head
from specrl.engine import Engine
from specrl.models.checkpoints import load_model, load_tokenizer
from specrl.models.heads import load_head
from specrl.paths import drafter_cache_dir
from specrl.spec.config import SpecConfig

OUT = Path(__file__).parent / "results" / "drafter_loss_ablation.json"


def acceptance_rows(target, head, name: str, prompts, args, stops) -> list[dict]:
    """T=0 and T=1 rows of ``head`` (``drafter_acceptance.temperature_rows``)."""
    spec = SpecConfig(head.kind, args.k, options={"drafter": head})
    make = partial(Engine, target, max_batch=16, spec=spec)
    return temperature_rows(make, prompts, args, stops, {"arm": name})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", type=Path, default=drafter_cache_dir(MODEL, "eagle3"))
    ap.add_argument("--losses", default="ce,tv")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--eval-prompts", type=int, default=48)
    ap.add_argument("--samples", type=int, default=4, help="completions per prompt at T=1")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(MODEL, dtype=torch.bfloat16)
    tok = load_tokenizer(MODEL)
    stops = tuple(tok.stop_token_ids)
    prompts = task_prompt_ids(tok, "basic_arithmetic", "eval", args.eval_prompts, seed=0)
    examples = load_examples(args.head / "examples.safetensors")
    head = load_head(args.head, target).float()
    start = {k: v.clone() for k, v in head.state_dict().items()}
    rows = acceptance_rows(target, head, "start", prompts, args, stops)
    for loss in args.losses.split(","):
        head.load_state_dict(start)
        cfg = TrainConfig(steps=args.steps, lr=args.lr, warmup=10, batch_size=8, loss=loss)
        losses = train_head(head, examples, cfg, progress=False)
        arm = f"+{args.steps} {loss}"
        for row in acceptance_rows(target, head, arm, prompts, args, stops):
            rows.append(row | {"final_loss": round(sum(losses[-20:]) / 20, 4)})
    meta = run_metadata("benchmarks/drafter_loss_ablation.py " + " ".join(sys.argv[1:]))
    write_result({"meta": meta, "args": vars(args) | {"head": str(args.head), "out": str(args.out)},
                  "rows": rows}, args.out)  # fmt: skip


if __name__ == "__main__":
    main()
