"""In-flight weight updates: new weights between two decode steps of a running ``generate``.

``Engine.stage_weights(named, version, mode)`` may be called from any thread while another is
inside ``generate`` (shapes checked at once; only the latest update is kept). The generating
thread applies it between forwards; the live rows' older tokens then meet ``mode``: ``keep``
(unchanged, on a stale cache), ``discard`` (restart from the prompt) or ``reverify`` (the old
tokens as a one-hot draft for the new weights: exact). Rewriting modes reseed their rows
(``fresh_seed``) and refuse ``draft``/``self`` drafters. ``InflightUpdates`` is the engine's
collaborator (``stage``, ``take``); ``rewrite`` applies a taken update to the running ``Call``.
Details: docs/internals.md.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from specrl.engine.call import Call
from specrl.engine.rows import Kept, Seq
from specrl.models.transformer import Transformer
from specrl.models.weights import check_weights
from specrl.spec.verify import Verified, verify

MODES = ("reverify", "keep", "discard")
REWRITE_MODES = frozenset({"reverify", "discard"})
REWRITE_DRAFTERS = frozenset({"none", "ngram", "suffix", "eagle3", "mtp", "block"})
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class StagedWeights:
    """One weight update waiting for the next safe point."""

    named: Mapping[str, torch.Tensor]
    version: int
    mode: str


def check_mode(mode: str, drafters: Iterable[str]) -> None:
    """``ValueError`` for an unknown mode or a drafter that cannot follow a rewritten history."""
    if mode not in MODES:
        raise ValueError(f"in-flight weight update mode must be one of {MODES}, got {mode!r}")
    if mode in REWRITE_MODES:
        for name in drafters:
            if name not in REWRITE_DRAFTERS:
                raise ValueError(
                    f"in-flight weight updates with mode={mode!r} are not supported with the "
                    f"{name!r} drafter"
                )


def fresh_seed(seed: int, version: int) -> int:
    """A 63-bit seed mixed from (seed, version) (splitmix64 finalizer): the randomness of a row
    after a switch to ``version``, independent of the randomness under ``seed``."""
    x = (seed + 0x9E3779B97F4A7C15 * (version + 1)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


@dataclass(frozen=True)
class CompletionBatch:
    """R right-padded completions, the drafts of one re-verification forward over the cache."""

    ids: torch.Tensor  # [R, M] int64: each row's draft (its old completion), padding 0
    positions: torch.Tensor  # [R, M] int64: prompt_len + i, padding clamped into the cache
    lengths: torch.Tensor  # [R] int64: draft tokens per row
    kv_len: int


def completion_batch(
    drafts: list[list[int]], prompt_lens: list[int], max_len: int
) -> CompletionBatch:
    """Pad the drafts to one width M; token i of row b sits at cache position prompt_len + i
    (padding positions are clamped to ``max_len - 1``: past every row's history, so masked)."""
    rows, width = len(drafts), max(len(d) for d in drafts)
    ids = torch.zeros(rows, width, dtype=torch.int64)
    for b, d in enumerate(drafts):
        ids[b, : len(d)] = torch.tensor(d, dtype=torch.int64)
    positions = torch.tensor(prompt_lens)[:, None] + torch.arange(width)[None, :]  # [R, M]
    positions = positions.clamp(max=max_len - 1)
    lengths = torch.tensor([len(d) for d in drafts], dtype=torch.int64)
    return CompletionBatch(ids, positions, lengths, int(positions.max()) + 1)


def restart(seq: Seq) -> None:
    """Clear a row's completion: its history is its prompt again, no logprob or version kept."""
    seq.restart_record()


class InflightUpdates:
    """Staging in-flight weight updates and rewriting live rows under one (module docstring)."""

    def __init__(self, model: Transformer) -> None:
        self._model = model  # the engine's model: staged tensors must fit it
        self._lock = threading.Lock()
        self._staged: StagedWeights | None = None

    def stage(
        self,
        named_tensors: Mapping[str, torch.Tensor],
        version: int,
        mode: str,
        drafters: Iterable[str],
    ) -> None:
        """Stage new weights for the next safe point (thread-safe); ``ValueError`` for a mode
        one of ``drafters`` cannot follow or tensors that do not fit the model."""
        check_mode(mode, drafters)
        check_weights(self._model, named_tensors)
        with self._lock:  # a newer update replaces an older one not yet taken
            self._staged = StagedWeights(named_tensors, version, mode)

    def take(self, served: int) -> StagedWeights | None:
        """The staged update, if any and not older than the ``served`` version (an older one is
        dropped: newer weights were written directly meanwhile)."""
        with self._lock:
            update, self._staged = self._staged, None
        if update is None or update.version < served:
            return None
        return update


def rewrite(
    call: Call,
    rows: list[Seq],
    update: StagedWeights,
    start: float,
    max_tokens: int | None = None,
) -> list[int]:
    """The live rows meet ``update``'s mode, its weights already in the model (``max_tokens``:
    reverify checks at most that many old tokens per row); indices of the rows the rewrite
    finished (a stop or the length limit in their new tokens)."""
    st = call.stats
    st.weight_updates += 1
    old = sum(s.emitted for s in rows)
    if update.mode == "keep":
        st.reused_tokens += old
        return []
    for seq in rows:
        seq.comp.seed = fresh_seed(seq.comp.seed, update.version)
    call.rows_changed()
    if update.mode == "discard":
        st.discarded_tokens += old
        return _restart_rows(call, rows, start)
    return _reverify_rows(call, rows, start, max_tokens)


def _reverify_rows(call: Call, rows: list[Seq], start: float, cap: int | None) -> list[int]:
    """Re-prefill the prompts under the new weights, then one forward over every row's
    completion (read from the cache) verifies it as a one-hot draft; the accepted prefix and
    a recovered/bonus token replace the completion (a row's first ``cap`` old tokens are the
    draft)."""
    t0 = time.perf_counter()
    drafts = [s.history[len(s.comp.prompt_ids) :][:cap] for s in rows]
    prompt_lens = [len(s.comp.prompt_ids) for s in rows]
    old = sum(s.emitted for s in rows)
    firsts = [s.comp.first_token_s for s in rows]
    for seq in rows:
        restart(seq)
    prompt_logits, prompt_kept = _prefill_prompts(call, rows)  # [R, V], per row [n, ...]
    cb = completion_batch(drafts, prompt_lens, call.kv.cache.max_len)
    ids, positions, lengths = call.on(cb.ids, cb.positions, cb.lengths)
    out, kept = call.forward(ids, positions, kv_len=cb.kv_len)
    logits = torch.cat([prompt_logits[:, None], out.logits.float()], 1)  # [R, M+1, V]
    t = call.tensors(rows)  # the fresh seeds
    counters = torch.zeros(len(rows), dtype=torch.int64, device=call.device)
    sampling = (t.temperature, t.top_k, t.top_p, t.seeds, counters)
    v = verify(ids, lengths, None, logits, *sampling)
    accepted = v.num_accepted.tolist()
    for b, (seq, a) in enumerate(zip(rows, accepted, strict=True)):  # history 0 .. n+a-1
        seq.keep(prompt_kept[b], kept.at(b, slice(0, a)))
    finished = call.emit_verified(rows, v, start, first=True)
    for seq, a, first in zip(rows, accepted, firsts, strict=True):
        if a:  # the completion still starts with its old first token
            seq.comp.first_token_s = first
    _count_reverified(call, int(cb.lengths.sum()), old, sum(accepted))
    elapsed = time.perf_counter() - t0
    call.stats.reverify_s += elapsed
    if call.record_steps:
        call.record("prefill", elapsed)
    return finished


def _count_reverified(call: Call, checked: int, old: int, kept: int) -> None:
    """Of the rows' ``old`` completion tokens, ``checked`` were verified (the rest lay past
    ``reverify_max_tokens``) and ``kept`` accepted."""
    st = call.stats
    st.reverified_tokens += checked
    st.reused_tokens += kept
    st.discarded_tokens += old - kept
    st.tokens -= kept  # emitted again, but not generated again


def _restart_rows(call: Call, rows: list[Seq], start: float) -> list[int]:
    """Re-prefill the prompts under the new weights and sample every row's first token."""
    t0 = time.perf_counter()
    for seq in rows:
        restart(seq)
    logits, kept = _prefill_prompts(call, rows)  # [R, V], per row [n, ...]
    for seq, k in zip(rows, kept, strict=True):
        seq.keep(k)
    v = _first_tokens(call, rows, logits[:, None])
    finished = call.emit_verified(rows, v, start, first=True)
    elapsed = time.perf_counter() - t0
    call.stats.prefill_s += elapsed
    if call.record_steps:
        call.record("prefill", elapsed)
    return finished


def _prefill_prompts(call: Call, rows: list[Seq]) -> tuple[torch.Tensor, list[Kept]]:
    """Prefill each distinct prompt once into its first row's slot and copy it to the other
    rows' slots: per row the logits [R, V] (float32) at the last prompt position and what its
    prompt positions keep (``Kept`` [n, ...])."""
    return call.prefill([s.comp.prompt_ids for s in rows], list(range(len(rows))))


def _first_tokens(call: Call, rows: list[Seq], logits: torch.Tensor) -> Verified:
    """Sample each row's first token from logits [R, 1, V] (an empty draft: bit for bit plain
    sampling at counter 0)."""
    t = call.tensors(rows)
    zeros = torch.zeros(len(rows), dtype=torch.int64, device=call.device)  # lengths, counters
    no_draft = zeros[:, None][:, :0]  # [R, 0]
    sampling = (t.temperature, t.top_k, t.top_p, t.seeds, zeros)
    return verify(no_draft, zeros, None, logits, *sampling)
