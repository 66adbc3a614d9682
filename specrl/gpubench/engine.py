"""The check's ``engine`` section: specrl's engine in bf16 on a random Llama-3.1-8B.

Contract: ``engine_section(device, smoke, floors, mode, deadline, guard, out)`` returns the
section's dict (layout in docs/gpu.md): (a) decode step time at each batch for specrl's engine
with ``step_graphs=mode``, with ``"off"`` and for transformers' static-cache ``generate``, against
the floor (weight bytes / ``floors``' copy bandwidth); (b) a verify step at k drafts against a
decode step; (c) rollouts with an oracle drafter at set acceptance lengths against plain
(``rollouts``); the engine's step records of (a) and (b) as a calibration trace (``specrl
simulate calibrate``). Points run in priority order, each through ``guard(name, fn)``, skipped
once ``deadline`` (``perf_counter``) passes.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specrl.engine import Engine
from specrl.gpubench.common import inference_model, ratio, seconds
from specrl.gpubench.oracle import fixed_spec
from specrl.gpubench.rollouts import requests, rollout_batch
from specrl.gpubench.sizes import ENGINE_GPU, ENGINE_SMOKE, EngineSizes
from specrl.gpubench.trace import trace_document
from specrl.models.device import synchronize
from specrl.models.transformer import Transformer
from specrl.rollout_types import StepRecord

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

Guard = Callable[[str, Callable[[], dict]], dict]
# the run summary's keys from this section (``section_summary``)
ENGINE_KEYS = ("decode_bs1_over_floor", "decode_bs64_over_transformers",
               "verify_k3_bs1_over_decode", "oracle_al3.3_bs1_speedup")  # fmt: skip
CONTENDERS = ("specrl", "specrl_off", "transformers")  # (a): step_graphs=mode, "off", theirs
MAX_PAIRS_FACTOR = 4  # (a): extra (short, long) pairs while the step estimate is not positive


@dataclass
class Points:
    """Runs points in priority order, each guarded, skipping those the deadline has passed."""

    deadline: float
    guard: Guard
    skipped: list[str] = field(default_factory=list)

    def run(self, name: str, fn: Callable[[], dict], needs_s: float = 0.0) -> dict:
        """``guard(name, fn)``, or skipped when less than ``needs_s`` is left."""
        if time.perf_counter() + needs_s > self.deadline:
            self.skipped.append(name)
            return {"skipped": "deadline"}
        return self.guard(name, fn)


def median_time(records: list[StepRecord], batch: int, tokens: int) -> float | None:
    """The median step time of ``records`` of ``batch`` rows and ``tokens`` per row."""
    times = [r.step_time_s for r in records if (r.batch_size, r.tokens_per_seq) == (batch, tokens)]
    return statistics.median(times) if times else None


# --------------------------------------------------------------------------- (a) decode


def step_times(
    call: Callable[[int], Any], z: EngineSizes, device: torch.device, deadline: float
) -> dict:
    """A warm-up ``call(long)``, then (short, long) pairs: the per-step time
    (T(long) - T(short)) / (long - short) of the fastest call of each length (the prefill, the
    first token and per-call costs cancel; interference only ever adds time, so the fastest is
    the least disturbed). Pairs run until ``z.repeats``, and on while that estimate is not
    positive (a noisy host: up to ``MAX_PAIRS_FACTOR`` times as many), both stopping at the
    deadline."""
    warmup_s, _ = seconds(partial(call, z.long_tokens), device)
    shorts: list[float] = []
    longs: list[float] = []

    def estimate() -> float:
        return (min(longs) - min(shorts)) / (z.long_tokens - z.short_tokens)

    def more() -> bool:
        if not longs:
            return True
        if time.perf_counter() >= deadline:
            return False
        if len(longs) < z.repeats:
            return True
        return estimate() <= 0 and len(longs) < MAX_PAIRS_FACTOR * z.repeats

    while more():
        shorts.append(seconds(partial(call, z.short_tokens), device)[0])
        longs.append(seconds(partial(call, z.long_tokens), device)[0])
    return {"step_s": estimate(), "warmup_s": warmup_s, "short_s": shorts, "long_s": longs,
            "new_tokens": [z.short_tokens, z.long_tokens]}  # fmt: skip


def engine_decode(
    engine: Engine,
    prompt: list[int],
    batch: int,
    z: EngineSizes,
    deadline: float,
    trace: list[StepRecord],
) -> dict:
    """specrl's decode step at ``batch`` rows (``step_times``, step records on), and the median
    decode record (sampling and bookkeeping included); the last long call's records to
    ``trace``."""

    def call(n: int) -> None:
        out = engine.generate(requests(prompt, batch, n))
        assert all(len(c.token_ids) == n for c in out), "a row stopped early"

    engine.record_steps = True
    try:
        row = step_times(call, z, engine.device, deadline)
    finally:
        engine.record_steps = False
    decode = [r for r in engine.stats.step_records if r.kind == "decode"]
    trace += decode
    return row | {
        "step_graphs": engine.step_graphs,
        "tokens_per_s": batch / row["step_s"],
        "record_step_s": median_time(decode, batch, 1),
        "record_batch_sizes": sorted({r.batch_size for r in decode}),
        "mean_context": statistics.fmean(r.context_len for r in decode),
    }


def transformers_model(model: Transformer, device: torch.device) -> LlamaForCausalLM:
    """transformers' ``LlamaForCausalLM`` in bf16 on ``device`` holding ``model``'s weights (no
    end-of-sequence token: every row runs to ``max_new_tokens``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specrl.models.checkpoints import hf_state_dict

    config = model.config
    hf_config = LlamaConfig(**(config.to_hf_dict() | {"eos_token_id": None}))
    with torch.device(device):
        hf = LlamaForCausalLM._from_config(hf_config, dtype=torch.bfloat16)
    hf.load_state_dict(hf_state_dict(model), strict=not config.tie_word_embeddings)
    return hf.eval().requires_grad_(False)


@torch.inference_mode()
def same_logits(model: Transformer, hf: LlamaForCausalLM, prompt: list[int]) -> dict:
    """Both models' last-position logits on a prefix of ``prompt`` (the same weights: equal up
    to bf16 rounding)."""
    ids = torch.tensor([prompt[:16]], device=hf.device)  # [1, T]
    positions = torch.arange(ids.shape[1], device=ids.device)[None]  # [1, T]
    ours = model(ids, positions).logits[0, -1].float()  # [V]
    theirs = hf(input_ids=ids).logits[0, -1].float()  # [V]
    diff = float((ours - theirs).abs().max())
    return {"logits_max_abs_diff": diff, "logits_max_abs": float(ours.abs().max())}


def transformers_decode(
    hf: LlamaForCausalLM, prompt: list[int], batch: int, z: EngineSizes, deadline: float
) -> dict:
    """transformers' static-cache ``generate`` (sampling at temperature 1, compiled as
    ``generate`` does it on CUDA: ``torch.compile`` of the decode forward, reduce-overhead) at
    ``batch`` rows: ``step_times``; the warm-up compiles."""
    ids = torch.tensor([prompt] * batch, device=hf.device)  # [B, P]

    def call(n: int) -> None:
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                          temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=n,
                          cache_implementation="static", pad_token_id=0)  # fmt: skip
        assert out.shape == (batch, len(prompt) + n), "a row stopped early"

    row = step_times(call, z, hf.device, deadline)
    return row | {"tokens_per_s": batch / row["step_s"], "cache_implementation": "static"}


# --------------------------------------------------------------------------- (b) verify


def verify_point(
    engine: Engine, prompt: list[int], batch: int, k: int, z: EngineSizes, trace: list
) -> dict:
    """A verify step of ``batch`` rows with k drafts each (``FixedProposer``, k fixed): the
    median verify record (the k+1-token forward, the rejection sampler, bookkeeping) of one
    timed call after a warm-up call; its verify records to ``trace``."""
    spec = fixed_spec(k, z.model.vocab_size)
    reqs = requests(prompt, batch, z.verify_tokens)
    engine.generate(reqs, spec=spec)  # warm-up: captures this batch's verify step
    engine.record_steps = True
    try:
        call_s, _ = seconds(partial(engine.generate, reqs, spec=spec), engine.device)
    finally:
        engine.record_steps = False
    records = [r for r in engine.stats.step_records if r.kind == "verify"]
    trace += records
    full = sum(r.tokens_per_seq == k + 1 for r in records)
    return {"verify_s": median_time(records, batch, k + 1), "verify_steps": full, "call_s": call_s}


# --------------------------------------------------------------------------- the section


def weight_bytes(model: Transformer) -> int:
    """Bytes of weights a decode step reads: every parameter once, less the input embedding
    table when it is not the head's (a step gathers B of its rows)."""
    total = sum(p.nbytes for p in model.parameters())
    return total - (0 if model.config.tie_word_embeddings else model.embed.weight.nbytes)


def floor_of(model: Transformer, floors: dict | None) -> dict:
    """The run's decode floor: weight bytes over the measured copy bandwidth."""
    bandwidth = (floors or {}).get("copy_bandwidth_bytes_s")
    wb, kv = weight_bytes(model), model.new_cache(1, 1).nbytes
    return {"weight_bytes": wb, "kv_bytes_per_token": kv, "copy_bandwidth_bytes_s": bandwidth,
            "floor_s": wb / bandwidth if bandwidth else None}  # fmt: skip


def decode_row(batch: int, floor: dict, points: dict[tuple[int, str], dict]) -> dict:
    """One batch's decode contenders side by side (``points`` keyed by (batch, contender)),
    with the floor (weights only, and weights plus the KV cache read at the mean context)."""
    row: dict[str, Any] = {"batch_size": batch, "floor_s": floor["floor_s"]}
    for name in CONTENDERS:
        if (batch, name) in points:
            row[name] = points[batch, name]
    step = {name: row.get(name, {}).get("step_s") for name in CONTENDERS}
    context = row.get("specrl", {}).get("mean_context")
    kv = batch * context * floor["kv_bytes_per_token"] if context else None
    bandwidth = floor["copy_bandwidth_bytes_s"]
    return row | {
        "floor_with_kv_s": (floor["weight_bytes"] + kv) / bandwidth if kv and bandwidth else None,
        "specrl_over_floor": ratio(step["specrl"], floor["floor_s"]),
        "specrl_off_over_floor": ratio(step["specrl_off"], floor["floor_s"]),
        "transformers_over_specrl": ratio(step["transformers"], step["specrl"]),
        "specrl_off_over_specrl": ratio(step["specrl_off"], step["specrl"]),
    }


def trace_of(
    records: list[StepRecord], device: torch.device, z: EngineSizes, mode: str, out: Path
) -> dict:
    """The decode and verify records as a calibration trace, each record's ``config`` its
    batch size; in smoke the tiny model's spec is written beside ``out``."""
    rows = [r.to_json() | {"config": f"bs{r.batch_size}"} for r in records]
    meta = {"step_graphs": mode, "prompt_tokens": z.prompt}
    return trace_document(rows, device, z.model, z.model_name, out, meta)


def section_summary(decode: list[dict], verify: list[dict], rollouts: list[dict]) -> dict:
    """The run summary's engine keys (None for what was not measured)."""
    by_batch = {r["batch_size"]: r for r in decode}
    k3 = next((r for r in verify if (r.get("batch_size"), r.get("k")) == (1, 3)), {})
    al = next((r for r in rollouts if r["config"] == "al3.3_bs1"), {})
    values = (
        by_batch.get(1, {}).get("specrl_over_floor"),
        by_batch.get(64, {}).get("transformers_over_specrl"),
        k3.get("over_decode"),
        al.get("speedup"),
    )
    return dict(zip(ENGINE_KEYS, values, strict=True))


def new_engine(model: Transformer, z: EngineSizes, mode: str) -> Engine:
    """An engine for every point of the section: rows up to the largest batch, a context of
    the prompt, the longest call and a verify step's margin."""
    ks = [k for _, k in z.verify_points] + [z.rollout_k]
    batches = [*z.batches, *(b for b, _ in z.verify_points), *z.rollout_batches]
    longest = max(z.long_tokens, z.verify_tokens, z.rollout_tokens)
    context = z.prompt + longest + max(ks) + 2
    return Engine(model, max_batch=max(batches), max_context=context, step_graphs=mode)


def specrl_points(
    model: Transformer,
    prompt: list[int],
    z: EngineSizes,
    mode: str,
    pts: Points,
    points: dict[tuple[int, str], dict],
    trace: list[StepRecord],
) -> tuple[list[dict], list[dict]]:
    """(a), (b) and (c) on an engine with ``step_graphs=mode`` (its records to ``trace``), then
    (a) on one with 'off': the verify and rollout rows."""
    engine = new_engine(model, z, mode)
    for b in z.batches:
        fn = partial(engine_decode, engine, prompt, b, z, pts.deadline, trace)
        points[b, "specrl"] = pts.run(f"decode {mode} bs{b}", fn)
    verify = []
    for b, k in z.verify_points:
        fn = partial(verify_point, engine, prompt, b, k, z, trace)
        verify.append({"batch_size": b, "k": k} | pts.run(f"verify k{k} bs{b}", fn))
    rollouts = []
    for b in z.rollout_batches:
        out = pts.run(f"rollouts bs{b}", partial(rollout_batch, engine, prompt, b, z, pts.deadline))
        rollouts += out.pop("rows", None) or [{"config": f"bs{b}", "batch_size": b} | out]
    del engine
    if mode != "off":
        engine = new_engine(model, z, "off")
        for b in z.batches:
            fn = partial(engine_decode, engine, prompt, b, z, pts.deadline, [])
            points[b, "specrl_off"] = pts.run(f"decode off bs{b}", fn)
        del engine
    gc.collect()  # the engines' caches (and captured graphs), before transformers' model
    return verify, rollouts


def transformers_points(
    model: Transformer,
    prompt: list[int],
    z: EngineSizes,
    pts: Points,
    points: dict[tuple[int, str], dict],
) -> dict:
    """transformers' model with ``model``'s weights (checked on one forward), then (a) for it;
    a batch after the first starts only with the first one's time left (it may compile again)."""
    t0 = time.perf_counter()
    hf = transformers_model(model, model.embed.weight.device)
    info = {"build_s": time.perf_counter() - t0, **same_logits(model, hf, prompt)}
    needs_s = 0.0
    for b in z.transformers_batches:
        fn = partial(transformers_decode, hf, prompt, b, z, pts.deadline)
        points[b, "transformers"] = pts.run(f"decode transformers bs{b}", fn, needs_s)
        needs_s = needs_s or points[b, "transformers"].get("seconds", 0.0)
    return info


def engine_section(
    device: torch.device,
    smoke: bool,
    floors: dict | None,
    mode: str,
    deadline: float,
    guard: Guard,
    out: Path,
) -> dict:
    """The section (module docstring); ``out`` is the result's path (smoke's model spec goes
    beside it)."""
    z = ENGINE_SMOKE if smoke else ENGINE_GPU
    pts = Points(deadline, guard)
    t0 = time.perf_counter()
    model = inference_model(z.model, device, torch.bfloat16)
    synchronize(device)
    build_s = time.perf_counter() - t0
    rng = random.Random(0)
    prompt = [rng.randrange(2, z.model.vocab_size) for _ in range(z.prompt)]
    points: dict[tuple[int, str], dict] = {}
    trace: list[StepRecord] = []
    verify, rollouts = specrl_points(model, prompt, z, mode, pts, points, trace)
    hf = pts.run("transformers", partial(transformers_points, model, prompt, z, pts, points))
    torch._dynamo.reset()  # transformers' compiled forward held its model
    gc.collect()
    floor = floor_of(model, floors)
    decode = [decode_row(b, floor, points) for b in sorted({b for b, _ in points})]
    decode_s = {r["batch_size"]: r.get("specrl", {}).get("record_step_s") for r in decode}
    for r in verify:
        r |= {"decode_s": decode_s.get(r["batch_size"])}
        r |= {"over_decode": ratio(r.get("verify_s"), r["decode_s"])}
    return {
        "sizes": asdict(z),
        "dtype": "bf16",
        "step_graphs": mode,
        "build_s": build_s,
        "floor": floor,
        "decode": decode,
        "verify": verify,
        "rollouts": rollouts,
        "transformers": hf,
        "skipped": pts.skipped,
        "summary": section_summary(decode, verify, rollouts),
        "trace": trace_of(trace, device, z, mode, out),
    }
