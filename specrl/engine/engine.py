"""Continuous-batching generation over a preallocated KV cache.

``Engine(model).generate(requests)`` returns ``n`` completions per request, in request order,
their per-token tensors views of one flat ``RolloutTensors`` (each live row keeps its tokens,
logprobs and versions as lists, ``call.emit``; a finished row's become tensors at once, so that
``on_done`` announces whole completions);
a bad request comes back as an ``"error"`` completion while the others run; a row stops at the
context (``"length"``). Sampling is counter-based per request seed, so a request samples the
same tokens alone or batched. Each iteration admits rows (``admission``), grows the cache
(``kv``), applies a staged weight update (``stage_weights``: ``inflight``), runs one decode step
(``decode``) and retires finished rows (``call``). ``stats`` / ``total_stats`` are the last
call's and every call's counters. ``load_weights(named, version)`` is the one way new policy
weights enter the engine: between calls (the caller makes sure none runs) and, for a staged
update, at a running call's safe point; ``free_cache()`` lets go of the KV cache (the next call
makes a new one). The drafter's optional hooks (``check``, ``use_static``, ``bind``) are called
unconditionally (``spec.proposers.base.Proposer``). The engine runs on its model's device;
``step_graphs`` runs decode and verify steps at static shapes, captured as CUDA graphs on CUDA
(``static``). Details: docs/internals.md.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping

import torch
from tqdm import tqdm

from specrl.engine.admission import Admission
from specrl.engine.call import Call, GroupsDone
from specrl.engine.decode import Decoder
from specrl.engine.inflight import InflightUpdates, rewrite
from specrl.engine.kv import KVSpace
from specrl.engine.rows import ActiveSpec, Seq
from specrl.engine.static import StaticSteps
from specrl.models.cache import KVCache
from specrl.models.device import model_device
from specrl.models.graphs import StepGraphs
from specrl.models.linear import prepack
from specrl.models.transformer import Transformer
from specrl.models.weights import copy_weights
from specrl.rollout_types import Completion, EngineStats, Request, RolloutTensors
from specrl.spec.config import SpecConfig, build_proposer
from specrl.spec.controller import SpecController, start_controller
from specrl.spec.proposers.base import Proposer

# How decode and verify steps run: 'off' (shapes as they come), 'static' (rows padded to a batch
# bucket over a static KV cache, replayed eagerly), 'capture' (static, as captured CUDA graphs;
# CUDA only), 'auto' (capture on CUDA, off elsewhere).
STEP_GRAPHS = ("auto", "capture", "static", "off")


def static_steps(mode: str, device: torch.device, max_batch: int) -> StaticSteps | None:
    """The static steps ``mode`` (``STEP_GRAPHS``) asks for on ``device``; None for 'off' (and
    'auto' off CUDA). 'capture' off CUDA is a ``ValueError`` naming the device."""
    if mode not in STEP_GRAPHS:
        raise ValueError(f"step_graphs must be one of {', '.join(STEP_GRAPHS)}, got {mode!r}")
    if mode == "auto":
        mode = "capture" if device.type == "cuda" else "off"
    if mode == "capture" and device.type != "cuda":
        raise ValueError(f"step_graphs='capture' needs a CUDA device, the model is on {device}")
    return None if mode == "off" else StaticSteps(device, mode == "capture", max_batch)


class Engine:
    """Batched generation with continuous batching (plain decoding; speculation plugs in)."""

    # Cache positions reserved past a call's longest prompt before the cache has to grow.
    cache_chunk: int = 256
    # reverify checks at most this many old tokens per row (None: all); later ones are discarded
    reverify_max_tokens: int | None = None

    def __init__(
        self,
        model: Transformer,
        max_batch: int = 64,
        max_context: int | None = None,
        seed: int = 0,
        policy_version: int = 0,
        spec: SpecConfig | None = None,
        draft_model: Transformer | None = None,
        record_steps: bool = False,
        memory_fraction: float | None = None,
        step_graphs: str = "auto",
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if memory_fraction is not None and not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        self.model = model
        self.device = model_device(model)  # every tensor a forward or the sampler reads
        self.draft_model = None if draft_model is None else draft_model.to(self.device)
        for m in (model, draft_model):  # packed weights now, in one buffer each (huge pages)
            if m is not None:
                prepack(m)
        self.max_batch = max_batch
        self.step_graphs = step_graphs
        limit = model.config.max_position_embeddings
        self.max_context = min(max_context or limit, limit)
        self.spec = (spec or SpecConfig()).validate()
        self.static = static = static_steps(step_graphs, self.device, max_batch)
        self._kv = KVSpace(model, self.device, self.max_context, memory_fraction,
                           None if static is None else static.sizes,
                           None if static is None else static.drop)  # fmt: skip
        self.policy_version = policy_version
        self._admission = Admission(self._kv, model.config.vocab_size, seed)
        self.stats = EngineStats()  # the last generate() call
        self.total_stats = EngineStats()  # every call since the engine was built
        self.record_steps = record_steps  # time each forward into stats.step_records
        self.proposer = self.make_proposer(self.spec)
        self._active = ActiveSpec(self.spec)  # the running call's speculation
        self._call: Call | None = None  # the running call
        self._updates = InflightUpdates(model)  # in-flight weight updates (``stage_weights``)
        self.controller: SpecController | None = None  # chooses k per step (spec.adaptive)
        self._decoder = Decoder(self._controller, self.static)

    def make_proposer(self, spec: SpecConfig) -> Proposer | None:
        """Build and check a drafter for this engine (errors here, never mid-generation)."""
        proposer = build_proposer(spec, draft_model=self.draft_model, target_model=self.model)
        if proposer is None:
            return None
        proposer.check(self.max_context, self.model.config.vocab_size)
        if self.static is not None:  # its own steps, if it has any, run static too
            proposer.use_static(StepGraphs(self.device, self.static.graphs.capture),
                                self.static.sizes)  # fmt: skip
        return proposer

    @property
    def cache(self) -> KVCache | None:
        """The KV cache: None before the first call and after ``free_cache``."""
        return self._kv.cache

    def free_cache(self) -> None:
        """Let go of the KV cache (its static steps first); the engine stays usable and makes
        a new one for its next call."""
        self._kv.free()

    # ------------------------------------------------------------------ public API

    @torch.inference_mode()
    def generate(
        self,
        requests: list[Request],
        progress: bool = False,
        spec: SpecConfig | None = None,
        on_done: Callable[[int, list[Completion]], None] | None = None,
    ) -> list[Completion]:
        """n completions per request, in request order (see the module docstring).

        ``spec`` overrides the engine's speculation for this call; ``on_done(i, comps)`` is
        called (in this thread) as soon as every completion of request ``i`` (``comps``) has
        finished, while the other rows keep decoding (a refused request is never announced).
        """
        self.stats = EngineStats()
        self._apply_staged([], 0.0)  # an update staged while idle
        self._admission.stash = None  # never reuse a prefill across calls (weights may change)
        if spec is None or spec == self.spec:
            spec, proposer = self.spec, self.proposer
        else:
            spec, proposer = spec.validate(), self.make_proposer(spec)
        self._active = active = ActiveSpec.of(spec, proposer)
        start = time.perf_counter()
        completions, pending = self._admission.plan(requests, self.policy_version)
        valid = [c for c in completions if c.error is None]
        margin = spec.k + 1 + spec.siblings if spec.enabled else 0
        self._kv.ensure(pending, margin, self.max_batch, self.cache_chunk)
        if active.proposer is not None:
            active.proposer.bind(self._kv.cache.slots, self._kv.limit, self.model.config.vocab_size)
        self._call = call = Call(
            self.model,
            self._kv,
            active,
            self.stats,
            self.policy_version,
            self.record_steps,
            GroupsDone(valid, on_done),
        )
        bar = tqdm(total=len(valid), disable=not progress, desc="generate", unit="seq")
        rows: list[Seq] = []
        while pending or rows:
            self._admit(rows, pending, start)
            self._kv.reserve(rows)
            call.retire(rows, self._apply_staged(rows, start))
            finished = self._step(rows, start)
            bar.update(len(finished))
            call.retire(rows, finished)
        bar.close()
        RolloutTensors.of(completions).share(completions)  # one flat copy, completions views
        self._active, self._call = ActiveSpec(self.spec), None
        self.total_stats.add(self.stats)
        return completions

    def load_weights(self, named: Mapping[str, torch.Tensor], version: int) -> None:
        """The model's weights := ``named`` (copied in place, ``ValueError`` naming a missing
        or mis-shaped tensor), packed for inference now (the update pays for that, not the next
        forward), served as policy ``version`` from now on. Between calls the caller makes sure
        no ``generate`` runs; during one only the generating thread calls it (a staged update at
        a safe point: the running call's later tokens are ``version``'s)."""
        copy_weights(self.model, named)
        prepack(self.model)
        self.policy_version = version
        if self._call is not None:
            self._call.version = version
        self._admission.stash = None  # a prompt cache and logits of the old weights

    def stage_weights(
        self, named_tensors: Mapping[str, torch.Tensor], version: int, mode: str
    ) -> None:
        """Stage new weights for the next safe point of a running (or the next) call, from any
        thread (``specrl.engine.inflight``)."""
        drafters = {s.method if s.enabled else "none" for s in (self.spec, self._active.spec)}
        self._updates.stage(named_tensors, version, mode, drafters)

    # ------------------------------------------------------------------ one call's loop

    def _admit(self, rows: list[Seq], pending: deque, start: float) -> None:
        """Fill free slots from the queue (``Admission.admit``)."""
        self._admission.admit(self._call, rows, pending, start)

    def _step(self, rows: list[Seq], start: float) -> list[int]:
        """One decode step for all live rows; returns indices of rows that finished."""
        return self._decoder.step(self._call, rows, start)

    def _apply_staged(self, rows: list[Seq], start: float) -> list[int]:
        """Apply a staged update, if any, to the model and the live rows; indices of the rows
        the rewrite finished (a stop or the length limit in their new tokens)."""
        update = self._updates.take(self.policy_version)
        if update is None:
            return []
        self.load_weights(update.named, update.version)
        if not rows:
            return []
        return rewrite(self._call, rows, update, start, self.reverify_max_tokens)

    def _controller(self, spec: SpecConfig, proposer: Proposer) -> SpecController | None:
        """The cost-model controller of an adaptive ``spec`` (started on first use and kept
        across calls while k and the kind of drafter are the same: its estimates carry over
        from step to step)."""
        if not spec.adaptive:
            return None
        cheap = bool(proposer.deterministic)
        ctl = self.controller
        if ctl is None or ctl.k_max != spec.k or ctl.cheap_drafts != cheap:
            self.controller = start_controller(self.model, spec.k, self.max_batch, cheap)
        return self.controller
