"""The block drafter (DFlash-style, k drafts in one forward) against EAGLE-3, side by side.

One script, one process, on the bundled model: the target's own replies to the ``reasoning``
preset's prompts (reasoning-gym basic_arithmetic, the ``step_by_step`` template, up to 512 new
tokens, T=1) are the training rollouts of BOTH drafters (the same examples: both read the same
target layers); each trains for the same wall time (``--train-seconds``: its steps from a measured
per-step time, train-drafter's recipe: batch 8, lr 1e-3, a 4096-token draft vocabulary,
cross-entropy to the target's distribution weighed decay**j over depths: EAGLE-3's unroll of 3 at
0.8, the block's 8 slots at ``--decay``, 0.8 its recipe). Then on held-out prompts (eval split,
same template, T=1) at batch 1, 8 and 32: tokens/s of plain decoding, of EAGLE-3 at each k of
``--eagle-k``, of the block drafter at each k of ``--block-k``, and of each with the cost-model
controller (k per step, up to its largest k), the same prompts and seeds for all; acceptance length
by k, drafting seconds per speculative step, and the decode roofline measured in the same run (copy
bandwidth, GEMM FLOP/s). Every contender answers the same requests in each of ``--repeats``
interleaved rounds in a fresh random order, per contender the median of its within-round ratios to
plain, beside a control (a second plain engine). With ``--exact sample`` (the default) every
contender emits plain sampling's tokens for the same seeds (equal work: the ratios are speed alone;
a stochastic drafter then draws its drafts on plain sampling's stream, which accepts less than
rejection sampling); ``--exact distribution`` verifies by rejection sampling, as RL runs by
default, and replies (so their lengths) then differ between contenders. The JSON carries
``specrl.bench.run_metadata()``.

    .venv/bin/python benchmarks/block_drafter.py --exact distribution \
        --out benchmarks/results/block_vs_eagle3.json
    .venv/bin/python benchmarks/block_drafter.py \
        --out benchmarks/results/block_vs_eagle3_sample.json

``--work DIR`` keeps the rollouts/examples and trained heads between runs (reused when there).
``--vllm`` instead serves the trained block head in vLLM (``specrl export-drafter --drafter
block``'s export, vLLM's ``dflash`` method) on the held-out prompts at batch 8, greedy and T=1,
and reports vLLM's acceptance length next to specrl's engine's with the same head and k:

    .venv/bin/python benchmarks/block_drafter.py --vllm --out benchmarks/results/block_vllm.json

``--online`` instead runs ``specrl train`` from nothing (an empty ``SPECRL_CACHE``: a random
head, trained online from the first step) with the block drafter (k = 8) and with EAGLE-3
(k = 3), drafting at every step, ``--steps`` GRPO steps each, the settings of the online-drafter
record in docs/benchmarks.md; per step the draft acceptance length, the drafter's version and
time, the reward; the curve is ``docs/img/block_online.png``:

    .venv/bin/python benchmarks/block_drafter.py --online --out benchmarks/results/block_online.json
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

    train, held_out = (n, 8) if split == "train" else (8, n)
    env = ReasoningGymEnv(TASK, task_config_with_preset(TASK, None), num_train=train,
                          num_eval=held_out, seed=seed, template=TEMPLATE)  # fmt: skip
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


def heads(target, examples: list, args, kinds=("eagle3", "block")) -> tuple[dict, dict]:
    """The trained heads of ``kinds`` (bf16, eval) and their training records (cached in the
    work dir; EAGLE-3 always with train-drafter's decay 0.8, the block with ``args.decay``)."""
    from specrl.models.head_kinds import load_head, new_head
    from specrl.models.heads import draft_vocab_by_frequency, save_head

    completions = [e.tokens[e.prompt_len :].tolist() for e in examples]
    vocab = draft_vocab_by_frequency(completions, DRAFT_VOCAB, target.config.vocab_size)
    out, records = {}, {}
    for kind, depth in (("eagle3", 3), ("block", args.block_size)):
        if kind not in kinds:
            continue
        decay = args.decay if kind == "block" else 0.8
        where = args.work / f"{kind}-{int(args.train_seconds)}s-decay{decay}"
        if (where / "head.json").exists():
            out[kind] = load_head(where, target, kind=kind)
            records[kind] = json.loads((where / "head.json").read_text())["extra"]
            continue
        geometry = {"block_size": args.block_size} if kind == "block" else None

        def make(kind=kind, geometry=geometry):
            torch.manual_seed(args.seed)
            return new_head(target, kind, None, vocab, geometry=geometry).float()

        run = argparse.Namespace(**{**vars(args), "decay": decay})
        head, records[kind] = train_for(make, examples, run, depth)
        save_head(head, where, extra=records[kind])
        out[kind] = load_head(where, target, kind=kind)
        print(kind, records[kind], flush=True)
    return out, records


def engine_runner(target, spec, ids: list[list[int]], batch: int, args):
    """A closure generating the replies to ``ids`` ``batch`` at a time with seeds from its
    argument (an engine built once, a warm-up call first): tokens/s, acceptance length, by
    draft position, and drafting seconds per speculative step."""
    from specrl.engine import Engine
    from specrl.rollout_types import Request
    from specrl.sampling import SamplingParams

    engine = Engine(target, max_batch=batch, spec=spec, seed=args.seed)
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                            stop_token_ids=tuple(args.stops), seed=args.seed)  # fmt: skip
    engine.generate([Request(ids[0], params.replace(max_new_tokens=16))])  # warm-up

    def run(seed: int) -> dict[str, Any]:
        tokens, spent, stats = 0, 0.0, None
        for i in range(0, len(ids), batch):
            chunk = ids[i : i + batch]
            t0 = time.perf_counter()
            out = engine.generate([Request(p, params.replace(seed=seed + i + j))
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

    return run


def run_engine(target, spec, ids: list[list[int]], batch: int, args) -> dict[str, Any]:
    """One run of ``engine_runner`` with ``args.seed``."""
    return engine_runner(target, spec, ids, batch, args)(args.seed)


def interleaved(target, trained: dict, ids: list[list[int]], batch: int, args) -> list[dict]:
    """Every contender at ``batch`` and a control (a second plain engine), ``args.repeats``
    rounds, each in a fresh seeded random order (round r: seeds from ``args.seed + 1000 r`` for
    all, so each round's contenders answer the same requests): per contender its runs, the
    median of its within-round ratios to plain, its median tokens/s and the statistics of its
    last round."""
    import random
    import statistics

    specs = {**contenders(trained, args), "plain-control": None}
    runners = {name: engine_runner(target, spec, ids, batch, args) for name, spec in specs.items()}
    runs: dict[str, list[dict]] = {name: [] for name in runners}
    order = list(runners)
    for r in range(args.repeats):
        random.Random(args.seed * 7919 + r).shuffle(order)
        for name in order:
            runs[name].append(runners[name](args.seed + 1000 * r))
    plain = [d["tokens_per_s"] for d in runs["plain"]]
    rows = []
    for name, done in runs.items():
        rates = [d["tokens_per_s"] for d in done]
        ratios = [a / b for a, b in zip(rates, plain, strict=True)]
        row = {"batch": batch, "engine": name, "prompts": len(ids),
               "tokens_per_s": statistics.median(rates), "tokens_per_s_runs": rates,
               "over_plain": statistics.median(ratios), "over_plain_runs": ratios,
               "acceptance_length": statistics.mean(d["acceptance_length"] for d in done),
               "tokens_runs": [d["tokens"] for d in done]}  # fmt: skip
        for key in ("per_position_acceptance", "draft_s_per_spec_step"):
            if key in done[-1]:
                row[key] = done[-1][key]
        rows.append(row)
    return rows


def contenders(heads_: dict, args) -> dict[str, Any]:
    """Name -> SpecConfig (None: plain) of every engine timed."""
    from specrl.spec.config import SpecConfig

    out: dict[str, Any] = {"plain": None}
    for kind, ks in (("eagle3", args.eagle_k), ("block", args.block_k)):
        opts = {"drafter": heads_[kind]}
        for k in ks:
            out[f"{kind}-k{k}"] = SpecConfig(kind, k, options=opts, exact=args.exact)
        out[f"{kind}-controller"] = SpecConfig(kind, max(ks), options=opts, adaptive=True,
                                               exact=args.exact)  # fmt: skip
    return out


def vllm_serving(args, target, tok, heads_: dict) -> dict[str, Any]:
    """The block head exported to vLLM's DFlash layout and served by vLLM (k = its block size)
    on ``args.eval_rows[-1]`` held-out prompts, 8 at a time: vLLM's acceptance length (1 +
    accepted / drafts, from its counters), tokens and first reply, and specrl's engine's
    acceptance and tokens, greedy and at T=1."""
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from vllm import LLM
    from vllm import SamplingParams as VllmParams

    from specrl.backends.vllm_requests import read_counters
    from specrl.drafters.export_dflash import export_dflash
    from specrl.models.checkpoints import resolve_model
    from specrl.spec.config import SpecConfig

    head = heads_["block"]
    k = head.block_size
    src = args.work / f"block-{int(args.train_seconds)}s-decay{args.decay}"
    out = export_dflash(src, target, args.work / "block-dflash-export")
    spec = {"method": "dflash", "model": str(out), "num_speculative_tokens": k,
            "draft_sample_method": "probabilistic"}  # fmt: skip
    llm = LLM(model=str(resolve_model(MODEL)), dtype="bfloat16", seed=args.seed,
              speculative_config=spec, max_num_seqs=8, disable_log_stats=False)  # fmt: skip
    ids = prompts(tok, "eval", args.eval_rows[-1], args.seed + 1)
    name = llm.llm_engine.model_config.served_model_name
    rows = {}
    for temperature in (0.0, 1.0):
        before = read_counters(llm, name)
        params = VllmParams(temperature=temperature, max_tokens=args.max_new_tokens,
                            stop_token_ids=list(args.stops), seed=args.seed)  # fmt: skip
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        spent = time.perf_counter() - t0
        d = read_counters(llm, name).minus(before)
        ours = run_engine(
            target,
            SpecConfig("block", k, options={"drafter": head}),
            ids,
            8,
            argparse.Namespace(**{**vars(args), "temperature": temperature}),
        )
        rows[f"T{temperature:g}"] = {
            "vllm_acceptance_length": 1 + d.accepted / max(d.drafts, 1),
            "vllm_drafts": d.drafts, "vllm_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "vllm_seconds": spent, "vllm_accepted_per_position": list(d.per_pos),
            "vllm_first_reply": tok.decode(list(outs[0].outputs[0].token_ids))[:300],
            "specrl_tokens": ours["tokens"],
            "specrl_acceptance_length": ours["acceptance_length"],
            "specrl_per_position_acceptance": ours["per_position_acceptance"],
        }  # fmt: skip
        print(json.dumps(rows[f"T{temperature:g}"]), flush=True)
    return {"k": k, "layers": len(head.layers), "export": str(out), "by_temperature": rows}


def decays(target, tok, examples: list, args) -> list[dict[str, Any]]:
    """Per decay: the block head trained with it (``args.train_seconds``), its acceptance
    length and per-position acceptance at k = block size over 16 held-out prompts at batch 8."""
    from specrl.spec.config import SpecConfig

    ids = prompts(tok, "eval", 16, args.seed + 1)
    out = []
    for decay in args.decays:
        run = argparse.Namespace(**{**vars(args), "decay": decay})
        trained, records = heads(target, examples, run, kinds=("block",))
        spec = SpecConfig("block", args.block_size, options={"drafter": trained["block"]})
        row = {"decay": decay, "training": records["block"]} | run_engine(target, spec, ids, 8, run)
        print(json.dumps({k: v for k, v in row.items() if k != "training"}), flush=True)
        out.append(row)
    return out


ONLINE_SETS = ("rollout.max_tokens_per_forward=1024", "rollout.prompts_per_step=4",
               "rollout.group_size=8", "rollout.max_new_tokens=64", "run.eval_every=0",
               "run.checkpoint_every=0", "drafter.mode=online")  # fmt: skip
ONLINE_KEYS = ("step", "reward_mean", "draft_acceptance_length", "drafter_version",
               "drafter_updates", "drafter_train_s", "drafter_loss", "step_time_s")  # fmt: skip


def online(args) -> dict[str, Any]:
    """GRPO from nothing with each learned drafter trained online (see the module docstring)."""
    import os
    import statistics

    import specrl
    from specrl.pipelines.rundir import RunDir

    os.environ["SPECRL_CACHE"] = str(args.work / "empty-cache")  # no cached head: from nothing
    runs = {}
    for kind, k in (("block", 8), ("eagle3", 3)):
        sets = [*ONLINE_SETS, f"rollout.spec={kind}", f"rollout.num_spec_tokens={k}",
                f"run.steps={args.steps}", f"run.seed={args.seed}"]  # fmt: skip
        t0 = time.perf_counter()
        used = specrl.train(overrides=sets, run_dir=args.work / f"online-{kind}", compare=False,
                            progress=False)  # fmt: skip
        rows = RunDir(used).rows(RunDir(used).metrics)
        acc = [r["draft_acceptance_length"] for r in rows]
        runs[kind] = {"sets": sets, "wall_s": time.perf_counter() - t0,
                      "steps": [{key: r.get(key) for key in ONLINE_KEYS} for r in rows],
                      "acceptance_first_last_5": [statistics.mean(acc[:5]),
                                                  statistics.mean(acc[-5:])],
                      "drafter_time_share": sum(r["drafter_train_s"] for r in rows)
                      / sum(r["step_time_s"] for r in rows)}  # fmt: skip
        print(kind, runs[kind]["acceptance_first_last_5"], flush=True)
    plot_online(runs, args.plot)
    return {"runs": runs, "plot": str(args.plot)}


def plot_online(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for kind, run in runs.items():
        steps = run["steps"]
        ax.plot([r["step"] for r in steps], [r["draft_acceptance_length"] for r in steps],
                label=f"{kind} (k={8 if kind == 'block' else 3})")  # fmt: skip
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("draft acceptance length")
    ax.set_title("Drafters trained online from nothing (SmolLM2-135M, CPU)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


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
    p.add_argument(
        "--decay",
        type=float,
        default=0.6,
        help="the block head's decay over slots "
        "(its recipe, BlockHead.decay; EAGLE-3 keeps its 0.8)",
    )
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--eagle-k", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--block-k", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median kept)")
    p.add_argument(
        "--exact",
        choices=("sample", "distribution"),
        default="sample",
        help="verification rule: 'sample' (every contender emits plain sampling's "
        "tokens: equal work) or 'distribution' (rejection sampling, as RL runs)",
    )
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument(
        "--eval-rows",
        type=int,
        nargs="+",
        default=[4, 16, 32],
        help="held-out prompts per batch size (batch 1: one after another)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm", action="store_true", help="serve the block head in vLLM instead")
    p.add_argument("--online", action="store_true", help="GRPO runs from nothing instead")
    p.add_argument("--steps", type=int, default=40, help="--online: GRPO steps per run")
    p.add_argument("--plot", type=Path, default=Path("docs/img/block_online.png"))
    p.add_argument(
        "--decays",
        type=float,
        nargs="+",
        default=None,
        help="instead: block heads trained with each decay over positions, their "
        "acceptance at k = block size, batch 8 (the block's part of the main run)",
    )
    args = p.parse_args()
    args.temperature = 1.0
    args.work.mkdir(parents=True, exist_ok=True)
    if args.online:
        result = {"meta": run_metadata()} | online(args)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        return

    from specrl.models.checkpoints import load_model, load_tokenizer
    from specrl.models.heads import default_layers

    torch.manual_seed(args.seed)
    target = load_model(MODEL, dtype=torch.bfloat16)
    tok = load_tokenizer(MODEL)
    args.stops = tuple(tok.stop_token_ids)
    examples = examples_for(target, tok, args, default_layers("eagle3", target.config.num_layers))
    if args.decays:
        result = {
            "meta": run_metadata(),
            "model": MODEL,
            "decays": decays(target, tok, examples, args),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        return
    trained, records = heads(target, examples, args)
    if args.vllm:
        result = {"meta": run_metadata(), "model": MODEL, "training": records["block"],
                  "serving": vllm_serving(args, target, tok, trained)}  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        return
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
        for row in interleaved(target, trained, ids, batch, args):
            row["decode_roofline_tokens_per_s"] = roof
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if "position" not in k}), flush=True)
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
    """Per batch: each drafter's best fixed k by its median ratio to plain, the block's best
    over EAGLE-3's best (the ratio of those ratios), each controller's and the control's ratio."""
    out = {}
    for batch in sorted({r["batch"] for r in rows}):
        at = [r for r in rows if r["batch"] == batch]
        best = {}
        for kind in ("eagle3", "block"):
            fixed = [r for r in at if r["engine"].startswith(f"{kind}-k")]
            top = max(fixed, key=lambda r: r["over_plain"])
            best[kind] = {"engine": top["engine"], "over_plain": top["over_plain"],
                          "tokens_per_s": top["tokens_per_s"]}  # fmt: skip
        ratios = {r["engine"]: r["over_plain"] for r in at
                  if r["engine"].endswith(("controller", "control"))}  # fmt: skip
        out[str(batch)] = {"best": best, "block_best_over_eagle3_best":
                           best["block"]["over_plain"] / best["eagle3"]["over_plain"],
                           "over_plain": ratios}  # fmt: skip
    return out


if __name__ == "__main__":
    main()
