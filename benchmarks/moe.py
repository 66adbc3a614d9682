"""Mixture-of-experts policies on a CPU: the upcycled bundled model learning with and without
routing replay, and what verifying k drafts costs on it next to the dense model.

Each subcommand writes a JSON with ``specrl.bench.run_metadata()``:

``grpo``: ``specrl upcycle`` of the bundled SmolLM2 (``--experts``, ``--top-k``), then the
default ``specrl train`` on it twice, ``learner.routing_replay`` off and on, side by side:
per-step reward, the engine/learner logprob mismatch (with replay also without it, from the
same step's policy), the router's balance; ``docs/img/moe_grpo.png``.

``cost``: step time of a verify forward of k+1 tokens per row over a decode forward of one, at
batch 1, 8 and 32 (k = 1..``--k-max``), for the dense model and its upcycle, measured in one
process on the engine's own forwards (bf16 where the CPU multiplies it natively), and what the
cost model fitted on the MoE's own records (k + 1 = 1, 2, 4 tokens per row) predicts for the
other widths: with the unique-expert term (the routing the engine measured, its own rate), with
those bytes at the dense rate, and priced flat (a verify touching a decode step's experts, as
a dense-model cost model assumes), errors stated. Then the speculation controller on the MoE
(``ngram`` and ``suffix``, k <= ``--k-max``, adaptive as ``specrl train`` runs it) against plain
decoding, tokens/s at each batch (the bench's chat prompts, 128 new tokens, ``--repeats``
interleaved runs: the best of each and the ratio of medians).

    .venv/bin/python benchmarks/moe.py grpo --out benchmarks/results/moe_grpo.json
    .venv/bin/python benchmarks/moe.py cost --out benchmarks/results/moe_verify_cost.json
    .venv/bin/python benchmarks/moe.py workers --out benchmarks/results/moe_train_workers.json

``workers``: ``--steps`` GRPO steps on the upcycle with routing replay, the learner on one
process and on 2 train workers (FSDP2 over gloo, Ray), float32: the learner's metrics of each
step side by side (step 0 learns from the same rollouts: its loss and gradient norm must agree
to float rounding; later steps sample from weights that differ by that rounding).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from specrl.bench import run_metadata
from specrl.pipelines.rundir import RunDir

STEP_KEYS = ("step", "reward_mean", "logprob_delta_mean", "logprob_delta_max",
             "logprob_delta_unreplayed_mean", "logprob_delta_unreplayed_max",
             "learner_moe_load_max", "learner_moe_aux_loss", "acceptance_length",
             "step_time_s")  # fmt: skip
BATCHES = (1, 8, 32)
CONTEXT = 64
FIT_WIDTHS = (1, 2, 4)  # tokens per row of the records the cost model is fitted on


def upcycled(work: Path, experts: int, top_k: int) -> Path:
    """The bundled model upcycled into ``work`` (made once, reused)."""
    from specrl.pipelines.upcycle import write_upcycled

    out = work / f"smollm2-moe-{experts}x{top_k}"
    if not (out / "config.json").is_file():
        write_upcycled("smollm2-135m-instruct", out, experts, top_k)
    return out


def grpo_run(run_dir: Path, model: Path, replay: bool, sets: list[str]) -> dict[str, Any]:
    """One default ``specrl.train`` run on ``model``: its per-step rows (``STEP_KEYS``)."""
    import specrl

    overrides = [f"model.name={json.dumps(str(model))}",
                 f"learner.routing_replay={str(replay).lower()}", *sets]  # fmt: skip
    t0 = time.perf_counter()
    used = specrl.train(overrides=overrides, run_dir=run_dir, compare=False, progress=False)
    wall = time.perf_counter() - t0
    rows = RunDir(used).rows(RunDir(used).metrics)
    rewards = [r["reward_mean"] for r in rows]
    return {
        "run_dir": str(used),
        "sets": overrides,
        "wall_s": wall,
        "steps": [{k: r[k] for k in STEP_KEYS if k in r} for r in rows],
        "reward_first_last": [rewards[0], rewards[-1]],
        "reward_mean_first_last_4": [statistics.mean(rewards[:4]), statistics.mean(rewards[-4:])],
        "logprob_delta_mean": statistics.mean(r["logprob_delta_mean"] for r in rows),
    }


def grpo(args: argparse.Namespace) -> dict[str, Any]:
    model = upcycled(args.work, args.experts, args.top_k)
    runs = {name: grpo_run(args.work / f"grpo-{name}", model, name == "replay", args.set)
            for name in ("free", "replay")}  # fmt: skip
    replay = runs["replay"]["steps"]
    unreplayed = statistics.mean(r["logprob_delta_unreplayed_mean"] for r in replay)
    plot(runs, args.plot)
    return {
        "model": str(model),
        "experts": args.experts,
        "top_k": args.top_k,
        "runs": runs,
        "mismatch_mean": {
            "free_run": runs["free"]["logprob_delta_mean"],
            "replay_run_replayed": runs["replay"]["logprob_delta_mean"],
            "replay_run_unreplayed": unreplayed,
        },  # fmt: skip
        "plot": str(args.plot),
    }


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    for name, run in runs.items():
        steps = [r["step"] for r in run["steps"]]
        ax1.plot(steps, [r["reward_mean"] for r in run["steps"]], label=f"routing {name}")
        ax2.plot(steps, [r["logprob_delta_mean"] for r in run["steps"]], label=f"routing {name}")
    replay = runs["replay"]["steps"]
    ax2.plot([r["step"] for r in replay], [r["logprob_delta_unreplayed_mean"] for r in replay],
             "--", label="replay run, without replay")  # fmt: skip
    ax1.set(xlabel="RL step", ylabel="train reward", title="upcycled SmolLM2 MoE, GRPO")
    ax2.set(xlabel="RL step", ylabel="mean |engine - learner| logprob", title="mismatch")
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


LEARNER_KEYS = ("learner_loss", "learner_grad_norm", "learner_clip_frac", "learner_kl",
                "learner_moe_load_max", "learner_moe_aux_loss", "reward_mean",
                "logprob_delta_mean", "train_time_s")  # fmt: skip


def workers(args: argparse.Namespace) -> dict[str, Any]:
    model = upcycled(args.work, args.experts, args.top_k)
    sets = [f"run.steps={args.steps}", "run.eval_every=0", "run.checkpoint_every=0",
            "learner.dtype=fp32", "model.dtype=fp32", *args.set]  # fmt: skip
    runs = {}
    for n in (1, 2):  # each run in its own process: the first's memory is not the second's
        run_dir = args.work / f"workers-{n}"
        overrides = [f"model.name={json.dumps(str(model))}", "learner.routing_replay=true",
                     *sets, f"cluster.train_workers={n}"]  # fmt: skip
        cmd = [sys.executable, "-m", "specrl.cli", "train", "--run-dir", str(run_dir),
               "--no-progress", "--no-compare"]  # fmt: skip
        t0 = time.perf_counter()
        subprocess.run([*cmd, *(a for o in overrides for a in ("--set", o))], check=True)
        rows = RunDir(run_dir).rows(RunDir(run_dir).metrics)
        runs[n] = {"run_dir": str(run_dir), "wall_s": time.perf_counter() - t0,
                   "steps": [{k: r.get(k) for k in LEARNER_KEYS} for r in rows]}  # fmt: skip
    one, two = (runs[n]["steps"][0] for n in (1, 2))
    step0 = {  # the loss of an on-policy GRPO step is ~0: its absolute difference
        "learner_loss_abs": abs(two["learner_loss"] - one["learner_loss"]),
        "learner_grad_norm_rel": abs(two["learner_grad_norm"] / one["learner_grad_norm"] - 1),
    }
    return {"model": str(model), "sets": sets, "runs": runs, "step0_difference": step0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("grpo", "cost", "workers"))
    ap.add_argument("--steps", type=int, default=3, help="workers: GRPO steps per run")
    ap.add_argument("--work", type=Path, default=Path("runs/moe"), help="models and runs")
    ap.add_argument("--experts", type=int, default=4, help="experts per layer of the upcycle")
    ap.add_argument("--top-k", type=int, default=2, help="experts per token of the upcycle")
    ap.add_argument("--k-max", type=int, default=7, help="cost: most draft tokens verified")
    ap.add_argument("--repeats", type=int, default=5, help="cost: timed rounds (best kept)")
    ap.add_argument("--set", action="append", default=[], help="grpo: config override")
    ap.add_argument("--plot", type=Path, default=Path("docs/img/moe_grpo.png"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    result = {
        "what": args.what,
        **{"grpo": grpo, "cost": cost, "workers": workers}[args.what](args),
    }
    result["metadata"] = run_metadata()
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1)[:4000])


def timed_forwards(model, widths: range, repeats: int) -> dict[tuple[int, int], float]:
    """Best-of-``repeats`` seconds of a forward of ``t`` random tokens per row over ``CONTEXT``
    cached positions, per (batch, t), interleaved over the repeats."""
    import torch

    from specrl.models.device import model_device, synchronize
    from specrl.spec.controller import random_ids

    cache = model.new_cache(max(BATCHES), CONTEXT + max(widths))
    device = model_device(model)
    best: dict[tuple[int, int], float] = {}
    with torch.inference_mode():
        for rounds in range(repeats + 1):  # the first round warms up, untimed
            for b in BATCHES:
                for t in widths:
                    ids = random_ids(model, b, t, seed=b * 100 + t)
                    pos = CONTEXT + torch.arange(t, device=device)[None, :].expand(b, t)
                    t0 = time.perf_counter()
                    model(ids, pos, cache, kv_len=CONTEXT + t)
                    synchronize(device)
                    seconds = time.perf_counter() - t0
                    if rounds > 0:
                        best[b, t] = min(best.get((b, t), seconds), seconds)
    return best


def fit_errors(spec, times: dict[tuple[int, int], float], variant: str) -> dict[str, Any]:
    """The cost model fitted on the ``FIT_WIDTHS`` records of ``times`` and its relative error
    on every record. ``variant``: 'unique' (the unique-expert term as ``spec`` routes),
    'one_rate' (its experts' bytes at the dense rate), 'flat' (verification priced as if it
    touched a decode step's experts: the MoE as a dense model of its active size)."""
    import numpy as np

    from specrl.costmodel.cost import expert_bytes_read
    from specrl.costmodel.fit import Record, design, relative_nnls

    records = [Record(b, t, float(CONTEXT), s, "decode" if t == 1 else "verify")
               for (b, t), s in times.items()]  # fmt: skip
    x, y = design(spec, records)
    if variant == "one_rate":
        x[:, 1] += x[:, 6]
        x[:, 6] = 0.0
    elif variant == "flat":  # a token's k experts per row, however many tokens verify
        x[:, 6] = [expert_bytes_read(spec, 1) * r.batch_size for r in records]
    fit = np.array([r.tokens_per_seq in FIT_WIDTHS for r in records])
    coef = relative_nnls(x[fit], y[fit])
    err = x @ coef / y - 1
    held = ~fit
    return {"coefficients": coef.tolist(), "mape_fit": float(np.abs(err[fit]).mean()),
            "mape_heldout": float(np.abs(err[held]).mean()),
            "max_abs_error_heldout": float(np.abs(err[held]).max()),
            "error": {f"b{r.batch_size}_t{r.tokens_per_seq}": float(e)
                      for r, e in zip(records, err, strict=True)}}  # fmt: skip


def cost(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from specrl.models.checkpoints import load_model
    from specrl.models.precision import resolve_precision
    from specrl.spec.controller import measure_popularity, model_spec

    dtype = torch.bfloat16 if resolve_precision("auto", torch.device("cpu")) == "bf16" else None
    dtype = dtype or torch.float32
    widths = range(1, args.k_max + 2)
    models = {"dense": "smollm2-135m-instruct",
              "moe": str(upcycled(args.work, args.experts, args.top_k))}  # fmt: skip
    out: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "context": CONTEXT,
                           "batches": list(BATCHES), "widths": list(widths)}  # fmt: skip
    for name, path in models.items():
        model = load_model(path, dtype=dtype)
        times = timed_forwards(model, widths, args.repeats)
        ratio = {f"b{b}": {f"k{t - 1}": times[b, t] / times[b, 1] for t in widths[1:]}
                 for b in BATCHES}  # fmt: skip
        seconds = {f"b{b}_t{t}": s for (b, t), s in times.items()}
        entry: dict[str, Any] = {"model": path, "seconds": seconds, "verify_over_decode": ratio}
        if model.config.is_moe:
            popularity = measure_popularity(model)
            entry["popularity"] = popularity
            spec = model_spec(model, popularity)
            entry["fits"] = {v: fit_errors(spec, times, v) for v in ("unique", "one_rate", "flat")}
        if model.config.is_moe:
            entry["controller"] = controller_vs_plain(model, path, dtype, args)
        out[name] = entry
        del model
    return out


def controller_vs_plain(model, path: str, dtype, args: argparse.Namespace) -> list[dict]:
    """Tokens/s of the engine with the speculation controller over plain decoding, per batch
    and drafter, runs interleaved over ``args.repeats`` rounds (best kept)."""
    from specrl.bench import GenerateBench, bench_prompts, specrl_runner
    from specrl.models.checkpoints import load_tokenizer
    from specrl.spec.config import SpecConfig

    tok = load_tokenizer(path)
    b = GenerateBench(model=path, dtype=dtype, new_tokens=128)
    rows = []
    for batch in BATCHES:
        prompts = bench_prompts(tok, batch)
        runners = {"none": specrl_runner(model, prompts, b, SpecConfig("none", 0))}
        for method in ("ngram", "suffix"):
            spec = SpecConfig(method, args.k_max, adaptive=True)
            runners[method] = specrl_runner(model, prompts, b, spec)
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
        for _ in range(args.repeats):
            for name, run in runners.items():
                t0 = time.perf_counter()
                tokens, accept = run()
                runs[name].append((tokens / (time.perf_counter() - t0), accept))
        best = {name: max(r for r, _ in rates) for name, rates in runs.items()}
        median = {name: statistics.median(r for r, _ in rates) for name, rates in runs.items()}
        for name, rates in runs.items():
            rows.append({"batch_size": batch, "spec": name, "tokens_per_s": best[name],
                         "over_plain": best[name] / best["none"],
                         "median_over_plain": median[name] / median["none"],
                         "tokens_per_s_runs": [r for r, _ in rates],
                         "acceptance_length": statistics.mean(a for _, a in rates)})  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
