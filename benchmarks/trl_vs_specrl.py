"""TRL's GRPOTrainer (1.16) vs specrl's synchronous pipeline on the same GRPO workload.

Same model (the bundled SmolLM2-135M-Instruct, as a Hugging Face directory), task and prompt
template (``ReasoningGymEnv`` rewards), group size G, prompts per step, max completion length,
sampling (T=1, no top-k/top-p), loss (GRPO clipped ratio, eps 0.2, no KL), advantages (group
mean/std), AdamW settings (lr, betas, weight decay, grad clip) and one optimizer step per
generation batch. Differences that remain by design: TRL draws prompts with its own seeded
sampler (same distribution, other order); TRL generates with ``transformers.generate`` (static
padded batch) and trains padded fp32 (``--trl-bf16`` turns on its bf16 autocast); specrl
runs its own engine (continuous batching, bf16, speculation per config) and packed bf16-autocast
training. Per framework the script reports mean step time and rollout tokens/s over the steps
after ``--warmup``, and the ratios specrl/TRL. Prints a table, writes JSON with
``specrl.bench.run_metadata()``.

    .venv/bin/python benchmarks/trl_vs_specrl.py --steps 3 --warmup 1
    .venv/bin/python benchmarks/trl_vs_specrl.py --steps 2 --set rollout.prompts_per_step=2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from specrl.bench import run_metadata
from specrl.config import Config, load_config


def trl_run(cfg: Config, steps: int, bf16: bool) -> list[dict]:
    """``steps`` GRPOTrainer steps; per step: step seconds, generation seconds, tokens."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from specrl.envs.reasoning_gym_env import ReasoningGymEnv
    from specrl.models.checkpoints import resolve_model

    model_dir = str(resolve_model(cfg.model.name))
    env = ReasoningGymEnv.from_config(cfg.env)
    train_prompts = env.prompts("train", seed=cfg.run.seed)
    data = Dataset.from_list(
        [{"prompt": list(p.messages), "idx": i} for i, p in enumerate(train_prompts)]
    )

    def reward(prompts, completions, idx, **_):
        metas = [train_prompts[i].meta for i in idx]
        return [env.reward(c[-1]["content"], m) for c, m in zip(completions, metas, strict=True)]

    r, lc = cfg.rollout, cfg.learner
    batch = r.prompts_per_step * r.group_size
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(), max_steps=steps, per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, num_generations=r.group_size,
        max_completion_length=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
        top_k=r.top_k, learning_rate=lc.lr, adam_beta1=lc.betas[0], adam_beta2=lc.betas[1],
        weight_decay=lc.weight_decay, max_grad_norm=lc.max_grad_norm, lr_scheduler_type="constant",
        warmup_steps=0, beta=0.0, epsilon=lc.clip_eps_low, loss_type="grpo", num_iterations=1,
        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=bf16,
        seed=cfg.run.seed, dataloader_num_workers=0,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.pad_token = tok.pad_token or tok.eos_token
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tok)  # fmt: skip
    rows: list[dict] = []
    _instrument(trainer, rows, TrainerCallback)
    trainer.train()
    return rows


def _instrument(trainer, rows: list[dict], callback_base) -> None:
    """Time each step (callback) and each generation call (wrapped), count completion tokens."""
    gen = {"s": 0.0, "tokens": 0}
    inner = trainer._generate_single_turn

    def timed(*a, **kw):
        t0 = time.perf_counter()
        completion_ids, logprobs = inner(*a, **kw)
        gen["s"] += time.perf_counter() - t0
        gen["tokens"] += sum(len(c) for c in completion_ids)
        return completion_ids, logprobs

    trainer._generate_single_turn = timed

    class Timer(callback_base):
        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()
            gen.update(s=0.0, tokens=0)

        def on_step_end(self, *_, **__):
            rows.append({"step_time_s": time.perf_counter() - self.t0, "gen_time_s": gen["s"],
                         "gen_tokens": gen["tokens"]})  # fmt: skip

    trainer.add_callback(Timer())


def specrl_run(cfg: Config, steps: int) -> list[dict]:
    from specrl.pipelines.build import build_run
    from specrl.pipelines.train import train

    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"steps": steps})})
    with tempfile.TemporaryDirectory() as d:
        return train(build_run(cfg), d, progress=False, echo=print)


def summarize(name: str, rows: list[dict], warmup: int) -> dict:
    kept = rows[warmup:] or rows
    mean = lambda k: statistics.fmean(r[k] for r in kept)  # noqa: E731
    return {"framework": name, "steps_measured": len(kept), "step_time_s": mean("step_time_s"),
            "gen_time_s": mean("gen_time_s"), "gen_tokens": mean("gen_tokens"),
            "rollout_tokens_per_s": sum(r["gen_tokens"] for r in kept)
            / sum(r["gen_time_s"] for r in kept)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of the means")
    ap.add_argument("--config", default=None, help="TOML run config (default: embedded)")
    ap.add_argument("--set", action="append", default=[], help="config override key=value")
    ap.add_argument("--trl-bf16", action="store_true", help="TRL with bf16 autocast")
    ap.add_argument("--skip-trl", action="store_true", help="only the specrl side")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--out", default="benchmarks/results/trl_vs_specrl.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(args.config, [*args.set, "run.eval_every=0", "run.checkpoint_every=0"])
    results = [summarize("specrl", specrl_run(cfg, args.steps), args.warmup)]
    if not args.skip_trl:
        results.append(summarize("trl", trl_run(cfg, args.steps, args.trl_bf16), args.warmup))
        ours, trl = results
        ours["step_speedup_vs_trl"] = trl["step_time_s"] / ours["step_time_s"]
        ours["rollout_speedup_vs_trl"] = ours["rollout_tokens_per_s"] / trl["rollout_tokens_per_s"]
    print(f"\n{'framework':10} {'step s':>8} {'gen s':>8} {'tokens':>8} {'tok/s':>8}")
    for r in results:
        print(f"{r['framework']:10} {r['step_time_s']:8.1f} {r['gen_time_s']:8.1f} "
              f"{r['gen_tokens']:8.0f} {r['rollout_tokens_per_s']:8.1f}")  # fmt: skip
    if len(results) == 2:
        print(f"specrl vs TRL: step {results[0]['step_speedup_vs_trl']:.2f}x faster, rollout "
              f"{results[0]['rollout_speedup_vs_trl']:.2f}x tokens/s")  # fmt: skip
    out = {"meta": run_metadata(), "args": vars(args), "config": cfg.model_dump(mode="json"),
           "results": results}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
