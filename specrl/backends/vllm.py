"""The vLLM rollout backend: vLLM's engine behind the ``RolloutBackend`` seam (``specrl[vllm]``).

``VllmBackend(model_dir, ...)`` runs one ``vllm.LLM`` in this process (eager; CPU environment
defaults set only where unset; ``vllm_worker``'s patches). ``generate`` goes through
``vllm_requests`` (same seeds, same tokens on the same engine) with ``vllm_spec``'s speculation;
no in-flight updates. ``update_weights`` / ``update_drafter`` reload vLLM's weights in place
(``vllm_weights``) at once when idle, else after the running call; ``served`` fingerprints
vLLM's own tensors under our names (read back when no call runs, else the last reading).
Thread-safe for one generating plus one updating thread.
``build_vllm(plan, policy)`` builds it from a ``RolloutPlan`` (writing the drafter vLLM loads
where the plan's is not in vLLM's layout or trained from nothing: ``vllm_spec.served_drafter``,
in a directory the backend removes at ``close``) and pushes the policy's weights.
Details: docs/internals.md.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch

from specrl.backends.base import Rollout, Served, Versions
from specrl.backends.vllm_requests import (
    Counters,
    completions,
    fill_stats,
    finish,
    read_counters,
    sampling_params,
)
from specrl.backends.vllm_spec import lookup_for, served_drafter, vllm_speculative_config
from specrl.backends.vllm_weights import Staged, as_ours, eagle3_ours, eagle3_staged, staged
from specrl.backends.vllm_worker import (
    forget_reload_records,
    load_drafter,
    load_policy,
    parameters_by_name,
    patch_vllm,
    process_state_kept,
)
from specrl.models.fingerprint import fingerprint
from specrl.rollout_plan import RolloutPlan, refusing
from specrl.rollout_types import Completion, EngineStats, Request, sample_seed
from specrl.spec.config import SpecConfig

T = TypeVar("T")
ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process (see the docstring)
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",  # vLLM's INFO lines would flood a training console
}


def vllm_available() -> bool:
    """Whether ``vllm`` can be imported here (the ``specrl[vllm]`` extra)."""
    import importlib.util

    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a broken or blocked install
        return False


def missing_extra() -> str | None:
    """What the vLLM backend needs and this install lacks (None: nothing)."""
    if vllm_available():
        return None
    return "the vllm extra: pip install -e '.[vllm]' (see the README for the CPU build)"


def _set_environment(kv_cache_gib: int) -> None:
    """vLLM's environment defaults, where unset (see the module docstring)."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise ValueError("the vllm backend needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (in-process)")


def _engine_args(model_dir: str, name: str, dtype: torch.dtype, seed: int, max_batch: int,
                 speculative: dict[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    """``vllm.LLM``'s arguments (``name`` labels this engine's metrics)."""
    kwargs: dict[str, Any] = dict(
        model=model_dir,
        served_model_name=name,
        dtype=str(dtype).removeprefix("torch."),
        enforce_eager=True,
        logprobs_mode="processed_logprobs",
        seed=seed,
        max_num_seqs=max_batch,
        disable_log_stats=False,
        max_logprobs=1,
    )
    if speculative is not None:
        kwargs |= {"speculative_config": speculative,
                   "per_request_spec_decode_metrics": "summary"}  # fmt: skip
    return kwargs


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
        owned_dir: str | os.PathLike | None = None,
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
        self._owned = owned_dir  # removed at close (the drafter build_vllm wrote)
        speculative = vllm_speculative_config(self._spec, max_batch, drafter_dir)
        _set_environment(kv_cache_gib)
        patch_vllm()
        from vllm import LLM

        self.name = f"specrl-{uuid.uuid4().hex[:8]}"  # labels this engine's metrics
        kwargs = _engine_args(self.model_dir, self.name, dtype, seed, max_batch, speculative)
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
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
        self._pending: list[tuple[str, Staged | dict[str, torch.Tensor], int]] = []
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
        lookup = lookup_for(self._spec, spec, self.max_batch)
        with self._lock:
            self._check_open()
            self._apply_pending()
            self._busy = True
            version = self._version
        try:
            t0 = time.perf_counter()
            comps, stats = self._on_engine(self._generate, list(requests), version, lookup)
            seconds = time.perf_counter() - t0
        finally:
            with self._lock:
                self._busy = False
                self._apply_pending()
        return Rollout(comps, stats, seconds)

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> float:
        t0 = time.perf_counter()
        weights = staged(named_tensors, self.config, self.dtype)
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
        with self._lock:
            busy = self._busy
        weights: Staged | dict[str, torch.Tensor]
        if not self._eagle3:
            weights = staged(state, self._draft_config, self.dtype)
        elif busy:  # its LM head is the policy served when it applies (after the call)
            weights = {n: t.detach().clone() for n, t in state.items()}
        else:
            weights = self._eagle3_staged(state)
        with self._lock:
            self._check_open()
            self._pending = [p for p in self._pending if p[0] != "drafter"]
            self._pending.append(("drafter", weights, version))
            if not self._busy:
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
        if self._owned is not None:
            shutil.rmtree(self._owned, ignore_errors=True)

    # ------------------------------------------------------------------ weights

    def _eagle3_staged(self, state: Mapping[str, torch.Tensor]) -> Staged:
        """An EAGLE-3 head's state as vLLM's tensors, its LM head from the policy served now."""
        served = self._rpc(parameters_by_name, False)
        return eagle3_staged(state, self.config, served, self.dtype)

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
                if isinstance(weights, dict):  # an EAGLE-3 head staged during a call
                    weights = self._eagle3_staged(weights)
                self._rpc(load_drafter, weights)
                self._drafter_version = version
            self.llm.reset_prefix_cache()

    def _fingerprints(self) -> Served:
        served = self._rpc(parameters_by_name, False)
        policy = as_ours(served, self.config)
        drafter = None
        if self._draft_config is not None or self._eagle3:
            draft = self._rpc(parameters_by_name, True)
            ours = eagle3_ours(draft) if self._eagle3 else as_ours(draft, self._draft_config)
            drafter = fingerprint(ours, self.dtype)
        policy_fp = fingerprint(policy, self.dtype)
        return Served(self._version, policy_fp, self._drafter_version, drafter)

    # ------------------------------------------------------------------ generation

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the vllm backend is closed")

    def _scheduler(self) -> Any:
        return self.llm.llm_engine.engine_core.engine_core.scheduler

    def _seed(self, req: Request, j: int) -> int:
        if req.sampling.seed is None:
            return self._rng.getrandbits(63)
        return sample_seed(req.sampling.seed, j)

    def _generate(
        self, requests: list[Request], version: int, lookup: list[int] | None
    ) -> tuple[list[Completion], EngineStats]:
        comps, live = completions(
            requests, version, self.max_context, self.config.vocab_size, self._seed
        )
        stats = EngineStats()
        if not live:
            return comps, stats
        inputs, params = sampling_params(live, self.max_context)
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
        finish(self.llm, live, outs, version, wall0)
        fill_stats(stats, [c for c, _ in live], delta, self._spec.k)
        return comps, stats

    def _abort_unfinished(self) -> None:
        """Drop every request vLLM still holds (an interrupted or failed ``llm.generate`` leaves
        its requests queued, and the next call would run and return them)."""
        engine = self.llm.llm_engine
        with contextlib.suppress(Exception):
            engine.abort_request(list(engine.output_processor.request_states), internal=True)

    def _counters(self) -> Counters:
        return read_counters(self.llm, self.name) if self._spec.enabled else Counters()


# --------------------------------------------------------------------------- building


def build_vllm(plan: RolloutPlan, policy: torch.nn.Module) -> VllmBackend:
    """The vLLM backend of a run (see the module docstring); ``ConfigError`` on bad input. The
    drafter directory ``vllm_spec.served_drafter`` writes lives in a temporary directory the
    backend owns (removed at ``close``)."""
    from specrl.models.checkpoints import resolve_model
    from specrl.models.precision import torch_dtype

    owned = Path(tempfile.mkdtemp(prefix="specrl-vllm-drafter-"))
    try:
        with refusing(None):
            model_dir = str(resolve_model(plan.model))
            backend = VllmBackend(
                model_dir,
                dtype=torch_dtype(plan.dtype),
                spec=plan.spec,
                drafter_dir=served_drafter(plan, policy, model_dir, owned),
                max_batch=plan.max_batch,
                seed=plan.seed,
                owned_dir=owned,
            )
    except BaseException:
        shutil.rmtree(owned, ignore_errors=True)
        raise
    backend.update_weights(dict(policy.named_parameters()), 0)
    return backend
