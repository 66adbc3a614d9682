"""specrl on one GPU in one script and one JSON: floors, engine steps, learner, GRPO, exactness.

Usage (on the GPU machine, from the repository root; at most 7 minutes on one H200):
    python3 benchmarks/gpu_check.py --out benchmarks/results/gpu_check.json
Smoke test, the same code path on the CPU in seconds (a CI test: tests/test_gpu_check.py):
    python benchmarks/gpu_check.py --smoke [--out /tmp/gpu_check_smoke.json]
Without CUDA and without ``--smoke`` the script exits 2 with one line. docs/gpu.md has the exact
device command (wheels from benchmarks/gpu_wheels.sh: the GPU machine has no pydantic/tomlkit).

What it measures, in this order in the JSON (each section timed with ``synchronize``, warm-up
runs first, the median of the timed repeats; a section that fails is recorded as ``"error"`` with
its traceback and the others still run; a time budget, ``--budget-s``, stops repeats early):
- ``floors``: this run's own ceilings: device-to-device copy bandwidth (read + write bytes/s of a
  4 GiB float32 copy, far beyond any cache) and a bf16 8192^3 matmul's FLOP/s (against the
  datasheet peak, ``specrl.models.device.peak_flops``).
- ``engine`` (benchmarks/gpu_engine.py; right after the exactness tests, with 0.6 of the time
  left then): specrl's ``Engine`` in bf16 on a random model with Llama-3.1-8B's shapes
  (``gpu_calibrate.LLAMA_8B``), B rows sampling (temperature 1) one 512-token random prompt.
  (a) decode step time at B = 1, 8, 64, 256, (T(64 new tokens) - T(16)) / 48 over whole
  ``generate`` calls (the fastest of 3 after a warm-up call), for ``step_graphs=--step-graphs``
  (capture), for ``off`` and for transformers' static-cache ``generate`` (the same weights,
  compiled as ``generate`` compiles on CUDA), against the floor: weight bytes / the floors'
  copy bandwidth. (b) a verify step with k = 3, 5, 7 drafts at B = 1, 64, 256 over a decode
  step (median step records). (c) 256-token rollouts at B = 1, 64 with an oracle drafter (k =
  5) at acceptance lengths 2.0, 2.8, 3.3 against plain (sample-exact: the same tokens,
  checked). The step records of (a) and (b) form a calibration trace (``engine.trace``).
  Points run in that order, then (a) with ``off``, then transformers (B = 64 first); a point
  is skipped once the section's deadline passes, a transformers point after the first also
  when less than the first one's time is left. Estimated on an H200: ~5 s to build the model,
  ~15 s (a), ~20 s (b), ~20 s (c), ~25 s (a) with ``off``, then transformers ~10 s to build,
  ~1 min to compile and ~10 s at B = 64: ~2.5-3 min. Its B = 8 and 256 need a second compile
  (dynamic in the batch; ~25 s of prefills at 256) and B = 1 a third (dynamo specialises a
  batch of 1): ~2-3 more minutes, so on the default budget expect them skipped.
- ``learner``: one GRPO learner step on a random model with Llama-3.2-1B's shapes (hidden 2048,
  16 layers, 32/8 heads of 64, MLP 8192, vocabulary 128256, tied embeddings; RoPE theta 500000
  without llama3 scaling: the same FLOPs), 64 sequences of 256 prompt + 512 completion tokens
  (8 groups of 8, on-policy, micro-batches of 16 sequences): specrl's ``Learner`` in bf16
  ``autocast`` and ``params`` modes against transformers' ``LlamaForCausalLM`` (sdpa, float32
  weights under bf16 autocast, fused AdamW) doing the same step: a padded forward, float32
  log-softmax at the completion positions, the clipped policy-gradient loss, backward, gradient
  clipping, AdamW. tokens/s (forward tokens), model TFLOP/s and MFU by the same convention
  (``specrl.models.flops``: 6 x trunk parameters x tokens + 6 x head parameters x completion
  positions), and specrl's best mode over transformers.
- ``grpo``: colocated GRPO steps (``build_run`` on the device: the learner and the rollout
  engine's own bf16 copy on one GPU) of a random model with SmolLM2-360M's shapes on a
  synthetic task (random prompt ids, reward = share of completion ids divisible by 4; no
  reasoning-gym), 8 prompts x 8 completions of 128 new tokens. Every step rolls the same
  prompts out, with the same request seeds and sample-exact verification (identical tokens,
  checked, so the learner step is the same): plain; with an oracle drafter
  (``benchmarks/reasoning_spec_vs_plain.OracleProposer``: drafts the plain rollout's tokens,
  each kept with probability ``--oracle-accept``); and with an EAGLE-3 head trained online from
  scratch during the run (``drafter.mode=online``; its acceptance on random weights is what it
  is, reported as measured). Per variant: generation seconds, step seconds (generation + the
  learner step and weight push; the head's step also pays its training), generation's share of
  the plain step, acceptance.
- ``exactness``: the tiny-model exactness tests (``EXACTNESS_FILES``: tests/spec/test_verify.py,
  tests/engine/test_spec_engine.py and the captured steps' tests, parametrised over devices) on
  CUDA (``-k cuda``) in a pytest subprocess; passed / failed counts. It runs right after the
  floors, before the long sections, so that a slow section cannot crowd it out of the budget.
``summary``: gpu, decode_bs1_over_floor (specrl's step / the floor), decode_bs64_over_transformers
(transformers' step / specrl's: > 1 is specrl faster), verify_k3_bs1_over_decode,
oracle_al3.3_bs1_speedup (plain rollout time / oracle rollout time), learner_mfu_1b,
learner_over_transformers, grpo_generation_share, grpo_spec_step_speedup (plain step /
oracle-speculation step), exactness_tests_passed.
``--smoke`` shrinks every size (tiny models, a few short sequences, the CPU exactness subset
``-k "cpu and greedy"``) and writes to a temporary file by default.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(REPO), str(REPO / "benchmarks")) if p not in sys.path]

import torch  # noqa: E402
from gpu_engine import ENGINE_KEYS, engine_section  # noqa: E402

from specrl.bench import check_writable, run_metadata  # noqa: E402
from specrl.engine.engine import STEP_GRAPHS  # noqa: E402
from specrl.errors import one_line  # noqa: E402
from specrl.fsutil import atomic_write  # noqa: E402
from specrl.models.config import ModelConfig  # noqa: E402
from specrl.models.device import (  # noqa: E402
    DeviceError,
    autocast,
    peak_flops,
    resolve_device,
    synchronize,
)
from specrl.models.transformer import Transformer  # noqa: E402

RESULT = REPO / "benchmarks" / "results" / "gpu_check.json"
SUMMARY_KEYS = (
    "gpu",
    *ENGINE_KEYS,
    "learner_mfu_1b",
    "learner_over_transformers",
    "grpo_generation_share",
    "grpo_spec_step_speedup",
    "exactness_tests_passed",
)
# Not installed on the GPU machine (docs/gpu.md): no path of this script may import them.
ABSENT_ON_GPU = ("reasoning_gym", "gguf", "vllm", "ray")
ENGINE_SHARE = 0.6  # of the time left after the exactness tests, for the engine section
EXACTNESS_FILES = (
    "tests/spec/test_verify.py",
    "tests/engine/test_spec_engine.py",
    "tests/engine/test_static_steps.py",  # captured == uncaptured, greedy token for token
    "tests/spec/test_verify_hints.py",  # the hinted sampler and verifier inside a CUDA graph
    "tests/test_sampling_hints.py",
)
CLOSING_LINE = re.compile(r"^=+ (.*\d+ (?:passed|failed|error|skipped|deselected).*) =+$", re.M)

LLAMA_3_2_1B = ModelConfig(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)
SMOLLM2_360M = ModelConfig(
    vocab_size=49152,
    hidden_size=960,
    intermediate_size=2560,
    num_layers=32,
    num_heads=15,
    num_kv_heads=5,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
TINY = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


@dataclass(frozen=True)
class Sizes:
    """Every size of the run: the GPU's, or ``--smoke``'s."""

    budget_s: float
    copy_bytes: int
    gemm_n: int
    floor_repeats: int
    learner_model: ModelConfig
    learner_groups: int  # GRPO groups of the learner batch
    learner_group: int  # sequences per group (one prompt)
    learner_prompt: int
    learner_completion: int
    micro_seqs: int  # sequences per micro-batch (both learners)
    learner_repeats: int
    grpo_model: ModelConfig
    prompts: int
    group: int
    grpo_prompt: int
    new_tokens: int
    grpo_steps: int  # timed steps, after one warm-up step
    exactness_k: str
    exactness_timeout_s: float


GPU = Sizes(
    budget_s=390,
    copy_bytes=4 << 30,
    gemm_n=8192,
    floor_repeats=10,
    learner_model=LLAMA_3_2_1B,
    learner_groups=8,
    learner_group=8,
    learner_prompt=256,
    learner_completion=512,
    micro_seqs=16,
    learner_repeats=3,
    grpo_model=SMOLLM2_360M,
    prompts=8,
    group=8,
    grpo_prompt=64,
    new_tokens=128,
    grpo_steps=3,
    exactness_k="cuda",
    exactness_timeout_s=150,
)
SMOKE = Sizes(
    budget_s=300,
    copy_bytes=16 << 20,
    gemm_n=256,
    floor_repeats=3,
    learner_model=TINY,
    learner_groups=2,
    learner_group=2,
    learner_prompt=8,
    learner_completion=8,
    micro_seqs=2,
    learner_repeats=2,
    grpo_model=TINY,
    prompts=2,
    group=2,
    grpo_prompt=6,
    new_tokens=8,
    grpo_steps=1,
    exactness_k="cpu and greedy",
    exactness_timeout_s=240,
)


# --------------------------------------------------------------------------- plumbing


class Clock:
    """The run's time budget and its progress lines (stderr)."""

    def __init__(self, budget_s: float) -> None:
        self.start, self.budget_s = time.perf_counter(), budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def deadline(self, share: float, reserve: float = 0.0) -> float:
        """A ``perf_counter`` deadline ``share`` of what is left after ``reserve`` seconds."""
        return time.perf_counter() + max(0.0, self.left() - reserve) * share

    def log(self, msg: str) -> None:
        print(f"[gpu_check {self.elapsed():6.1f}s] {msg}", file=sys.stderr, flush=True)


def guarded(clock: Clock, name: str, fn: Callable[[], dict]) -> dict:
    """``fn()``'s result with its seconds, or its error (one line and the traceback's tail):
    one failed section or row never stops the others."""
    clock.log(f"{name} ...")
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 (recorded, and the run goes on)
        out = {
            "error": f"{type(e).__name__}: {one_line(e)}",
            "traceback": traceback.format_exc()[-3000:],
        }
    out["seconds"] = time.perf_counter() - t0
    clock.log(f"{name}: {out.get('error', 'done')} ({out['seconds']:.1f}s)")
    free_memory()
    return out


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed(
    fn: Callable[[], object],
    device: torch.device,
    repeats: int,
    warmup: int = 1,
    deadline: float = math.inf,
) -> list[float]:
    """Seconds of each timed call of ``fn`` (synchronised), after ``warmup`` untimed ones;
    repeats stop at ``deadline`` once one call is timed."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times: list[float] = []
    while len(times) < repeats and (not times or time.perf_counter() < deadline):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def median_of(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return float(statistics.median(values)) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def random_model(config: ModelConfig, device: torch.device, seed: int = 0) -> Transformer:
    """A float32 ``Transformer`` built on ``device``: matrices ~ N(0, 0.02) (transformers'
    initializer_range), norms 1."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    return model


def model_flops(config: ModelConfig, tokens: int, positions: int) -> float:
    """``specrl.models.flops.train_flops`` from the shapes alone (for the transformers row)."""
    head = config.vocab_size * config.hidden_size
    trunk = config.num_parameters() - head * (1 if config.tie_word_embeddings else 2)
    return 6.0 * trunk * tokens + 6.0 * head * positions


# --------------------------------------------------------------------------- floors


def floors(device: torch.device, s: Sizes) -> dict:
    """Copy bandwidth and bf16 matmul FLOP/s, measured now on ``device``."""
    src = torch.ones(s.copy_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    copy_s = statistics.median(timed(lambda: dst.copy_(src), device, s.floor_repeats))
    n = s.gemm_n
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    gemm_s = statistics.median(timed(lambda: a @ b, device, s.floor_repeats, warmup=2))
    flops, peak = 2 * n**3 / gemm_s, peak_flops(device)
    return {
        "copy_bytes": s.copy_bytes,
        "copy_bandwidth_bytes_s": 2 * s.copy_bytes / copy_s,  # read + write
        "gemm_n": n,
        "gemm_bf16_flops": flops,
        "peak_bf16_flops": peak,
        "gemm_fraction_of_peak": ratio(flops, peak),
    }


# --------------------------------------------------------------------------- learner (d)


@dataclass(frozen=True)
class LearnerBatch:
    """The GRPO batch both learners train on: equal-length sequences (no padding)."""

    prompts: list[list[int]]  # one per sequence (a group repeats its prompt)
    completions: list[list[int]]
    advantages: list[float]

    @property
    def tokens(self) -> int:
        return sum(len(p) + len(c) for p, c in zip(self.prompts, self.completions, strict=True))

    @property
    def positions(self) -> int:
        return sum(len(c) for c in self.completions)


def learner_batch(s: Sizes, vocab: int, seed: int = 0) -> LearnerBatch:
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(2, vocab) for _ in range(n)]  # noqa: E731
    prompts, completions, advantages = [], [], []
    for _ in range(s.learner_groups):
        prompt, rewards = ids(s.learner_prompt), [rng.random() for _ in range(s.learner_group)]
        mean, std = statistics.fmean(rewards), statistics.pstdev(rewards) or 1.0
        for r in rewards:
            prompts.append(prompt)
            completions.append(ids(s.learner_completion))
            advantages.append((r - mean) / std)
    return LearnerBatch(prompts, completions, advantages)


def from_compile(e: BaseException) -> bool:
    """Whether ``e`` comes out of torch.compile or flex attention (the failures that the dense
    mask avoids), not from the learner itself."""
    where = "".join(traceback.format_exception(e))
    return any(k in where for k in ("torch/_dynamo", "torch/_inductor", "flex_attention"))


def specrl_row(
    device: torch.device, s: Sizes, batch: LearnerBatch, mode: str, deadline: float
) -> dict:
    """specrl's ``Learner`` (bf16, ``mode``) on ``batch``: the median step's metrics. Where flex
    attention cannot compile, the row is measured again with the dense mask (said in the row)."""
    from specrl.config_training import LearnerCfg
    from specrl.rl import Learner, TrainSample

    samples = [
        TrainSample(p, c, a)
        for p, c, a in zip(batch.prompts, batch.completions, batch.advantages, strict=True)
    ]
    seq_len = s.learner_prompt + s.learner_completion
    model = random_model(s.learner_model, device)
    cfg = LearnerCfg(
        lr=1e-6,
        dtype="bf16",
        bf16_mode=mode,
        share_prompts=False,
        micro_batch_tokens=s.micro_seqs * seq_len,
    )
    learner = Learner(model, cfg, row_len=seq_len)
    row: dict[str, Any] = {
        "learner": "specrl",
        "bf16_mode": mode,
        "attention": model.packed_attention,
    }
    reset_peak(device)
    t0 = time.perf_counter()
    try:
        learner.train_step(samples)  # warm-up: compiles flex attention on CUDA
    except Exception as e:  # noqa: BLE001 (the dense mask is the fallback for flex only)
        if device.type != "cuda" or not from_compile(e):
            raise
        row |= {"attention": "dense", "flex_error": f"{type(e).__name__}: {one_line(e)}"}
        model.packed_attention = "dense"
        learner.train_step(samples)
    row["warmup_s"] = time.perf_counter() - t0
    steps = []
    while len(steps) < s.learner_repeats and (not steps or time.perf_counter() < deadline):
        steps.append(learner.train_step(samples).metrics)
    keys = ("time_s", "tokens_per_s", "model_tflops", "mfu", "forward_tokens")
    return (
        row
        | {k: median_of(steps, k) for k in keys}
        | {
            "timed_steps": len(steps),
            "loss": steps[-1]["loss"],
            "peak_memory_bytes": peak_memory(device),
        }
    )


def transformers_row(device: torch.device, s: Sizes, batch: LearnerBatch, deadline: float) -> dict:
    """transformers' ``LlamaForCausalLM`` (sdpa, float32 weights, bf16 autocast) doing the
    same step: the median step's tokens/s, model TFLOP/s and MFU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**s.learner_model.to_hf_dict())
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(
            config, attn_implementation="sdpa", dtype=torch.float32
        )
    params = list(model.parameters())
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    optimizer = torch.optim.AdamW(params, lr=1e-6, betas=(0.9, 0.99), weight_decay=0.0, **fast)
    p, c = s.learner_prompt, s.learner_completion
    ids = torch.tensor(
        [q + r for q, r in zip(batch.prompts, batch.completions, strict=True)], device=device
    )
    adv = torch.tensor(batch.advantages, device=device)
    keep = torch.arange(p - 1, p + c - 1, device=device)  # the positions predicting completions

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for rows in torch.arange(len(ids), device=device).split(s.micro_seqs):
            with autocast(device, True):
                logits = model(input_ids=ids[rows], logits_to_keep=keep).logits  # [n, C, V]
            logprobs = torch.log_softmax(logits.float(), -1)
            lp = logprobs.gather(-1, ids[rows, p:, None]).squeeze(-1)  # [n, C]
            ratio_ = torch.exp(lp - lp.detach())
            a = adv[rows, None]
            loss = -torch.min(ratio_ * a, ratio_.clamp(0.8, 1.2) * a).sum() / batch.positions
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    reset_peak(device)
    times = timed(step, device, s.learner_repeats, warmup=1, deadline=deadline)
    seconds, peak = statistics.median(times), peak_flops(device)
    flops = model_flops(s.learner_model, batch.tokens, batch.positions) / seconds
    return {
        "learner": "transformers",
        "attention": "sdpa",
        "time_s": seconds,
        "tokens_per_s": batch.tokens / seconds,
        "model_tflops": flops / 1e12,
        "mfu": ratio(flops, peak),
        "forward_tokens": batch.tokens,
        "timed_steps": len(times),
        "peak_memory_bytes": peak_memory(device),
    }


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def learner_section(device: torch.device, s: Sizes, clock: Clock, deadline: float) -> dict:
    """Both specrl modes and transformers on the same batch; each row guarded on its own."""
    batch = learner_batch(s, s.learner_model.vocab_size)
    share = lambda n: time.perf_counter() + max(0.0, deadline - time.perf_counter()) / n  # noqa: E731
    rows = [
        guarded(
            clock,
            "learner specrl autocast",
            lambda: specrl_row(device, s, batch, "autocast", share(3)),
        ),
        guarded(
            clock, "learner specrl params", lambda: specrl_row(device, s, batch, "params", share(2))
        ),
        guarded(
            clock, "learner transformers", lambda: transformers_row(device, s, batch, share(1))
        ),
    ]
    ours = [r for r in rows if r.get("learner") == "specrl" and r.get("tokens_per_s")]
    best = max(ours, key=lambda r: r["tokens_per_s"], default={})
    theirs = next((r for r in rows if r.get("learner") == "transformers"), {})
    return {
        "model": asdict(s.learner_model),
        "sequences": len(batch.prompts),
        "prompt_tokens": s.learner_prompt,
        "completion_tokens": s.learner_completion,
        "micro_batch_sequences": s.micro_seqs,
        "rows": rows,
        "best_specrl_mode": best.get("bf16_mode"),
        "mfu": best.get("mfu"),
        "over_transformers": ratio(best.get("tokens_per_s"), theirs.get("tokens_per_s")),
    }


# --------------------------------------------------------------------------- GRPO (e)


def grpo_overrides(device: torch.device, s: Sizes) -> list[str]:
    """The run config: a head trained online from scratch, sample-exact verification."""
    return [
        "model.name=gpu-check-random",
        f"model.device={device}",
        "rollout.spec=eagle3",
        "rollout.spec_exact=sample",
        "drafter.mode=online",
        f"rollout.group_size={s.group}",
        f"rollout.prompts_per_step={s.prompts}",
        f"rollout.max_new_tokens={s.new_tokens}",
        f"rollout.max_batch={s.prompts * s.group}",
        "rollout.placement=inline",
        f"learner.micro_batch_tokens={4 * s.group * (s.grpo_prompt + s.new_tokens)}",
        "run.eval_every=0",
        "run.checkpoint_every=0",
        f"run.steps={s.grpo_steps + 1}",
    ]


def build_grpo_run(device: torch.device, s: Sizes):
    """``build_run`` with the synthetic env and codec (handed an env, it does not check the
    ``env`` section against reasoning-gym, which the GPU machine lacks)."""
    from specrl.config import load_config
    from specrl.envs.synthetic import IdCodec, ModFourEnv
    from specrl.pipelines.build import build_run

    cfg = load_config(None, grpo_overrides(device, s))
    length = (s.grpo_prompt, s.grpo_prompt + 1)  # every prompt s.grpo_prompt ids long
    train = s.prompts * (s.grpo_steps + 1)
    env = ModFourEnv(train, 0, vocab=s.grpo_model.vocab_size, lengths=length)
    model = random_model(s.grpo_model, device)
    return build_run(cfg, model=model, codec=IdCodec(), env=env)


def grpo_step(parts, stream, oracle, step: int, accept: float, k: int) -> dict:
    """One step's three rollouts of the same prompts (plain, oracle, the run's head) and the
    learner step on the head's rollout (the same tokens under sample-exact verification)."""
    from reasoning_spec_vs_plain import oracle_rollout, plain_rollout

    from specrl.pipelines.state import StepState
    from specrl.pipelines.step import collect, learn

    prompts = stream.draw(step)  # outside every timed window
    plain_s, plain, _ = plain_rollout(parts, prompts, step)
    oracle_s, oracle_acc, oracle_same = oracle_rollout(
        parts, oracle, prompts, step, plain, k, accept
    )
    t0 = time.perf_counter()
    batch = collect(parts, prompts, step)
    head_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    row = learn(parts, StepState(step, step), batch, head_s)  # a fresh run: version = step
    learn_all_s = time.perf_counter() - t1
    drafter_s = row.get("drafter_train_s", 0.0) + row.get("drafter_sync_s", 0.0)
    learn_s = learn_all_s - drafter_s  # the policy's learner step and weight push
    m = batch.metrics
    return {
        "step": step,
        "plain_gen_s": plain_s,
        "oracle_gen_s": oracle_s,
        "head_gen_s": head_s,
        "learn_s": learn_s,
        "drafter_train_s": drafter_s,
        "plain_step_s": plain_s + learn_s,
        "oracle_step_s": oracle_s + learn_s,
        "head_step_s": head_s + learn_all_s,
        "gen_share_of_plain_step": plain_s / (plain_s + learn_s),
        "oracle_acceptance_length": oracle_acc,
        "oracle_same_tokens": oracle_same,
        "head_acceptance_length": m["acceptance_length"],
        "head_draft_acceptance_length": m["draft_acceptance_length"],
        "head_spec_step_share": m["spec_step_share"],
        "head_same_tokens": [c.token_ids for c in plain]
        == [c.token_ids for c in batch.completions],
        "gen_tokens": m["gen_tokens"],
        "reward_mean": m["reward_mean"],
        "learner_tokens_per_s": row.get("learner_tokens_per_s"),
        "learner_mfu": row.get("learner_mfu"),
    }


def summarize_grpo(rows: list[dict]) -> dict:
    total = lambda key: sum(r[key] for r in rows)  # noqa: E731
    plain, learn_s = total("plain_gen_s"), total("learn_s")
    return {
        "generation_share": plain / (plain + learn_s),
        "plain_step_s": total("plain_step_s") / len(rows),
        "oracle_step_s": total("oracle_step_s") / len(rows),
        "head_step_s": total("head_step_s") / len(rows),
        "oracle_step_speedup": total("plain_step_s") / total("oracle_step_s"),
        "head_step_speedup": total("plain_step_s") / total("head_step_s"),
        "oracle_rollout_speedup": plain / total("oracle_gen_s"),
        "head_rollout_speedup": plain / total("head_gen_s"),
        "oracle_acceptance_length": statistics.fmean(r["oracle_acceptance_length"] for r in rows),
        "head_draft_acceptance_length": statistics.fmean(
            r["head_draft_acceptance_length"] for r in rows
        ),
        "same_tokens": all(r["oracle_same_tokens"] and r["head_same_tokens"] for r in rows),
    }


def grpo_section(
    device: torch.device,
    s: Sizes,
    clock: Clock,
    deadline: float,
    accept: float,
    k: int,
    attention: str = "auto",
) -> dict:
    """A warm-up step, then up to ``s.grpo_steps`` timed steps (until ``deadline``); the
    learner's packed attention is ``attention`` ('dense' where flex attention failed)."""
    from specrl.engine import Engine

    parts = build_grpo_run(device, s)
    parts.learner.model.packed_attention = attention
    cfg = parts.cfg
    fraction = cfg.model.gpu_memory_utilization if device.type == "cuda" else None
    oracle = Engine(
        parts.backend.engine.model,
        max_batch=cfg.rollout.max_batch,
        seed=cfg.run.seed,
        memory_fraction=fraction,
    )
    from specrl.pipelines.state import TrainStream

    rows, stream = [], TrainStream.of(parts.plan, parts.env)
    for step in range(s.grpo_steps + 1):
        if step > 1 and time.perf_counter() > deadline:
            break
        rows.append(grpo_step(parts, stream, oracle, step, accept, k))
        r = rows[-1]
        clock.log(
            f"grpo step {step}: gen plain {r['plain_gen_s']:.2f}s oracle "
            f"{r['oracle_gen_s']:.2f}s head {r['head_gen_s']:.2f}s learn {r['learn_s']:.2f}s"
        )
    measured = rows[1:] or rows
    return {
        "model": asdict(s.grpo_model),
        "prompts_per_step": s.prompts,
        "group_size": s.group,
        "prompt_tokens": s.grpo_prompt,
        "max_new_tokens": s.new_tokens,
        "oracle_accept": accept,
        "oracle_max_k": k,
        "learner_attention": attention,
        "warmup_steps": len(rows) - len(measured),
        "summary": summarize_grpo(measured),
        "steps": rows,
    }


# --------------------------------------------------------------------------- exactness (f)


def exactness(s: Sizes, timeout_s: float) -> dict:
    """The exactness tests selected by ``-k s.exactness_k`` in a pytest subprocess."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *EXACTNESS_FILES]
    cmd += ["-k", s.exactness_k]
    # an outer pytest's settings (xdist worker, PYTEST_ADDOPTS) are not this run's
    outer = ("PYTEST_ADDOPTS", "PYTEST_XDIST", "PYTEST_CURRENT")
    env = {k: v for k, v in os.environ.items() if not k.startswith(outer)}
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s
        )
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output, rc = _text(e.stdout) + _text(e.stderr), None
    counts = pytest_counts(output)
    passed = rc == 0 and counts["passed"] > 0 and counts["failed"] == counts["errors"] == 0
    return {
        "command": shlex.join(cmd),
        "returncode": rc,
        "timed_out": rc is None,
        **counts,
        "all_passed": passed,
        "tail": output[-2000:],
    }


def pytest_counts(output: str) -> dict[str, int]:
    """passed / failed / errors / skipped from pytest's closing line (``== 5 passed, 2 failed,
    68 deselected in 2.2s ==``), or, when it never got there (timed out), from the ``-v`` lines
    seen so far (``nodeid PASSED [ 2%]``)."""
    words = {"passed": "passed", "failed": "failed", "errors": "error", "skipped": "skipped"}
    closing = CLOSING_LINE.findall(output)
    if closing:
        line = closing[-1]
        found = lambda w: re.search(rf"(\d+) {w}", line)  # noqa: E731
        return {k: int(m.group(1)) if (m := found(w)) else 0 for k, w in words.items()}
    status = re.findall(r"^\S+::.* (PASSED|FAILED|ERROR|SKIPPED)\b", output, re.M)
    return {k: status.count(w.upper()) for k, w in words.items()}


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


# --------------------------------------------------------------------------- the run


def device_meta(device: torch.device) -> dict:
    meta = {"device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta |= {
            "gpu": props.name,
            "gpu_memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}",
            "peak_bf16_flops": peak_flops(device),
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
        }
    return meta


def flex_failed(learner: dict | None) -> bool:
    """Whether a learner row fell back to the dense mask (flex attention failed there)."""
    return any("flex_error" in row for row in (learner or {}).get("rows", []))


def summarize(result: dict, device: torch.device) -> dict:
    """The summary's keys (None for what was not measured)."""
    learner, grpo = result["learner"] or {}, (result["grpo"] or {}).get("summary", {})
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    engine = (result["engine"] or {}).get("summary", {})
    return {
        "gpu": name or f"{device.type} (smoke)",
        **{k: engine.get(k) for k in ENGINE_KEYS},
        "learner_mfu_1b": learner.get("mfu"),
        "learner_over_transformers": learner.get("over_transformers"),
        "grpo_generation_share": grpo.get("generation_share"),
        "grpo_spec_step_speedup": grpo.get("oracle_step_speedup"),
        "exactness_tests_passed": bool((result["exactness"] or {}).get("all_passed")),
    }


def run(device: torch.device, s: Sizes, args: argparse.Namespace, out: Path) -> dict:
    """Every section (the exactness tests right after the floors), the JSON rewritten after
    each one: a run stopped from outside still leaves what it measured."""
    clock = Clock(args.budget_s or s.budget_s)
    clock.log(f"device {device}, budget {clock.budget_s:.0f}s{' (smoke)' if args.smoke else ''}")
    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    result: dict[str, Any] = {
        "meta": run_metadata(command)
        | device_meta(device)
        | {"smoke": args.smoke, "sizes": asdict(s)},
        "summary": {},
        "floors": None,
        "engine": None,
        "learner": None,
        "grpo": None,
        "exactness": None,
    }
    sections = {
        "floors": lambda: floors(device, s),
        "exactness": lambda: exactness(s, min(s.exactness_timeout_s, 0.5 * clock.left())),
        "engine": lambda: engine_section(
            device,
            args.smoke,
            result["floors"],
            args.step_graphs or ("static" if args.smoke else "capture"),
            clock.deadline(ENGINE_SHARE),
            lambda name, fn: guarded(clock, name, fn),
            out,
        ),
        "learner": lambda: learner_section(device, s, clock, clock.deadline(0.5, reserve=5)),
        "grpo": lambda: grpo_section(
            device,
            s,
            clock,
            clock.deadline(1.0, reserve=5),
            args.oracle_accept,
            args.oracle_k,
            "dense" if flex_failed(result["learner"]) else "auto",
        ),
    }
    for name, fn in sections.items():
        result[name] = guarded(clock, name, fn)
        result["summary"] = summarize(result, device)
        result["meta"] |= {
            "budget_s": clock.budget_s,
            "elapsed_s": clock.elapsed(),
            "sections_done": [k for k in sections if result[k] is not None],
            "imported_absent_on_gpu": sorted(m for m in ABSENT_ON_GPU if m in sys.modules),
        }
        atomic_write(out, json.dumps(result, indent=1))
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="On the GPU machine: python3 benchmarks/gpu_check.py --out "
        "benchmarks/results/gpu_check.json (see docs/gpu.md). On a CPU: --smoke.",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes: the same path in seconds, on the CPU too (a CI test)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"result JSON (default: {RESULT.relative_to(REPO)}; with --smoke a "
        "temporary file, never the committed GPU result)",
    )
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="time budget in seconds (default 390 on a GPU, 300 with --smoke: a ceiling)",
    )
    ap.add_argument(
        "--oracle-accept",
        type=float,
        default=0.8,
        help="per-token acceptance of the oracle drafter (default 0.8)",
    )
    ap.add_argument("--oracle-k", type=int, default=6, help="the oracle's largest k (default 6)")
    ap.add_argument(
        "--step-graphs",
        choices=STEP_GRAPHS,
        default=None,
        help="the engine section's step_graphs (default capture; static with --smoke); its "
        "decode points also run with off",
    )
    args = ap.parse_args(argv)
    if not 0 < args.oracle_accept <= 1:
        ap.error(f"--oracle-accept: {args.oracle_accept} is outside (0, 1]")
    if args.oracle_k < 1:
        ap.error(f"--oracle-k: {args.oracle_k} is not >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        device = resolve_device(args.device)
    except DeviceError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    if device.type != "cuda" and not args.smoke:
        print(
            f"gpu_check: needs a CUDA GPU (device {args.device!r} is {device}); "
            "use --smoke for the CPU smoke test",
            file=sys.stderr,
        )
        return 2
    out = args.out or (
        Path(tempfile.gettempdir()) / "gpu_check_smoke.json" if args.smoke else RESULT
    )
    if args.smoke and out.resolve() == RESULT.resolve():
        print(f"gpu_check: --smoke does not write the committed GPU result {out}", file=sys.stderr)
        return 2
    problem = check_writable(out)
    if problem:
        print(f"gpu_check: {problem}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    result = run(device, SMOKE if args.smoke else GPU, args, out)
    print(f"wrote {out}", file=sys.stderr)
    print(json.dumps(result["summary"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
