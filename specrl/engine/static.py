"""Decode and verify steps at static shapes: rows padded to a batch bucket, captured or replayed.

``StaticSteps(device, capture, max_rows)`` runs a call's plain step (``decode``) and its verify
step without a draft tree (``verify``) as one static step each (``specrl.models.graphs``): the
target forward over a span of the KV cache (``Transformer`` with ``kv_len=Static(span)``: the
first ``span_for`` positions holding every live row's), then sampling or
the rejection sampler on the device with host-known ``SamplingHints``, the results packed into
one float64 tensor that crosses to the host in ONE copy per step (``host_copies`` counts them).
Keys: (kind, bucket, tokens per row, span, hints, rule, draft probabilities or not, captured
layers, cache); a reallocated cache drops the steps (``drop``: before it is replaced, so
the steps' references do not keep it alive). Live rows are
slots 0..B-1; padding rows take the free slots B..bucket-1 and write only the cache's last
position, which no history reaches (``KVSpace.reserve`` keeps it spare), so nothing they do is
read. The results are those of the
uncaptured step (``specrl.engine.decode``) for the same rows: greedy token for token (tests).
"""

from __future__ import annotations

from functools import partial

import torch

from specrl.engine.call import Call, kept_of
from specrl.engine.rows import Kept, Sampled, Seq
from specrl.models.cache import KVCache
from specrl.models.graphs import StepGraphs, bucket_for, buckets, pad_rows, span_for
from specrl.models.moe import Routing
from specrl.models.transformer import Static, Transformer
from specrl.sampling import PAD_SETTINGS, STREAM_SAMPLE, SamplingHints, sample_logits, uniforms
from specrl.spec.verify import Verified, verify


class StaticSteps:
    """The engine's static decode and verify steps (module docstring)."""

    def __init__(self, device: torch.device, capture: bool, max_rows: int) -> None:
        self.graphs = StepGraphs(device, capture)
        self.sizes = buckets(max_rows)
        self.host_copies = 0  # device-to-host copies of step results (one per step)
        self._cache: tuple[int, int] | None = None  # (data_ptr, max_len) the steps were built on

    def fits(self, rows: int) -> bool:
        """Whether ``rows`` live rows fit a bucket."""
        return bucket_for(rows, self.sizes) is not None

    def decode(self, call: Call, rows: list[Seq]) -> tuple[Sampled, Kept]:
        """A plain step: per row one sampled token with its logprobs (host tensors [B]) and what
        its position keeps (``Kept`` [B, 1, ...])."""
        b, width = len(rows), self._bucket(call, len(rows))
        ints, floats, hints = _inputs(call, rows, width, 1)
        span = self._span(call, rows, 1)
        key = ("decode", width, span, hints, call.active.capture, self._cache)
        step = partial(decode_step, call.model, call.kv.cache, span, call.active.capture, hints)
        packed, *kept = self.graphs.run(key, step, {"ints": ints, "floats": floats})
        host = self._to_host(packed[:b])  # [B, 3]
        call.shaped(b, 1, sum(s.pos for s in rows) / b)
        tokens = host[:, 0].to(torch.int64)
        sampled = Sampled(tokens, host[:, 1].float(), host[:, 2].float())
        return sampled, _rows_of(kept, b)

    def verify(
        self,
        call: Call,
        rows: list[Seq],
        drafts: torch.Tensor,  # [B, kk] int64 (padding any value), on the host or the device
        lengths: torch.Tensor,  # [B] int64 drafts to verify per row
        probs: torch.Tensor | None,  # [B, kk, V] the drafts' q, None: deterministic drafts
        rule: str,
    ) -> tuple[Verified, torch.Tensor, Kept]:
        """Verify ``drafts`` in one target forward: ``Verified`` and the lengths verified (host
        tensors) and what its positions keep (``Kept`` [B, kk+1, ...])."""
        b, kk = drafts.shape
        width = self._bucket(call, b)
        ints, floats, hints = _inputs(call, rows, width, kk + 1)
        inputs = {"ints": ints, "floats": floats, "drafts": pad_rows(drafts, width),
                  "lengths": pad_rows(lengths, width)}  # fmt: skip
        if rule == "sample":  # plain sampling's tokens: the drafts' q is never read
            probs = None
        if probs is not None:
            inputs["probs"] = pad_rows(probs, width)
        span = self._span(call, rows, kk + 1)
        key = ("verify", width, kk, span, hints, rule, probs is not None, call.active.capture,
               self._cache)  # fmt: skip
        step = partial(verify_step, call.model, call.kv.cache, span, call.active.capture, hints,
                       rule)  # fmt: skip
        packed, *kept = self.graphs.run(key, step, inputs)
        host = self._to_host(packed[:b])  # [B, 2 + 3 (kk+1)]
        call.shaped(b, kk + 1, sum(s.pos for s in rows) / b)
        lengths_host, accepted = host[:, 0].to(torch.int64), host[:, 1].to(torch.int64)
        tokens, lp, raw = host[:, 2:].view(b, 3, kk + 1).unbind(1)
        v = Verified(tokens.to(torch.int64), accepted + 1, lp.float(), raw.float(), accepted)
        return v, lengths_host, _rows_of(kept, b)

    def drop(self) -> None:
        """Drop every step (and with them their references to the KV cache)."""
        self.graphs.clear()
        self._cache = None

    def _bucket(self, call: Call, rows: int) -> int:
        """The bucket of ``rows`` rows; drops the steps when the cache was reallocated."""
        cache = call.kv.cache
        ident = (cache.k.data_ptr(), cache.max_len)
        if ident != self._cache:
            self.drop()
            self._cache = ident
        if cache.slots < (width := bucket_for(rows, self.sizes)):
            raise RuntimeError(f"static step of {width} rows over a cache of {cache.slots} slots")
        return width

    @staticmethod
    def _span(call: Call, rows: list[Seq], tokens: int) -> Static:
        """The cache span a step of ``tokens`` per row reads (``span_for``: every live row's
        positions inside it)."""
        need = max(s.pos for s in rows) + tokens
        return Static(span_for(need, call.kv.cache.max_len))

    def _to_host(self, packed: torch.Tensor) -> torch.Tensor:
        """The step's packed results on the host: the step's one device-to-host copy."""
        self.host_copies += 1
        return packed.to("cpu")


Features = torch.Tensor | None  # [W, T, F] the drafter's features of a step, None: none asked
Routes = torch.Tensor | None  # [W, T, moe_layers, top_k] an MoE target's experts, None: dense


def _rows_of(kept: list[torch.Tensor | None], rows: int) -> Kept:
    """A step's (features, experts) outputs for its first ``rows`` rows, copied out of the
    static buffers (valid only until the next step)."""
    return Kept(*(None if t is None else t[:rows].clone() for t in kept))


def decode_step(
    model: Transformer,
    cache: KVCache,
    span: Static,
    capture: tuple[int, ...],
    hints: SamplingHints,
    x: dict[str, torch.Tensor],  # ints [W, 5], floats [W, 2] (``_inputs``)
) -> tuple[torch.Tensor, Features, Routes]:
    """A plain step's device work: forward, sample; packed [W, 3] (token, processed and raw
    logprob), features and experts. Reads no device data on the host (capturable)."""
    ids, positions, top_k, seeds, counters = _split_ints(x["ints"], 1)
    routing = Routing.experts_of(model.config)
    out = model(ids, positions, cache, kv_len=span, capture=capture, routing=routing)
    temperature, top_p = x["floats"].unbind(1)
    u = uniforms(seeds, counters, STREAM_SAMPLE)
    s = sample_logits(out.logits[:, 0], temperature, top_k, top_p, u, hints=hints)
    kept = kept_of(out.captured, routing, ids.shape)
    return torch.stack([t.to(torch.float64) for t in s], 1), kept.feats, kept.routes


def verify_step(
    model: Transformer,
    cache: KVCache,
    span: Static,
    capture: tuple[int, ...],
    hints: SamplingHints,
    rule: str,
    x: dict[str, torch.Tensor],  # ints [W, 2 kk + 5], floats, drafts [W, kk], lengths [W], probs
) -> tuple[torch.Tensor, Features, Routes]:
    """A verify step's device work: forward over the last token and the drafts, the rejection
    sampler; packed [W, 2 + 3 (kk+1)] (lengths, accepted, tokens, processed and raw logprobs)
    features and experts. Reads no device data on the host (capturable)."""
    kk = x["drafts"].shape[1]
    ids, positions, top_k, seeds, counters = _split_ints(x["ints"], kk + 1)
    ids = torch.cat([ids[:, :1], x["drafts"].clamp(min=0)], 1)  # [W, kk+1]
    routing = Routing.experts_of(model.config)
    out = model(ids, positions, cache, kv_len=span, capture=capture, routing=routing)
    temperature, top_p = x["floats"].unbind(1)
    v = verify(x["drafts"], x["lengths"], x.get("probs"), out.logits.float(), temperature, top_k,
               top_p, seeds, counters, rule=rule, hints=hints)  # fmt: skip
    columns = [x["lengths"][:, None], v.num_accepted[:, None], v.tokens, v.logprobs_processed,
               v.logprobs_raw]  # fmt: skip
    kept = kept_of(out.captured, routing, ids.shape)
    return torch.cat([c.to(torch.float64) for c in columns], 1), kept.feats, kept.routes


def _inputs(
    call: Call, rows: list[Seq], width: int, tokens: int
) -> tuple[torch.Tensor, torch.Tensor, SamplingHints]:
    """Host tensors of a step over ``width`` rows (padding after the live ones), each built
    from one list: ints [W, 2T + 3] (ids: the row's last token, then zeros; positions; top_k;
    seed; counter) and floats [W, 2] (temperature, top_p), with the hints of every row's
    settings."""
    pad = width - len(rows)
    last = call.kv.cache.max_len - 1  # where padding rows write: a position no history reaches
    zeros = [0] * (tokens - 1)
    ints = [[s.history[-1], *zeros, *range(s.pos, s.pos + tokens), s.params.top_k, s.comp.seed,
             s.emitted] for s in rows]  # fmt: skip
    ints += [[0, *zeros, *[last] * tokens, PAD_SETTINGS[1], 0, 0]] * pad
    settings = [(s.params.temperature, s.params.top_k, s.params.top_p) for s in rows]
    settings += [PAD_SETTINGS] * pad
    floats = torch.tensor([(t, p) for t, _, p in settings], dtype=torch.float32)
    temps, top_ks, top_ps = zip(*settings, strict=True)
    hints = SamplingHints.of(temps, top_ks, top_ps, call.model.config.vocab_size)
    return torch.tensor(ints, dtype=torch.int64), floats, hints


def _split_ints(
    ints: torch.Tensor, tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [W, T], positions [W, T], top_k [W], seeds [W], counters [W] of ``_inputs``' ints."""
    return (ints[:, :tokens], ints[:, tokens : 2 * tokens], ints[:, 2 * tokens],
            ints[:, 2 * tokens + 1], ints[:, 2 * tokens + 2])  # fmt: skip
