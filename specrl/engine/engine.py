"""Continuous-batching generation over a preallocated KV cache.

Contract: ``Engine(model).generate(requests)`` returns ``n`` completions per request, in request
order. Live sequences occupy cache slots 0..B-1 (batch row == slot); a finished sequence's slot is
refilled from the pending queue at once, and when the queue is empty the last live row moves into
the hole. A prompt is prefilled once per call and its cache copied to its GRPO siblings, also to
siblings admitted later when the batch is smaller than the group (``PromptStash``); separate
requests with the same prompt admitted together share one prefill row too. Randomness is
counter-based per request seed (``specrl.sampling.uniforms``), so a request samples the same
tokens alone or batched. Bad requests (empty prompt, too long, bad sampling values, ids outside the
vocabulary) come back as completions with ``finish_reason == "error"`` and a one-line message;
the others still run. A request whose prompt + ``max_new_tokens`` exceeds the context
(``max_position_embeddings``, or ``max_context`` if smaller) is clamped: it stops at the context
with ``finish_reason == "length"``. The KV cache is not reserved for prompt + ``max_new_tokens``
up front: a call starts with room for its longest prompt plus ``cache_chunk`` positions and the
cache doubles (up to what the call can need) only when a row outgrows it. Each decode step is
plain (one token per row) or speculative (a ``spec.SpecStep`` drafts k tokens, the target
verifies k+1 positions in one forward, each row advances by its own count; cache positions past
a row's length are stale and masked). With ``SpecConfig.siblings`` a stochastic draft also gets
first-token siblings, read as leaves of a draft tree in the same forward; an accepted sibling's
cache entries and features move to the first draft position. A step's k is
``spec.k_for_batch`` or, for an adaptive spec, the choice of the engine's ``controller``
(``specrl.spec.controller``: started on the first call that needs it and kept across calls, so
its estimates follow the run).
With ``record_steps=True`` every prefill, plain decode, draft and verify is also timed into
``stats.step_records`` (``StepRecord``: the calibration trace format of ``specrl.sim``).
``stage_weights`` (from any thread) swaps the weights between two decode steps of a running call;
unfinished rows keep, discard or re-verify their older tokens (``specrl.engine.inflight``).
The engine runs where its model's weights are: cache, forwards, sampling and verification on
that device, per-row bookkeeping on the host (host-built inputs copied once per forward). With
``memory_fraction`` (a GPU) a call runs at most as many rows at once as their full-length KV
cache fits in the memory left under that share of the device (``models.device.memory_budget``).
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from specrl.engine.inflight import InflightUpdates, WeightStage
from specrl.models.cache import KVCache
from specrl.models.device import memory_budget, model_device, on
from specrl.models.linear import prepack
from specrl.models.transformer import Transformer
from specrl.rollout_types import (
    Completion,
    EngineStats,
    Request,
    StepRecord,
    request_problem,
    sample_seed,
)
from specrl.sampling import (
    STREAM_DRAFT,
    STREAM_SAMPLE,
    SamplingParams,
    sample_logits,
    uniforms,
)
from specrl.spec.config import SpecConfig, build_proposer
from specrl.spec.controller import SpecController, StepOutcome, start_controller
from specrl.spec.proposers.base import ProposerBatch
from specrl.spec.siblings import SiblingDraft, resolve_siblings
from specrl.spec.verify import Verified, verify


def bump(counts: list[int], i: int) -> None:
    while len(counts) <= i:
        counts.append(0)
    counts[i] += 1


@dataclass
class Seq:
    """One live sequence: its completion record and decoding position."""

    comp: Completion
    params: SamplingParams
    history: list[int]  # prompt + emitted tokens
    max_total: int  # history length at which the sequence must stop
    group_key: int
    row_id: int
    stop: frozenset[int] = frozenset()
    # target features [n, F] of history positions not yet handed to the drafter (learned drafters)
    hidden: list[torch.Tensor] = field(default_factory=list)

    @property
    def pos(self) -> int:
        """Cache position of the last emitted token (not yet in the cache)."""
        return len(self.history) - 1


@dataclass
class RowTensors:
    """Per-row sampling tensors for the current batch composition, all [B]."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor

    @classmethod
    def of(cls, rows: list[Seq], device: torch.device) -> RowTensors:
        return cls(*on(device,  # built on the host, one copy each
            torch.tensor([s.params.temperature for s in rows], dtype=torch.float32),
            torch.tensor([s.params.top_k for s in rows], dtype=torch.int64),
            torch.tensor([s.params.top_p for s in rows], dtype=torch.float32),
            torch.tensor([s.comp.seed for s in rows], dtype=torch.int64),
        ))  # fmt: skip

    def select(self, idx: torch.Tensor) -> RowTensors:
        return RowTensors(*(t[idx] for t in (self.temperature, self.top_k, self.top_p, self.seeds)))


@dataclass
class Sampled:
    tokens: torch.Tensor  # [N]
    logprobs: torch.Tensor  # [N] processed
    raw_logprobs: torch.Tensor  # [N]


@dataclass
class PromptStash:
    """The prefill of a request whose samples still wait in the queue (batch smaller than its
    group); its prompt cache is in the engine cache's last slot (``Engine._prefill``)."""

    req: Request
    logits: torch.Tensor  # [V] float32 at the last prompt position
    feats: torch.Tensor | None  # [n, F] the drafter's features of the prompt positions


def sample_rows(logits: torch.Tensor, t: RowTensors, counters: torch.Tensor) -> Sampled:
    """Sample one token per row from logits [N, V] with per-row settings at counters [N]."""
    u = uniforms(t.seeds, counters, STREAM_SAMPLE)
    return Sampled(*sample_logits(logits, t.temperature, t.top_k, t.top_p, u))


@dataclass
class SpecDrafts:
    """One step's drafts as the controller sees them: the cap it puts on a deterministic
    draft (``capped``) and what the step verified and accepted (``record``)."""

    context: float  # mean tokens cached per row
    control: SpecController | None
    verified: int = 0  # draft positions in the verify forward
    drafted: list[int] = field(default_factory=list)  # [B] drafts verified per row
    accepted: list[int] = field(default_factory=list)  # [B]
    caught_up: int = 0  # feature positions the drafter read first (all rows)

    def capped(self, lengths: torch.Tensor, deterministic: bool) -> torch.Tensor:
        """``lengths`` [B] limited to the controller's cap (deterministic drafts only)."""
        if self.control is None or not deterministic:
            return lengths
        cap = self.control.cap(len(lengths), self.context, lengths.tolist())
        return lengths.clamp(max=cap)

    def record(self, verified: int, lengths: torch.Tensor, accepted: torch.Tensor) -> None:
        self.verified = verified
        self.drafted = lengths.tolist()
        self.accepted = accepted.tolist()


class Engine(InflightUpdates):
    """Batched generation with continuous batching (plain decoding; speculation plugs in)."""

    # Cache positions reserved past a call's longest prompt before the cache has to grow.
    cache_chunk: int = 256

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
        self.memory_fraction = memory_fraction  # device memory share bounding the KV cache
        # bytes of one cache slot per position (the budget's unit), measured once
        self._position_bytes = model.new_cache(1, 1).nbytes if memory_fraction else 0
        self._batch_cap = max_batch  # concurrent rows of the running call (memory permitting)
        limit = model.config.max_position_embeddings
        self.max_context = min(max_context or limit, limit)
        self.policy_version = policy_version
        self._rng = random.Random(seed)
        self._cache: KVCache | None = None
        self._cache_limit = 0  # the longest cache the running call can need (_ensure_cache)
        self._margin = 0  # positions a speculative forward writes past a row's last token
        self._row_tensors: RowTensors | None = None
        self._capture: tuple[int, ...] = ()
        self._next_row_id = 0
        self.stats = EngineStats()  # the last generate() call
        self.total_stats = EngineStats()  # every call since the engine was built
        self.record_steps = record_steps  # time each forward into stats.step_records
        self._shape: tuple[int, int, float] = (0, 0, 0.0)  # last forward: rows, T, mean context
        self._stash: PromptStash | None = None  # prefill of a request whose samples still wait
        self.spec = (spec or SpecConfig()).validate()
        self.proposer = self.make_proposer(self.spec)
        self._active = (self.spec, None)  # (speculation, proposer) of the running call
        self._weight_stage = WeightStage()  # in-flight weight updates (``stage_weights``)
        self.controller: SpecController | None = None  # chooses k per step (spec.adaptive)

    def make_proposer(self, spec: SpecConfig):
        """Build and check a drafter for this engine (errors here, never mid-generation)."""
        proposer = build_proposer(spec, draft_model=self.draft_model, target_model=self.model)
        if proposer is not None and hasattr(proposer, "check"):
            proposer.check(self.max_context, self.model.config.vocab_size)
        return proposer

    # ------------------------------------------------------------------ public API

    @torch.inference_mode()
    def generate(
        self, requests: list[Request], progress: bool = False, spec: SpecConfig | None = None
    ) -> list[Completion]:
        """n completions per request, in request order (see the module docstring).

        ``spec`` overrides the engine's speculation for this call.
        """
        self.stats = EngineStats()
        self._apply_staged([], 0.0)  # an update staged while idle
        self._stash = None  # never reuse a prefill across calls (weights may have changed)
        if spec is None or spec == self.spec:
            spec, proposer = self.spec, self.proposer
        else:
            spec, proposer = spec.validate(), self.make_proposer(spec)
        self._active = (spec, proposer if spec.enabled else None)
        self._capture = tuple(getattr(self._active[1], "hidden_layers", ()) or ())
        start = time.perf_counter()
        completions, pending = self._plan(requests, start)
        valid = [c for c in completions if c.error is None]
        self._ensure_cache(pending, spec.k + 1 + spec.siblings if spec.enabled else 0)
        if self._active[1] is not None and hasattr(proposer, "bind"):
            proposer.bind(self._cache.slots, self._cache_limit, self.model.config.vocab_size)
        bar = tqdm(total=len(valid), disable=not progress, desc="generate", unit="seq")
        rows: list[Seq] = []
        while pending or rows:
            self._admit(rows, pending, start)
            self._reserve(rows)
            self._retire(rows, self._apply_staged(rows, start))
            finished = self._step(rows, start)
            bar.update(len(finished))
            self._retire(rows, finished)
        bar.close()
        self._active = (self.spec, None)
        self.total_stats.add(self.stats)
        return completions

    # ------------------------------------------------------------------ planning

    def _plan(self, requests: list[Request], start: float) -> tuple[list[Completion], deque]:
        """Validate requests; make completion records; queue (request, [samples]) groups."""
        completions: list[Completion] = []
        pending: deque = deque()
        for i, req in enumerate(requests):
            error = request_problem(req, self.max_context, self.model.config.vocab_size)
            n = req.sampling.n if req.sampling.n >= 1 else 1
            comps = [
                Completion(i, j, list(req.prompt_ids), policy_version=self.policy_version)
                for j in range(n)
            ]
            for c in comps:
                c.seed = self._seed(req.sampling, c.sample_index)
                if error:
                    c.finish_reason, c.error = "error", error
            completions += comps
            if not error:
                pending.append((req, comps))
        return completions, pending

    def _seed(self, params: SamplingParams, index: int) -> int:
        if params.seed is None:
            return self._rng.getrandbits(63)
        return sample_seed(params.seed, index)

    def _ensure_cache(self, pending: deque, margin: int) -> None:
        """A cache with a slot per concurrent row and room for the longest prompt plus
        ``cache_chunk`` positions; ``_reserve`` grows it up to ``_cache_limit`` later."""
        if not pending:
            return
        self._margin = margin
        self._cache_limit = (
            margin
            + 1
            + max(
                min(len(r.prompt_ids) + r.sampling.max_new_tokens, self.max_context)
                for r, _ in pending
            )
        )
        longest_prompt = max(len(r.prompt_ids) for r, _ in pending)
        need_len = min(longest_prompt + margin + 1 + self.cache_chunk, self._cache_limit)
        total = sum(len(c) for _, c in pending)
        self._batch_cap = cap = self._rows_that_fit(self._cache_limit)
        slots = min(cap, total) + (total > cap)  # + the stash slot
        cache = self._cache
        # under a memory budget a cache with more slots than this call may use is made anew:
        # growing it (``_reserve``) would lengthen the extra slots too
        extra = self.memory_fraction is not None and cache is not None and cache.slots > slots
        if cache is None or cache.slots < slots or cache.max_len < need_len or extra:
            keep = cache is not None and not extra
            slots = max(slots, cache.slots if keep else 0)
            need_len = max(need_len, cache.max_len if keep else 0)
            self._cache = None  # free the old one first
            self._cache = self.model.new_cache(slots, need_len)

    def _rows_that_fit(self, limit: int) -> int:
        """Concurrent rows for a call whose rows may reach ``limit`` cache positions: max_batch,
        or under ``memory_fraction`` (a GPU) as many as the memory left then holds at full
        length, with a slot for a stashed prompt (``MemoryError`` naming both when not one)."""
        if self.memory_fraction is None:
            return self.max_batch
        held = 0 if self._cache is None else self._cache.nbytes
        budget = memory_budget(self.device, self.memory_fraction, held)
        if budget is None:
            return self.max_batch
        per_row = self._position_bytes * limit  # bytes of one row at full length
        fit = budget // per_row - 1
        if fit < 1:
            raise MemoryError(
                f"the KV cache of one row ({per_row} bytes for {limit} positions) does not fit "
                f"the {budget} bytes left under memory_fraction={self.memory_fraction}"
            )
        return min(self.max_batch, fit)

    def _reserve(self, rows: list[Seq]) -> None:
        """Grow the cache (doubling, at most to ``_cache_limit``) so that the next forward of
        every row fits: positions up to len(history) - 1 + margin, and one spare (re-verification
        pads at the last position, which must lie past every history)."""
        if not rows:
            return
        need = max(len(s.history) for s in rows) + self._margin + 1
        cache = self._cache
        if need > cache.max_len:
            cache.grow(max(need, min(2 * cache.max_len, self._cache_limit)))

    # ------------------------------------------------------------------ admission (prefill)

    def _admit(self, rows: list[Seq], pending: deque, start: float) -> None:
        """Fill free slots from the queue; prefill each admitted prompt once per call."""
        groups: list[tuple[Request, list[Completion]]] = []
        free = self._batch_cap - len(rows)
        while pending and free > 0:
            req, comps = pending[0]
            take, rest = comps[:free], comps[free:]
            groups.append((req, take))
            free -= len(take)
            if rest:
                pending[0] = (req, rest)
            else:
                pending.popleft()
        if groups:
            t0 = time.perf_counter()
            split = bool(pending) and pending[0][0] is groups[-1][0]  # its other samples wait
            ran = self._prefill(rows, groups, start, split)
            elapsed = time.perf_counter() - t0
            self.stats.prefill_s += elapsed
            if self.record_steps and ran:
                self._record("prefill", elapsed)

    def _prefill(self, rows: list[Seq], groups: list, start: float, split: bool) -> bool:
        """Prefill the groups' prompts, fork them, sample each new row's first token. With
        ``split`` the last group's request has samples left in the queue: its prompt cache goes
        to the cache's last slot (never a live row's: the cache has one more slot than the
        batch when groups can split) and its last-position logits and features to a
        ``PromptStash``; its later samples copy those instead of prefilling again. Returns
        whether a forward ran."""
        lens = [len(req.prompt_ids) for req, _ in groups]
        first_slot, slot = [], len(rows)
        for _, comps in groups:
            first_slot.append(slot)
            slot += len(comps)
        stash, stash_slot = self._stash, self._cache.slots - 1
        stashed = [stash is not None and req is stash.req for req, _ in groups]
        fresh = [g for g, hit in enumerate(stashed) if not hit]
        logits: list[torch.Tensor | None] = [None] * len(groups)  # [V] each
        feats: list[torch.Tensor | None] = [None] * len(groups)  # [n, F] each
        if fresh:
            prompts = [groups[g][0].prompt_ids for g in fresh]
            out, f = self._prefill_distinct(prompts, [first_slot[g] for g in fresh])
            for i, g in enumerate(fresh):
                logits[g] = out[i]
                feats[g] = None if f is None else f[i]
        for g, hit in enumerate(stashed):
            if hit:
                self._cache.copy_slot(stash_slot, first_slot[g], lens[g])
                logits[g], feats[g] = stash.logits, stash.feats
        if split and (stash is None or groups[-1][0] is not stash.req):
            self._cache.copy_slot(first_slot[-1], stash_slot, lens[-1])
            self._stash = PromptStash(groups[-1][0], logits[-1], feats[-1])
        self._start_rows(rows, groups, first_slot, lens, torch.stack(logits), feats, start)
        return bool(fresh)

    def _prefill_distinct(
        self, prompts: list[list[int]], slots: list[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Prefill each distinct prompt once, into the first of its slots, and copy its cache to
        the others: per entry the last-position logits [N, V] (float32) and the drafter's prompt
        features [len, F] (None without a learned drafter). Bit for bit what prefilling every
        entry would give (the same forward's rows, copied)."""
        first: dict[tuple[int, ...], int] = {}  # prompt -> index of its forward row
        heads: list[int] = []  # index into prompts of each distinct prompt
        for i, p in enumerate(prompts):
            if first.setdefault(tuple(p), len(heads)) == len(heads):
                heads.append(i)
        logits, feats = self._prefill_forward(
            [prompts[i] for i in heads], [slots[i] for i in heads]
        )
        row = [first[tuple(p)] for p in prompts]
        for i, (p, r) in enumerate(zip(prompts, row, strict=True)):
            if heads[r] != i:
                self._cache.copy_slot(slots[heads[r]], slots[i], len(p))
        if feats is not None:
            feats = [feats[r, : len(p)] for p, r in zip(prompts, row, strict=True)]
        return logits[row], feats

    def _prefill_forward(
        self, prompts: list[list[int]], slots: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One prefill forward of the prompts into ``slots``: last-position logits [G, V]
        (float32) and the drafter's features [G, width, F] (or None)."""
        lens = [len(p) for p in prompts]
        width = max(lens)
        ids = torch.zeros(len(prompts), width, dtype=torch.int64)
        for g, p in enumerate(prompts):
            ids[g, : lens[g]] = torch.tensor(p)
        positions = torch.arange(width).expand(len(prompts), width)
        last = torch.tensor(lens)[:, None] - 1
        ids, positions, last, at = self._on(ids, positions, last, torch.tensor(slots))
        out, feats = self._forward(ids, positions, logits_at=last, slots=at, prefill=True)
        return out.logits[:, 0].float(), feats

    def _start_rows(
        self,
        rows: list[Seq],
        groups: list,
        first_slot: list[int],
        lens: list[int],
        logits: torch.Tensor,  # [G, V] last prompt position of each group
        feats: list[torch.Tensor | None],  # per group: [n, F] prompt features, or None
        start: float,
    ) -> None:
        """Fork the groups into new rows and sample each row's first token."""
        new_rows = self._fork(groups, first_slot, lens)
        group_rows = [g for g, (_, c) in enumerate(groups) for _ in c]
        if feats[0] is not None:
            for seq, g in zip(new_rows, group_rows, strict=True):
                seq.hidden = [feats[g]]
        t = RowTensors.of(new_rows, self.device)
        counters = torch.zeros(len(new_rows), dtype=torch.int64, device=self.device)
        s = sample_rows(logits[group_rows], t, counters)
        base = len(rows)
        rows += new_rows
        done = self._emit(new_rows, [[x] for x in s.tokens.tolist()], s, start, first=True)
        self._retire(rows, [base + i for i in done])  # a stop or the limit at the first token

    def _fork(self, groups: list, first_slot: list[int], lens: list[int]) -> list[Seq]:
        """Make Seq records; copy each prompt's cache to its siblings' slots."""
        new_rows = []
        for (req, comps), slot0, n in zip(groups, first_slot, lens, strict=True):
            key = hash(tuple(req.prompt_ids))
            for j, comp in enumerate(comps):
                if j:
                    self._cache.copy_slot(slot0, slot0 + j, n)
                limit = min(n + req.sampling.max_new_tokens, self.max_context)
                stop = frozenset(req.sampling.stop_token_ids)
                row_id, self._next_row_id = self._next_row_id, self._next_row_id + 1
                new_rows.append(
                    Seq(comp, req.sampling, list(req.prompt_ids), limit, key, row_id, stop)
                )
        self._row_tensors = None
        return new_rows

    # ------------------------------------------------------------------ decoding

    def _step(self, rows: list[Seq], start: float) -> list[int]:
        """One decode step for all live rows; returns indices of rows that finished."""
        if not rows:
            return []
        t0, draft0 = time.perf_counter(), self.stats.draft_s
        spec, proposer = self._active
        control = self._controller(spec, proposer) if proposer is not None else None
        context = sum(s.pos for s in rows) / len(rows)
        if control is not None:
            k = control.choose(len(rows), context)
        else:
            k = spec.k_for_batch(len(rows)) if proposer is not None else 0
        drafts = SpecDrafts(context, control)
        if k == 0:
            finished = self._plain_step(rows, start)
        else:
            finished = self._spec_step(rows, start, proposer, k, drafts)
        elapsed = time.perf_counter() - t0
        draft_s = self.stats.draft_s - draft0
        self.stats.decode_s += elapsed
        self.stats.steps += 1
        self.stats.spec_steps += drafts.verified > 0
        if control is not None:
            control.observe(StepOutcome(len(rows), k, drafts.verified, context, elapsed,
                                        draft_s, drafts.drafted, drafts.accepted,
                                        drafts.caught_up))  # fmt: skip
        if self.record_steps:
            self._record_step(k, elapsed, draft_s)
        return finished

    def _controller(self, spec: SpecConfig, proposer) -> SpecController | None:
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

    def _record_step(self, k: int, elapsed: float, draft_s: float) -> None:
        """A plain step is one decode record; a speculative one a draft and a verify record."""
        if k == 0:
            self._record("decode", elapsed)
            return
        self._record("draft", draft_s, tokens_per_seq=k)
        self._record("verify", elapsed - draft_s)

    def _record(self, kind: str, seconds: float, tokens_per_seq: int | None = None) -> None:
        """Append a record of the last target forward's shape (``_shape``) and its time."""
        rows, tokens, context = self._shape
        rec = StepRecord(kind, rows, tokens_per_seq or tokens, context, seconds)
        self.stats.step_records.append(rec)

    def _tensors(self, rows: list[Seq]) -> RowTensors:
        if self._row_tensors is None:
            self._row_tensors = RowTensors.of(rows, self.device)
        return self._row_tensors

    def _on(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Host-built tensors on the engine's device (the same tensors on the CPU)."""
        return on(self.device, *tensors)

    def _counters(self, rows: list[Seq]) -> torch.Tensor:  # [B] tokens emitted per row
        return self._on(torch.tensor([len(s.comp.token_ids) for s in rows]))[0]

    def _plain_step(self, rows: list[Seq], start: float) -> list[int]:
        pos = [s.pos for s in rows]
        ids, positions = self._on(torch.tensor([[s.history[-1]] for s in rows]),
                                  torch.tensor(pos)[:, None])  # fmt: skip
        out, feats = self._forward(ids, positions, kv_len=max(pos) + 1)
        self._keep_hidden(rows, feats, [1] * len(rows))
        s = sample_rows(out.logits[:, 0], self._tensors(rows), self._counters(rows))
        return self._emit(rows, [[x] for x in s.tokens.tolist()], s, start)

    def _spec_step(
        self, rows: list[Seq], start: float, proposer, k: int, drafts: SpecDrafts
    ) -> list[int]:
        """Draft, verify k+1 positions in one target forward, advance each row by its count
        (``drafts`` caps a deterministic draft through its controller and records the step)."""
        t0 = time.perf_counter()
        t = self._tensors(rows)
        counters = self._counters(rows)
        batch = ProposerBatch(
            histories=[s.history for s in rows],
            group_keys=[s.group_key for s in rows],
            row_ids=[s.row_id for s in rows],
            temperature=t.temperature,
            top_k=t.top_k,
            top_p=t.top_p,
            seeds=t.seeds,
            counters=counters,
            prompt_lengths=[len(s.comp.prompt_ids) for s in rows],
            hidden=self._take_hidden(rows),
            draft_stream=STREAM_SAMPLE if self._active[0].exact == "sample" else STREAM_DRAFT,
        )
        draft = proposer.propose(batch, k).to(self.device)  # host drafts: one copy per step
        drafts.caught_up = sum(len(h) for h in batch.hidden) if batch.hidden else 0
        (room,) = self._on(torch.tensor([s.max_total - len(s.history) - 1 for s in rows]))
        lengths = torch.minimum(draft.lengths, room.clamp(min=0))  # [B]
        lengths = drafts.capped(lengths, draft.probs is None)
        kk = int(lengths.max())
        count = self._active[0].siblings_for_batch(len(rows), kk)
        tree = SiblingDraft.draw(draft, lengths, kk, count, t.seeds, counters)
        t1 = time.perf_counter()
        self.stats.draft_s += t1 - t0
        pos = [s.pos for s in rows]
        last, positions = self._on(
            torch.tensor([[s.history[-1]] for s in rows]),
            torch.tensor(pos)[:, None] + torch.arange(kk + 1)[None, :],
        )
        ids = torch.cat([last, draft.tokens[:, :kk]], 1)  # [B, kk+1]; positions the same
        if tree is not None:  # siblings: leaves under the root, stored after the chain
            ids, positions = tree.extend(ids, positions)
        width = ids.shape[1]
        out, feats = self._forward(
            ids.clamp(min=0),
            positions,
            kv_len=max(pos) + width,
            tree=None if tree is None else tree.mask,
        )
        logits = out.logits.float()  # [B, width, V]
        probs = None if draft.probs is None else draft.probs[:, :kk]
        sampling = (t.temperature, t.top_k, t.top_p, t.seeds, counters)
        v = verify(ids[:, 1 : kk + 1], lengths, probs, logits[:, : kk + 1], *sampling,
                   rule=self._active[0].exact)  # fmt: skip
        if tree is not None:
            v, chosen = resolve_siblings(v, lengths, draft.tokens[:, 0], draft.probs[:, 0],
                                         tree.tokens, tree.valid, logits[:, 0],
                                         logits[:, kk + 1 :], *sampling)  # fmt: skip
            self.stats.sibling_accepted += tree.adopt(self._cache, pos, chosen, feats)
        self.stats.verify_s += time.perf_counter() - t1
        self._count(rows, lengths, v.num_accepted)
        drafts.record(kk, lengths, v.num_accepted)
        proposer.observe(batch.row_ids, v.num_emitted)
        self._keep_hidden(rows, feats, v.num_emitted.tolist())
        return self._emit_verified(rows, v, start)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, **kw):
        """Target forward on the engine cache; also the drafter's features [B, T, F] if any."""
        out = self.model(ids, positions, self._cache, capture=self._capture, **kw)
        if self.record_steps:  # positions [B, T]: the first query position = tokens cached
            self._shape = (ids.shape[0], ids.shape[1], float(positions[:, 0].float().mean()))
        feats = torch.cat(out.captured, dim=-1) if self._capture else None
        return out, feats

    @staticmethod
    def _keep_hidden(rows: list[Seq], feats: torch.Tensor | None, counts: list[int]) -> None:
        """Store the features of the positions that became history (``counts`` per row)."""
        if feats is None:
            return
        for b, (seq, n) in enumerate(zip(rows, counts, strict=True)):
            seq.hidden.append(feats[b, :n])

    @staticmethod
    def _take_hidden(rows: list[Seq]) -> list[torch.Tensor] | None:
        """Per row, features [n, F] of history positions len-1-n .. len-2 (then cleared)."""
        if not rows or not rows[0].hidden:
            return None
        out = [torch.cat(s.hidden) for s in rows]
        for s in rows:
            s.hidden = []
        return out

    def _count(self, rows: list[Seq], lengths: torch.Tensor, accepted: torch.Tensor) -> None:
        st = self.stats
        for seq, n, a in zip(rows, lengths.tolist(), accepted.tolist(), strict=True):
            seq.comp.drafted += n
            seq.comp.accepted += a
            st.drafted += n
            st.accepted += a
            for i in range(n):
                bump(st.per_position_drafted, i)
                if i < a:
                    bump(st.per_position_accepted, i)

    def _emit_verified(
        self, rows: list[Seq], v: Verified, start: float, first: bool = False
    ) -> list[int]:
        """``_emit`` the tokens ``verify`` emitted per row (``first``: no decode step counted)."""
        emitted = [
            row[:n] for row, n in zip(v.tokens.tolist(), v.num_emitted.tolist(), strict=True)
        ]
        s = Sampled(v.tokens, v.logprobs_processed, v.logprobs_raw)
        return self._emit(rows, emitted, s, start, first=first)

    def _emit(
        self,
        rows: list[Seq],
        tokens: list[list[int]],
        s: Sampled,
        start: float,
        first: bool = False,
        offsets: list[int] | None = None,
    ) -> list[int]:
        """Append emitted tokens (cut at stop/length); return indices of finished rows."""
        lp, raw = (
            s.logprobs.reshape(len(rows), -1).tolist(),
            s.raw_logprobs.reshape(len(rows), -1).tolist(),
        )
        now = time.perf_counter() - start
        finished = []
        for i, (seq, toks) in enumerate(zip(rows, tokens, strict=True)):
            c = seq.comp
            if not first:  # acceptance counts decode/verify steps; the prefill's token is apart
                c.verify_steps += 1
                self.stats.row_steps += 1
            for j, tok in enumerate(toks):
                seq.history.append(tok)
                c.token_ids.append(tok)
                c.logprobs.append(lp[i][j])
                c.raw_logprobs.append(raw[i][j])
                c.token_versions.append(self.policy_version)
                self.stats.tokens += 1
                self.stats.emitted_per_row_step += not first
                if first and j == 0:
                    c.first_token_s = now
                if tok in seq.stop:
                    c.finish_reason = "stop"
                    break
                if len(seq.history) >= seq.max_total:
                    c.finish_reason = "length"
                    break
            else:
                continue
            c.latency_s = now
            c.policy_version = self.policy_version
            finished.append(i)
            proposer = self._active[1]
            if proposer is not None:
                proposer.finish(seq.row_id, seq.group_key, c.token_ids)
        return finished

    # ------------------------------------------------------------------ retiring

    def _retire(self, rows: list[Seq], finished: list[int]) -> None:
        """Remove finished rows, moving the last live rows into the holes."""
        if not finished:
            return
        for i in sorted(finished, reverse=True):
            last = len(rows) - 1
            if i != last:
                self._cache.move(last, i, rows[last].pos)
                rows[i] = rows[last]
            rows.pop()
        self._row_tensors = None
