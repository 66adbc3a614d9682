"""The vLLM rollout backend: vLLM's engine behind the ``RolloutBackend`` seam (``specrl[vllm]``).

Contract:
- ``VllmBackend(model_dir, dtype=..., spec=..., drafter_dir=..., max_batch=..., seed=...)`` builds
  one ``vllm.LLM`` *in this process* (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core and
  its one worker run here, so weights move by reference, never through a pipe, and no
  ``if __name__ == "__main__"`` guard is needed), ``enforce_eager``. Environment defaults for
  the CPU build are set only where unset: ``VLLM_CPU_KVCACHE_SPACE`` (``kv_cache_gib``),
  ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, ``VLLM_LOGGING_LEVEL=WARNING`` (read when vllm is first
  imported). Building restores what vLLM's worker changes process-wide (it replaces
  ``torch.set_num_threads`` with a no-op and reseeds the global RNGs); ``vllm_worker.patch_vllm``
  lists the process-wide patches of vllm 0.32's CPU build this backend applies.
- ``generate(requests, spec=None)``: each request's ``n`` samples go to vLLM as ``n`` requests with
  the native engine's per-sample seeds (``seed * 1_000_003 + j``; drawn from the backend's RNG
  when unset), ``stop_token_ids`` (the stop token is emitted) and ``ignore_eos`` (like the native
  engine, only the given stop tokens end a completion). ``logprobs``: vLLM's processed logprobs
  (``logprobs_mode="processed_logprobs"``: temperature, top-k, top-p applied), 0.0 for greedy
  tokens (the processed distribution is one-hot, as in the native engine). ``raw_logprobs``
  (temperature 1, untruncated): vLLM's own numbers where they coincide (temperature 0 or 1
  without truncation), else one extra prefill over prompt + completion that reads vLLM's prompt
  logprobs (raw). A request the native engine would reject (bad sampling values, empty prompt,
  out-of-vocabulary id, prompt filling the context) comes back as an ``"error"`` completion; a
  completion stops one token short of the context (room for that prefill). The same seeds
  give the same tokens on the same engine (not the native engine's tokens: the random streams
  differ; nor, in general, those of an engine with other speculative settings).
  Token versions: every token carries the version served when the call started (updates that
  arrive during a call apply after it: no in-flight updates, ``features`` is empty).
- Speculation (``vllm_speculative_config``): specrl's ``ngram`` -> vLLM's ``ngram``
  (``prompt_lookup_max/min`` from the drafter's ``max_n``/``min_n`` options, default 4/2),
  ``draft`` -> ``draft_model`` (a Hugging Face model directory: ``drafter_dir``), ``eagle3`` only
  with a head already in vLLM's EAGLE-3 layout (a directory whose config.json names an Eagle3
  architecture). Everything else raises a one-line ``ValueError`` naming what is unsupported:
  ``suffix`` and ``self`` (native-only drafters), ``mtp`` (vLLM's MTP needs the model's own MTP
  layers), a specrl ``eagle3`` head directory (head.json), ``spec_siblings``. The adaptive-k
  cap (``max_tokens_per_forward``; 'auto' is ``auto_tokens_per_forward``'s fixed cap here, the
  native engine's controller does not drive vLLM) becomes vLLM's per-batch-size schedule
  (``num_speculative_tokens_per_batch_size``: ``SpecConfig.k_for_batch``); a per-call ``spec``
  override of the same method (``none`` included: the end-of-run speed check's plain rollout)
  swaps that schedule for the call; another method raises ``ValueError``.
- Statistics: ``Rollout.stats`` (``EngineStats``) takes drafted/accepted/per-position counts
  from vLLM's own speculative-decoding counters (``LLM.get_metrics()``:
  ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens``,
  ``..._num_accepted_tokens_per_pos``; the call's difference, filtered by this engine's
  ``served_model_name``), so ``pipelines.step``'s ``draft_acceptance_length`` is vLLM's
  ``1 + accepted / drafts``; per completion, ``drafted``/``accepted`` come from vLLM's
  per-request metrics and ``verify_steps`` = tokens - 1 - accepted. Per-position drafted counts
  are exact when every draft had k tokens (ngram, draft model at fixed k), else filled longest
  first (vLLM exports no per-position drafted counter). Phase times (prefill/draft/verify) are
  not exported by vLLM and stay 0. vLLM keeps these counters for the newest engine of a process:
  building a second ``VllmBackend`` in the same process leaves the first one's counts at 0
  (build the one whose acceptance you read last).
- ``update_weights(named, version)``: our parameter names (``models.checkpoints.name_map``) ->
  Hugging Face names -> vLLM's in-place layerwise reload (what ``Worker.reload_weights`` runs:
  every layer reloaded and its weight post-processing re-run), then the tied ``lm_head``'s CPU GEMM
  handle is rebuilt (vLLM 0.32 leaves it packed from the old embedding: a silent stale output
  layer) and the prefix cache is reset (its KV was computed with the old weights). At once when
  idle; during a generate call the tensors are snapshotted (engine dtype) and applied when the
  call ends. ``update_drafter(state, version)``: the same for the draft model (our names of the
  draft ``Transformer``) or an EAGLE-3 head (the head's state dict under specrl's names, ``d2t``
  included with a reduced vocabulary: ``drafters.export.eagle3_tensors`` turns it into vLLM's
  tensors, the draft LM head rebuilt from the policy vLLM serves at that moment, and again
  after every policy update, as the native head shares the target's); a head of another shape
  is a one-line ``ValueError``, as is any other drafter.
- ``served()``: fingerprints (``models.fingerprint``) of the tensors in vLLM's model (and its
  draft model or EAGLE-3 head: ``eagle3_ours`` maps them back to the head's names), under our
  names (vLLM fuses q/k/v and gate/up exactly as specrl does). vLLM's CPU build packs each
  linear weight into a oneDNN handle and drops the parameter; this module keeps the parameter
  (the tensor the handle is packed from, re-packed on every reload) so it can be read.
- ``versions()``, ``state_dict()`` (``{}``), ``load_state_dict``, ``close()`` (idempotent) as in
  ``base``. Thread-safe for one generating thread plus one updating thread: vLLM itself is
  built and called on one engine thread of the backend's own (its CPU attention kernels check
  that the OpenMP thread count is the one their metadata was made with, and a caller's thread
  may have another), so any thread may call the backend.
- ``build_vllm(cfg, policy)``: from a run ``Config`` (``model.name``, ``model.dtype``,
  ``rollout.*``), then the policy's current weights are pushed (version 0), so the engine serves
  exactly ``policy`` even when it differs from the checkpoint on disk.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from specrl.backends.base import Rollout, Served, Versions
from specrl.backends.vllm_worker import (
    forget_reload_records,
    load_drafter,
    load_policy,
    parameters_by_name,
    patch_vllm,
    process_state_kept,
)
from specrl.models.fingerprint import fingerprint
from specrl.rollout_types import Completion, EngineStats, Request, request_problem, sample_seed
from specrl.spec.config import SpecConfig

if TYPE_CHECKING:
    from specrl.config import Config
    from specrl.models.config import ModelConfig

T = TypeVar("T")
ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process (see the docstring)
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",  # vLLM's INFO lines would flood a training console
}
SUPPORTED_SPEC = ("none", "ngram", "draft", "eagle3")
NATIVE_ONLY = {"suffix": "its history spans calls inside specrl's engine",
               "hybrid": "its suffix half's history spans calls inside specrl's engine",
               "self": "layer-skip self-speculation is specrl's"}  # fmt: skip
_METRIC_PREFIX = "vllm:spec_decode_"
_OPTIONAL = (".bias", "q_norm.weight", "k_norm.weight")  # parameters some models lack


def vllm_available() -> bool:
    """Whether ``vllm`` can be imported here (the ``specrl[vllm]`` extra)."""
    import importlib.util

    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a broken or blocked install
        return False


# --------------------------------------------------------------------------- speculation


def _schedule(spec: SpecConfig, max_batch: int) -> list[tuple[int, int, int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size``: (first, last, k) ranges of batch sizes
    with the k ``spec.k_for_batch`` gives (0 = plain steps)."""
    ranges: list[tuple[int, int, int]] = []
    for b in range(1, max_batch + 1):
        k = spec.k_for_batch(b)
        if ranges and ranges[-1][2] == k:
            ranges[-1] = (ranges[-1][0], b, k)
        else:
            ranges.append((b, b, k))
    return ranges


def vllm_speculative_config(
    spec: SpecConfig, max_batch: int, drafter_dir: str | os.PathLike | None = None
) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for specrl's ``spec`` (``None``: plain decoding); a
    one-line ``ValueError`` for anything this backend cannot run (see the module docstring)."""
    method = spec.method
    if not spec.enabled:
        return None
    if method in NATIVE_ONLY:
        raise ValueError(
            f"rollout.spec={method!r} is not supported by the vllm backend "
            f"({NATIVE_ONLY[method]}); use ngram, draft or none there, or rollout.backend=native"
        )
    if method == "mtp":
        raise ValueError(
            "rollout.spec='mtp' is not supported by the vllm backend (vLLM's mtp runs a model's "
            "own MTP layers; specrl's mtp head has no vLLM layout)"
        )
    if method not in SUPPORTED_SPEC:
        raise ValueError(f"rollout.spec={method!r} is not supported by the vllm backend")
    if spec.siblings:
        raise ValueError("rollout.spec_siblings > 0 is not supported by the vllm backend")
    if spec.exact != "distribution":
        raise ValueError(
            f"rollout.spec_exact={spec.exact!r} is not supported by the vllm backend (its "
            "rejection sampler is vLLM's own); use rollout.backend=native"
        )
    out: dict[str, Any] = {"num_speculative_tokens": spec.k}
    if method == "ngram":
        opts = spec.options
        out |= {"method": "ngram", "prompt_lookup_max": int(opts.get("max_n", 4)),
                "prompt_lookup_min": int(opts.get("min_n", 2))}  # fmt: skip
    elif method == "draft":
        if drafter_dir is None or not (Path(drafter_dir) / "config.json").is_file():
            raise ValueError(
                f"rollout.spec='draft' on the vllm backend needs a draft model directory "
                f"(config.json + safetensors), got {drafter_dir!r}"
            )
        out |= {"method": "draft_model", "model": str(drafter_dir)}
    else:  # eagle3
        if drafter_dir is None or not _is_vllm_eagle3(Path(drafter_dir)):
            raise ValueError(
                f"rollout.spec='eagle3' on the vllm backend needs a head in vLLM's EAGLE-3 layout "
                f"(config.json with an Eagle3 architecture), got {drafter_dir!r}; a specrl "
                f"head directory (head.json) must be exported first"
            )
        out |= {"method": "eagle3", "model": str(drafter_dir)}
    out["num_speculative_tokens_per_batch_size"] = _schedule(spec, max_batch)
    return out


def _is_vllm_eagle3(path: Path) -> bool:
    try:
        arch = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return any("eagle3" in str(a).lower() for a in arch)


# --------------------------------------------------------------------------- names


def to_hf(named: Mapping[str, torch.Tensor], config: ModelConfig) -> Iterator[tuple[str, Any]]:
    """Our parameter names -> Hugging Face checkpoint names (fused q/k/v, gate/up split)."""
    from specrl.models.checkpoints import name_map

    for ours, theirs in name_map(config):
        if ours not in named:
            if ours == "lm_head.weight" or ours.endswith(_OPTIONAL):
                continue  # absent in this model (tied head, no bias / qk-norm)
            raise ValueError(f"weight update: no tensor for parameter {ours!r}")
        t = named[ours].detach()
        if len(theirs) == 1:
            yield theirs[0], t
            continue
        if len(theirs) == 3:
            kv = config.num_kv_heads * config.head_dim
            sizes = [config.num_heads * config.head_dim, kv, kv]
        else:
            sizes = [config.intermediate_size, config.intermediate_size]
        if t.shape[0] != sum(sizes):
            raise ValueError(f"weight update: tensor {ours!r} has shape {tuple(t.shape)}")
        yield from zip(theirs, t.split(sizes), strict=True)


def vllm_to_ours(config: ModelConfig) -> dict[str, str]:
    """vLLM's parameter names (fused qkv_proj, gate_up_proj) -> ours."""
    from specrl.models.checkpoints import name_map

    out = {}
    for ours, theirs in name_map(config):
        name = theirs[0]
        if len(theirs) == 3:
            name = name.replace("q_proj", "qkv_proj")
        elif len(theirs) == 2:
            name = name.replace("gate_proj", "gate_up_proj")
        out[name] = ours
    return out


def eagle3_ours(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vLLM's EAGLE-3 drafter parameters (``model.layers.0.*``, fused qkv_proj/gate_up_proj,
    ``draft_id_to_target_id`` offsets) -> an EAGLE-3 head's state under specrl's names (``d2t``
    as target ids); the draft LM head (rows of the policy's) is not the head's own."""
    from specrl.drafters.export import EAGLE3_NAMES

    out: dict[str, torch.Tensor] = {}
    for ours, theirs in EAGLE3_NAMES:
        name = "model." + theirs[0].replace("midlayer.", "layers.0.")
        name = name.replace("q_proj", "qkv_proj") if len(theirs) == 3 else name
        name = name.replace("gate_proj", "gate_up_proj") if len(theirs) == 2 else name
        if name in named:
            out[ours] = named[name].cpu()
    offsets = named.get("draft_id_to_target_id")  # [Vd]: target id = i + offsets[i]
    if offsets is not None:
        out["d2t"] = offsets.cpu() + torch.arange(len(offsets), dtype=offsets.dtype)
    return out


# --------------------------------------------------------------------------- vLLM glue


@dataclass
class _Counters:
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: tuple[int, ...] = ()

    def minus(self, other: _Counters) -> _Counters:
        pos = [a - (other.per_pos[i] if i < len(other.per_pos) else 0)
               for i, a in enumerate(self.per_pos)]  # fmt: skip
        return _Counters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                         self.accepted - other.accepted, tuple(pos))  # fmt: skip


# --------------------------------------------------------------------------- the backend


class VllmBackend:
    """See the module docstring."""

    features: frozenset[str] = frozenset()

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        dtype: torch.dtype = torch.float32,
        spec: SpecConfig | None = None,
        drafter_dir: str | os.PathLike | None = None,
        max_batch: int = 64,
        seed: int = 0,
        max_model_len: int | None = None,
        kv_cache_gib: int = 2,
        policy_version: int = 0,
        engine_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        from specrl.models.checkpoints import load_config

        self._spec = (spec or SpecConfig()).validate()
        self.model_dir = str(model_dir)
        self.config = load_config(Path(model_dir))
        self.drafter_dir = None if drafter_dir is None else str(drafter_dir)
        self._draft_config = (
            load_config(Path(drafter_dir))
            if self._spec.enabled and self._spec.method == "draft" and drafter_dir
            else None
        )
        self._eagle3 = self._spec.enabled and self._spec.method == "eagle3"
        self.dtype = dtype
        self.max_batch = max_batch
        speculative = vllm_speculative_config(self._spec, max_batch, drafter_dir)
        for key, value in ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise ValueError("the vllm backend needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (in-process)")
        patch_vllm()
        from vllm import LLM

        self.name = f"specrl-{uuid.uuid4().hex[:8]}"  # labels this engine's metrics
        kwargs: dict[str, Any] = dict(
            model=self.model_dir,
            served_model_name=self.name,
            dtype=str(dtype).removeprefix("torch."),
            enforce_eager=True,
            logprobs_mode="processed_logprobs",
            seed=seed,
            max_num_seqs=max_batch,
            disable_log_stats=False,
            max_logprobs=1,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if speculative is not None:
            kwargs |= {"speculative_config": speculative,
                       "per_request_spec_decode_metrics": "summary"}  # fmt: skip
        kwargs |= dict(engine_kwargs or {})
        # vLLM's CPU build binds OpenMP state to the thread that builds it (its attention kernels
        # check the thread count their metadata was made with): every call into vLLM runs on
        # this one engine thread, whichever thread calls the backend.
        self._engine = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specrl-vllm")
        self._engine_thread: threading.Thread | None = None
        try:
            self.llm = self._on_engine(self._build, LLM, kwargs)
        except BaseException:
            self._engine.shutdown(wait=False)
            raise
        self.max_context = int(self.llm.llm_engine.model_config.max_model_len)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._busy = False
        self._closed = False
        self._pending: list[tuple[str, list[tuple[str, torch.Tensor]], int]] = []
        self._version = policy_version
        self._newest = policy_version
        self._drafter_version = 0
        self._record = self._fingerprints()

    # ------------------------------------------------------------------ engine thread

    def _build(self, llm_class: Any, kwargs: dict[str, Any]) -> Any:
        self._engine_thread = threading.current_thread()
        with process_state_kept():
            return llm_class(**kwargs)

    def _rpc(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(worker, *args)`` in vLLM's (single, in-process) worker, on the engine thread."""
        return self._on_engine(lambda: self.llm.collective_rpc(fn, args=args)[0])

    def _on_engine(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the engine thread (directly when already on it)."""
        if threading.current_thread() is self._engine_thread:
            return fn(*args)
        return self._engine.submit(fn, *args).result()

    # ------------------------------------------------------------------ protocol

    @property
    def spec(self) -> SpecConfig:
        return self._spec

    def generate(self, requests: Sequence[Request], spec: SpecConfig | None = None) -> Rollout:
        lookup = self._lookup_for(spec)
        with self._lock:
            self._check_open()
            self._apply_pending()
            self._busy = True
            version = self._version
        try:
            t0 = time.perf_counter()
            comps, stats = self._on_engine(self._generate, list(requests), version, lookup, t0)
            seconds = time.perf_counter() - t0
        finally:
            with self._lock:
                self._busy = False
                self._apply_pending()
        return Rollout(comps, stats, seconds)

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> float:
        t0 = time.perf_counter()
        weights = self._staged(named_tensors, self.config)
        with self._lock:
            self._check_open()
            self._newest = max(self._newest, version)
            self._pending = [p for p in self._pending if p[0] != "policy"]
            self._pending.append(("policy", weights, version))
            if not self._busy:
                self._apply_pending()
        return time.perf_counter() - t0

    def update_drafter(self, state: Mapping[str, torch.Tensor], version: int) -> float:
        if self._draft_config is None and not self._eagle3:
            raise ValueError(
                f"update_drafter: the vllm backend updates a 'draft' model or an 'eagle3' head "
                f"(this one runs spec={self._spec.method!r})"
            )
        t0 = time.perf_counter()
        if self._eagle3:
            weights = self._eagle3_staged(state)
        else:
            weights = self._staged(state, self._draft_config)
        with self._lock:
            self._check_open()
            if self._busy:
                raise RuntimeError("update_drafter during a generate call is not supported")
            self._pending.append(("drafter", weights, version))
            self._apply_pending()
        return time.perf_counter() - t0

    def versions(self) -> Versions:
        with self._lock:
            return Versions(max(self._newest, self._version), self._drafter_version)

    def served(self) -> Served:
        with self._lock:
            if not self._busy and not self._closed:
                self._apply_pending()
                self._record = self._fingerprints()
            return self._record

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "drafter" in state:
            raise ValueError("saved drafter state, but the vllm backend's drafters keep none")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            llm, self.llm = self.llm, None
        with contextlib.suppress(Exception):
            self._on_engine(llm.collective_rpc, forget_reload_records)
        with contextlib.suppress(Exception):
            self._on_engine(llm.llm_engine.engine_core.shutdown)
        self._engine.shutdown(wait=True)
        del llm
        gc.collect()

    # ------------------------------------------------------------------ weights

    def _staged(
        self, named: Mapping[str, torch.Tensor], config: ModelConfig
    ) -> list[tuple[str, torch.Tensor]]:
        """Checkpoint-named copies in the engine dtype (the caller may mutate its tensors)."""
        with torch.no_grad():
            return [(n, t.to(self.dtype, copy=True).contiguous()) for n, t in to_hf(named, config)]

    def _eagle3_staged(self, state: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """An EAGLE-3 head's state (our names, ``d2t`` included when the vocabulary is reduced)
        as vLLM's EAGLE-3 tensors (``drafters.export.eagle3_tensors``) in the engine dtype, the
        draft LM head rebuilt from the policy vLLM serves now."""
        from specrl.drafters.export import ExportError, eagle3_tensors

        head = {n: t.detach() for n, t in state.items()}
        d2t = head.pop("d2t", None)  # [Vd] target ids, or None
        served = self._rpc(parameters_by_name, False)
        lm_head = served.get("lm_head.weight", served["model.embed_tokens.weight"]).cpu()  # [V, H]
        try:
            tensors = eagle3_tensors(head, self.config, lm_head, d2t)
        except ExportError as e:
            raise ValueError(f"update_drafter: {e}") from None
        with torch.no_grad():
            return [(n, t.to(self.dtype, copy=True) if t.is_floating_point() else t.clone())
                    for n, t in tensors.items()]  # fmt: skip

    def _apply_pending(self) -> None:
        """Apply staged updates (lock held, no generate running)."""
        if self._pending:
            self._on_engine(self._apply_pending_now)

    def _apply_pending_now(self) -> None:
        while self._pending:
            kind, weights, version = self._pending.pop(0)
            if kind == "policy":
                self._rpc(load_policy, weights)
                self._version = version
                if self._eagle3:  # the head's LM head is the policy's (rows): rebuild it
                    draft = self._rpc(parameters_by_name, True)
                    head = self._eagle3_staged(eagle3_ours(draft))
                    self._rpc(load_drafter, head)
            else:
                self._rpc(load_drafter, weights)
                self._drafter_version = version
            self.llm.reset_prefix_cache()

    def _fingerprints(self) -> Served:
        served = self._rpc(parameters_by_name, False)
        policy = self._ours(served, self.config)
        drafter = None
        if self._draft_config is not None or self._eagle3:
            draft = self._rpc(parameters_by_name, True)
            ours = eagle3_ours(draft) if self._eagle3 else self._ours(draft, self._draft_config)
            drafter = fingerprint(ours, self.dtype)
        policy_fp = fingerprint(policy, self.dtype)
        return Served(self._version, policy_fp, self._drafter_version, drafter)

    @staticmethod
    def _ours(named: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        names = vllm_to_ours(config)
        out = {names[n]: t for n, t in named.items() if n in names}
        empty = [n for n, t in out.items() if t.numel() == 0]
        if empty:
            raise RuntimeError(f"vLLM dropped the parameter {empty[0]!r}: cannot fingerprint it")
        return out

    # ------------------------------------------------------------------ generation

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the vllm backend is closed")

    def _scheduler(self) -> Any:
        return self.llm.llm_engine.engine_core.engine_core.scheduler

    def _lookup_for(self, spec: SpecConfig | None) -> list[int] | None:
        """The batch-size -> k table for a call (None: the configured one)."""
        if spec is None or spec == self._spec:
            return None
        spec = spec.validate()
        if not self._spec.enabled:
            if spec.enabled:
                raise ValueError(
                    f"spec override {spec.method!r}: this vllm backend was built without "
                    "speculation"
                )
            return None
        if spec.enabled and (spec.method != self._spec.method or spec.k > self._spec.k):
            raise ValueError(
                f"spec override {spec.method!r} (k={spec.k}): this vllm backend runs "
                f"{self._spec.method!r} with k <= {self._spec.k}; only that method at a lower k, "
                "or none, can be chosen per call"
            )
        ks = [spec.k_for_batch(b) if spec.enabled else 0 for b in range(1, self.max_batch + 1)]
        return [0, *ks]

    def _seed(self, req: Request, j: int) -> int:
        if req.sampling.seed is None:
            return self._rng.getrandbits(63)
        return sample_seed(req.sampling.seed, j)

    def _generate(
        self, requests: list[Request], version: int, lookup: list[int] | None, t0: float
    ) -> tuple[list[Completion], EngineStats]:
        from vllm import SamplingParams as VllmParams

        comps: list[Completion] = []
        live: list[tuple[Completion, Request]] = []
        for i, req in enumerate(requests):
            error = request_problem(
                req,
                self.max_context - 1,
                self.config.vocab_size,
                "prompt + >= 1 new + 1 for the raw-logprob pass",
            )
            for j in range(max(req.sampling.n, 1)):
                c = Completion(i, j, list(req.prompt_ids), seed=self._seed(req, j),
                               policy_version=version)  # fmt: skip
                if error:
                    c.finish_reason, c.error = "error", error
                else:
                    live.append((c, req))
                comps.append(c)
        stats = EngineStats()
        if not live:
            return comps, stats
        inputs, params = [], []
        for c, req in live:
            s = req.sampling
            inputs.append({"prompt_token_ids": c.prompt_ids})
            params.append(VllmParams(
                n=1, temperature=s.temperature, top_k=s.top_k if s.top_k > 0 else 0,
                top_p=s.top_p, seed=c.seed, ignore_eos=True, stop_token_ids=list(s.stop_token_ids),
                max_tokens=min(s.max_new_tokens, self.max_context - 1 - len(c.prompt_ids)),
                logprobs=0, detokenize=False, skip_special_tokens=False))  # fmt: skip
        before = self._counters()
        scheduler = self._scheduler() if lookup is not None else None
        saved = None
        if scheduler is not None:
            saved, scheduler.dynamic_sd_lookup = scheduler.dynamic_sd_lookup, lookup
        wall0 = time.time()
        try:
            outs = self.llm.generate(inputs, params, use_tqdm=False)
        except BaseException:
            self._abort_unfinished()  # a failed call leaves nothing behind for the next one
            raise
        finally:
            if scheduler is not None:
                scheduler.dynamic_sd_lookup = saved
        delta = self._counters().minus(before)
        need_raw = []
        for (c, req), out in zip(live, outs, strict=True):
            self._fill(c, req, out, version, wall0)
            if not _raw_is_processed(req):
                need_raw.append(c)
        if need_raw:
            self._raw_pass(need_raw)
        self._stats(stats, [c for c, _ in live], delta)
        return comps, stats

    def _abort_unfinished(self) -> None:
        """Drop every request vLLM still holds (an interrupted or failed ``llm.generate`` leaves
        its requests queued, and the next call would run and return them)."""
        engine = self.llm.llm_engine
        with contextlib.suppress(Exception):
            engine.abort_request(list(engine.output_processor.request_states), internal=True)

    def _fill(self, c: Completion, req: Request, out: Any, version: int, wall0: float) -> None:
        o = out.outputs[0]
        c.token_ids = list(o.token_ids)
        lps = [d[t].logprob for d, t in zip(o.logprobs or [], c.token_ids, strict=False)]
        if req.sampling.temperature == 0:
            c.raw_logprobs, c.logprobs = lps, [0.0] * len(lps)  # processed: one-hot
        else:
            c.logprobs = lps
            c.raw_logprobs = list(lps) if _raw_is_processed(req) else []
        c.finish_reason = {"stop": "stop", "length": "length"}.get(o.finish_reason, "error")
        if c.finish_reason == "error":
            c.error = f"vLLM finished with {o.finish_reason!r}"
        c.token_versions = [version] * len(c.token_ids)
        m = out.metrics
        if m is not None and m.first_token_latency:
            c.first_token_s = max(0.0, m.arrival_time - wall0) + m.first_token_latency
            c.latency_s = c.first_token_s + max(0.0, m.last_token_ts - m.first_token_ts)
        sd = o.spec_decode_metrics
        if sd is not None:
            c.drafted = sd.num_draft_tokens
            c.accepted = sum(j * n for j, n in enumerate(sd.histogram))
        c.verify_steps = max(len(c.token_ids) - 1 - c.accepted, 0)

    def _raw_pass(self, comps: list[Completion]) -> None:
        """Raw (temperature 1, untruncated) logprobs of sampled tokens: vLLM's prompt logprobs
        of prompt + completion (one prefill each)."""
        from vllm import SamplingParams as VllmParams

        todo = [c for c in comps if c.token_ids]
        if not todo:
            return
        params = VllmParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0)
        outs = self.llm.generate(
            [{"prompt_token_ids": c.prompt_ids + c.token_ids} for c in todo], params, use_tqdm=False
        )
        for c, out in zip(todo, outs, strict=True):
            plp = out.prompt_logprobs[len(c.prompt_ids) :]
            c.raw_logprobs = [d[t].logprob for d, t in zip(plp, c.token_ids, strict=True)]

    def _counters(self) -> _Counters:
        out = _Counters()
        if not self._spec.enabled:
            return out
        for m in self.llm.get_metrics():
            if not m.name.startswith(_METRIC_PREFIX) or m.labels.get("model_name") != self.name:
                continue
            key = m.name.removeprefix(_METRIC_PREFIX)
            if key == "num_drafts":
                out.drafts += int(m.value)
            elif key == "num_draft_tokens":
                out.draft_tokens += int(m.value)
            elif key == "num_accepted_tokens":
                out.accepted += int(m.value)
            elif key == "num_accepted_tokens_per_pos":
                pos = list(out.per_pos) + [0] * max(0, len(m.values) - len(out.per_pos))
                for i, v in enumerate(m.values):
                    pos[i] += int(v)
                out.per_pos = tuple(pos)
        return out

    def _stats(self, st: EngineStats, comps: list[Completion], d: _Counters) -> None:
        st.tokens = sum(len(c.token_ids) for c in comps)
        st.drafted, st.accepted = d.draft_tokens, d.accepted
        st.per_position_accepted = list(d.per_pos)
        k = max(self._spec.k, len(d.per_pos))
        if d.drafts:
            left, drafted = d.draft_tokens, []
            for _ in range(k):  # exact when every draft had k tokens; else longest first
                drafted.append(min(d.drafts, left))
                left -= drafted[-1]
            st.per_position_drafted = drafted
        st.emitted_per_row_step = sum(max(len(c.token_ids) - 1, 0) for c in comps)
        st.row_steps = sum(c.verify_steps for c in comps)


def _raw_is_processed(req: Request) -> bool:
    """Whether the processed distribution of ``req`` equals the raw one on sampled tokens
    (temperature 1 untruncated; greedy, where vLLM's logprob is the raw one)."""
    s = req.sampling
    return s.temperature in (0.0, 1.0) and s.top_k == 0 and s.top_p >= 1.0


# --------------------------------------------------------------------------- building


def build_vllm(cfg: Config, policy: torch.nn.Module) -> VllmBackend:
    """The vLLM backend of a run (see the module docstring); ``ConfigError`` on bad input."""
    from specrl.backends.native import drafter_dir, spec_config
    from specrl.config import ConfigError
    from specrl.models.checkpoints import resolve_model
    from specrl.models.precision import torch_dtype

    if not vllm_available():
        raise ConfigError(
            "rollout.backend='vllm' needs the vllm extra: pip install -e '.[vllm]' "
            "(see the README for the CPU build)"
        )
    spec = spec_config(cfg, native=False)
    try:
        backend = VllmBackend(
            resolve_model(cfg.model.name),
            dtype=torch_dtype(cfg.model.dtype),
            spec=spec,
            drafter_dir=drafter_dir(cfg),
            max_batch=cfg.rollout.max_batch,
            seed=cfg.run.seed,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    backend.update_weights(dict(policy.named_parameters()), 0)
    return backend
