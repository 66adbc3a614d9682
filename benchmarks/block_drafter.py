"""The block drafter (DFlash-style, k drafts in one forward) against EAGLE-3, side by side.

One script, one process, on the bundled model: the target's own replies to the ``reasoning``
preset's prompts (reasoning-gym basic_arithmetic, the ``step_by_step`` template, up to 512 new
tokens, T=1) are the training rollouts of BOTH drafters (the same examples: both read the same
target layers); each trains for the same wall time (``--train-seconds``: its steps from a
measured per-step time, train-drafter's recipe: batch 8, lr 1e-3, a 4096-token draft vocabulary,
cross-entropy to the target's distribution with decay ``--decay`` over depths: EAGLE-3's unroll
of 3, the block's 8 slots). Then on held-out prompts (eval split, same template, T=1) at batch
1, 8 and 32: tokens/s of plain decoding, of EAGLE-3 at each k of ``--eagle-k``, of the block
drafter at each k of ``--block-k``, and of each with the cost-model controller (k per step, up
to its largest k), the same prompts and seeds for all; acceptance length by k, drafting seconds
per speculative step, and the decode roofline measured in the same run (copy bandwidth, GEMM
FLOP/s). The JSON carries ``specrl.bench.run_metadata()``.

    .venv/bin/python benchmarks/block_drafter.py --out benchmarks/results/block_vs_eagle3.json

``--work DIR`` keeps the rollouts/examples and trained heads between runs (reused when there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from specrl.bench import measure_machine, roofline_tokens_per_s, run_metadata

MODEL = "smollm2-135m-instruct"
TASK = "basic_arithmetic"
TEMPLATE = "step_by_step"  # the reasoning preset's (specrl/presets/reasoning.toml)
DRAFT_VOCAB = 4096  # train-drafter's default (config_drafter.HEAD_DRAFT_VOCAB)


def prompts(tok, split: str, n: int, seed: int) -> list[list[int]]:
    """Chat token ids of ``n`` prompts of the reasoning preset's task and template."""
    from specrl.envs.reasoning_gym_env import ReasoningGymEnv, task_config_with_preset

    env = ReasoningGymEnv(TASK, task_config_with_preset(TASK, None), num_train=max(n, 8),
                          num_eval=max(n, 8), seed=seed, template=TEMPLATE)  # fmt: skip
    return [tok.encode(tok.chat_prompt(list(p.messages))) for p in env.prompts(split)[:n]]


def examples_for(target, tok, args, layers: tuple[int, ...]) -> list:
    """The training examples (rollouts + features), made once into ``args.work``."""
    from specrl.drafters import data

    path = args.work / f"examples-{args.train_prompts}x{args.samples}.safetensors"
    if path.exists():
        return data.load_examples(path)
    ids = prompts(tok, "train", args.train_prompts, args.seed)
    seqs = data.rollouts(target, ids, args.samples, 1.0, args.max_new_tokens,
                         tuple(tok.stop_token_ids), args.seed, progress=True)  # fmt: skip
    examples = data.build_examples(target, seqs, layers, progress=True)
    data.save_examples(examples, path)
    return examples


def train_for(make, examples: list, args, depth: int) -> tuple[Any, dict[str, Any]]:
    """A head from ``make()`` trained for ``args.train_seconds`` of wall time: its steps from
    the measured time of ``args.probe_steps`` steps of a throw-away one, then the schedule."""
    from specrl.drafters.train import TrainConfig, train_head

    cfg = TrainConfig(steps=args.probe_steps, batch_size=8, lr=1e-3, unroll=depth,
                      decay=args.decay, max_len=args.max_len, seed=args.seed)  # fmt: skip
    probe, head = make(), make()
    t0 = time.perf_counter()
    train_head(probe, examples, cfg, progress=False)
    per_step = (time.perf_counter() - t0) / args.probe_steps
    steps = max(1, int(args.train_seconds / per_step))
    t0 = time.perf_counter()
    losses = train_head(head, examples, dataclasses.replace(cfg, steps=steps))
    return head, {"steps": steps, "seconds": time.perf_counter() - t0,
                  "probe_s_per_step": per_step, "loss_first": losses[0],
                  "loss_last": sum(losses[-20:]) / len(losses[-20:])}  # fmt: skip


def heads(target, examples: list, args) -> tuple[dict, dict]:
    """The two trained heads (bf16, eval) and their training records (cached in the work dir)."""
    from specrl.models.heads import draft_vocab_by_frequency, load_head, new_head, save_head

    completions = [e.tokens[e.prompt_len :].tolist() for e in examples]
    vocab = draft_vocab_by_frequency(completions, DRAFT_VOCAB, target.config.vocab_size)
    out, records = {}, {}
    for kind, depth in (("eagle3", 3), ("block", args.block_size)):
        where = args.work / f"{kind}-{int(args.train_seconds)}s-decay{args.decay}"
        if (where / "head.json").exists():
            out[kind] = load_head(where, target, kind=kind)
            records[kind] = json.loads((where / "head.json").read_text())["extra"]
            continue
        geometry = {"block_size": args.block_size} if kind == "block" else None

        def make(kind=kind, geometry=geometry):
            torch.manual_seed(args.seed)
            return new_head(target, kind, None, vocab, geometry=geometry).float()

        head, records[kind] = train_for(make, examples, args, depth)
        save_head(head, where, extra=records[kind])
        out[kind] = load_head(where, target, kind=kind)
        print(kind, records[kind], flush=True)
    return out, records


def run_engine(target, spec, ids: list[list[int]], batch: int, args) -> dict[str, Any]:
    """Generate the replies to ``ids`` ``batch`` at a time (a warm-up call first); tokens/s,
    acceptance length by draft position and drafting seconds per speculative step."""
    from specrl.engine import Engine
    from specrl.rollout_types import Request
    from specrl.sampling import SamplingParams

    engine = Engine(target, max_batch=batch, spec=spec, seed=args.seed)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens,
                            stop_token_ids=tuple(args.stops), seed=args.seed)  # fmt: skip
    engine.generate([Request(ids[0], params.replace(max_new_tokens=16))])  # warm-up
    tokens, spent, stats = 0, 0.0, None
    for i in range(0, len(ids), batch):
        chunk = ids[i : i + batch]
        t0 = time.perf_counter()
        out = engine.generate([Request(p, params.replace(seed=args.seed + i + j))
                               for j, p in enumerate(chunk)])  # fmt: skip
        spent += time.perf_counter() - t0
        tokens += sum(len(c.token_ids) for c in out)
        if stats is None:
            stats = engine.stats
        else:
            stats.add(engine.stats)
    row = {"tokens": tokens, "seconds": spent, "tokens_per_s": tokens / spent,
           "acceptance_length": stats.acceptance_length}  # fmt: skip
    if spec is not None and spec.enabled:
        row |= {"per_position_acceptance": stats.per_position_acceptance,
                "draft_s_per_spec_step": stats.draft_s / max(stats.spec_steps, 1),
                "spec_steps": stats.spec_steps, "steps": stats.steps}  # fmt: skip
    return row


def contenders(heads_: dict, args) -> dict[str, Any]:
    """Name -> SpecConfig (None: plain) of every engine timed."""
    from specrl.spec.config import SpecConfig

    out: dict[str, Any] = {"plain": None}
    for kind, ks in (("eagle3", args.eagle_k), ("block", args.block_k)):
        opts = {"drafter": heads_[kind]}
        for k in ks:
            out[f"{kind}-k{k}"] = SpecConfig(kind, k, options=opts)
        out[f"{kind}-controller"] = SpecConfig(kind, max(ks), options=opts, adaptive=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/specrl-block-bench"))
    p.add_argument("--train-prompts", type=int, default=96)
    p.add_argument("--samples", type=int, default=2, help="rollouts per train prompt (T=1)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--max-len", type=int, default=640, help="training examples cut to this")
    p.add_argument("--train-seconds", type=float, default=240.0)
    p.add_argument("--probe-steps", type=int, default=6)
    p.add_argument("--decay", type=float, default=0.8)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--eagle-k", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    p.add_argument("--block-k", type=int, nargs="+", default=[2, 3, 4, 6, 8])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument(
        "--eval-rows",
        type=int,
        nargs="+",
        default=[4, 16, 32],
        help="held-out prompts per batch size (batch 1: one after another)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    from specrl.models.checkpoints import load_model, load_tokenizer
    from specrl.models.heads import default_layers

    torch.manual_seed(args.seed)
    target = load_model(MODEL, dtype=torch.bfloat16)
    tok = load_tokenizer(MODEL)
    args.stops = tuple(tok.stop_token_ids)
    examples = examples_for(target, tok, args, default_layers("eagle3", target.config.num_layers))
    trained, records = heads(target, examples, args)
    machine = measure_machine()
    eval_ids = prompts(tok, "eval", max(args.eval_rows), args.seed + 1)
    rows = []
    for batch, n in zip(args.batches, args.eval_rows, strict=True):
        ids = eval_ids[:n]
        roof = roofline_tokens_per_s(
            target.config,
            batch,
            torch.bfloat16,
            256,
            machine["copy_bandwidth_bytes_s"],
            machine["gemm_flops"],
        )
        for name, spec in contenders(trained, args).items():
            row = {"batch": batch, "engine": name, "prompts": n, "decode_roofline_tokens_per_s":
                   roof} | run_engine(target, spec, ids, batch, args)  # fmt: skip
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if not isinstance(v, list)}),
                  flush=True)  # fmt: skip
    plain = {r["batch"]: r["tokens_per_s"] for r in rows if r["engine"] == "plain"}
    for r in rows:
        r["over_plain"] = r["tokens_per_s"] / plain[r["batch"]]
    summary = summarize(rows)
    ntok = sum(len(e.tokens) - e.prompt_len for e in examples)
    result = {"meta": run_metadata(), "machine_measured": machine, "model": MODEL,
              "workload": {"task": TASK, "template": TEMPLATE, "temperature": 1.0,
                           "max_new_tokens": args.max_new_tokens,
                           "train_rollouts": len(examples), "train_completion_tokens": ntok},
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "training": records, "rows": rows, "summary": summary}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


def summarize(rows: list[dict]) -> dict[str, Any]:
    """Per batch: each drafter's best fixed k and its tokens/s, the block's best over EAGLE-3's
    best, and each controller over plain."""
    out = {}
    for batch in sorted({r["batch"] for r in rows}):
        at = [r for r in rows if r["batch"] == batch]
        best = {}
        for kind in ("eagle3", "block"):
            fixed = [r for r in at if r["engine"].startswith(f"{kind}-k")]
            top = max(fixed, key=lambda r: r["tokens_per_s"])
            best[kind] = {"engine": top["engine"], "tokens_per_s": top["tokens_per_s"],
                          "over_plain": top["over_plain"]}  # fmt: skip
        ctrl = {r["engine"]: r["over_plain"] for r in at if r["engine"].endswith("controller")}
        out[str(batch)] = {"best": best, "block_best_over_eagle3_best":
                           best["block"]["tokens_per_s"] / best["eagle3"]["tokens_per_s"],
                           "controllers_over_plain": ctrl}  # fmt: skip
    return out


if __name__ == "__main__":
    main()
