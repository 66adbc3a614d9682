"""Static (captured) decode and verify steps: the same completions as the uncaptured engine,
greedy token for token (plain, every drafter kind, continuous batching, ragged acceptance, shared
prefills, in-flight weight updates), one device-to-host copy per step, no host read of device
data inside a step (it runs on the meta device), buckets and the cache slots they need."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from specrl.engine import Engine
from specrl.engine.static import decode_step, verify_step
from specrl.models.graphs import StepGraphs, bucket_for, buckets, span_for
from specrl.models.transformer import STATIC, Static, Transformer
from specrl.rollout_types import Request
from specrl.sampling import SamplingHints, SamplingParams
from specrl.spec.config import SpecConfig
from tests.conftest import DEVICES, make_tiny, tiny_config

VOCAB = 32
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 5, 6], [9, 9, 9], [4, 3, 2, 1, 4, 3, 2, 1, 4]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=14, n=2, seed=3, stop_token_ids=(7,))
SAMPLED = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, max_new_tokens=10, n=2, seed=4)
METHODS = ["none", "ngram", "suffix", "draft", "eagle3", "mtp", "block"]


def mode_for(device: str) -> str:
    return "capture" if device == "cuda" else "static"


def engine(
    step_graphs: str, method: str, device: str = "cpu", max_batch: int = 4, positions: int = 256
) -> Engine:
    """An engine over the tiny target (the same weights every time) with ``method``."""
    target = make_tiny(seed=11, vocab_size=VOCAB, max_position_embeddings=positions).to(device)
    draft = make_tiny(seed=5, vocab_size=VOCAB) if method == "draft" else None
    spec = SpecConfig(method, 3) if method != "none" else None
    return Engine(target, max_batch=max_batch, spec=spec, draft_model=draft,
                  step_graphs=step_graphs)  # fmt: skip


def run(e: Engine, params: SamplingParams) -> list:
    return e.generate([Request(p, params) for p in PROMPTS])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
def test_greedy_static_equals_uncaptured(method: str, device: str) -> None:
    """8 rows through 4 slots (continuous batching, groups of 2 sharing a prefill, stops):
    the same tokens, token for token, and logprobs to float rounding; every step static."""
    plain = run(engine("off", method, device), GREEDY)
    e = engine(mode_for(device), method, device)
    static = run(e, GREEDY)
    assert [c.token_ids for c in static] == [c.token_ids for c in plain]
    assert [c.finish_reason for c in static] == [c.finish_reason for c in plain]
    for a, b in zip(static, plain, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
        torch.testing.assert_close(torch.tensor(a.raw_logprobs), torch.tensor(b.raw_logprobs))
    assert e.stats.steps > 0
    assert e.static.host_copies == e.stats.steps  # every step static, one copy each
    if method != "none":
        assert e.stats.spec_steps > 0 and e.stats.drafted > 0


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_steps_read_a_span_of_the_cache(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """480 new tokens: the steps of the last cache read spans shorter than it (the span its
    rows reach), giving the uncaptured engine's tokens."""
    params = GREEDY.replace(max_new_tokens=480, stop_token_ids=(), n=1)
    plain = engine("off", method, positions=1024).generate(
        [Request(p, params) for p in PROMPTS[:2]]
    )
    e = engine("static", method, positions=1024)
    clears = []
    monkeypatch.setattr(e.static.graphs, "clear", lambda: clears.append(1))
    static = e.generate([Request(p, params) for p in PROMPTS[:2]])
    assert [c.token_ids for c in static] == [c.token_ids for c in plain]
    max_len = e._kv.cache.max_len
    assert max(len(p) for p in PROMPTS[:2]) + 480 < max_len
    spans = {key[2 if key[0] == "decode" else 3].length for key in e.static.graphs._steps}
    assert min(spans) < max_len and all(x <= max_len for x in spans)
    assert len(clears) >= 1  # the steps are dropped when the cache regrows


def test_device_drafting_time_moves_from_verify_to_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the host does not wait for a static drafter step: the device's marks time it
    (``device_mark`` is None on the CPU, so stand-ins say drafting took 2 s on the device); each
    speculative step's draft record and the call's ``draft_s`` carry it, taken off verify."""
    from specrl.engine import decode

    e = engine("static", "eagle3")
    monkeypatch.setattr(decode, "device_mark", lambda device: object())
    monkeypatch.setattr(decode, "marked_seconds", lambda start, end: 2.0)
    e.record_steps = True
    run(e, GREEDY)
    drafted = [r.step_time_s for r in e.stats.step_records if r.kind == "draft"]
    assert drafted and drafted == pytest.approx([2.0] * len(drafted))
    assert e.stats.draft_s == pytest.approx(2.0 * len(drafted))
    assert e.stats.verify_s < 0  # the stand-in's 2 s were never spent: taken off all the same


@pytest.mark.parametrize("method", ["none", "ngram", "draft"])
def test_sampled_static_equals_uncaptured(method: str) -> None:
    """Temperature, top-k and top-p rows (hints other than plain): the same samples."""
    plain = run(engine("off", method), SAMPLED)
    static = run(engine("static", method), SAMPLED)
    assert [c.token_ids for c in static] == [c.token_ids for c in plain]


def test_ragged_acceptance_and_width_buckets() -> None:
    """Rows accept different numbers of drafts in one step and the batch shrinks through the
    buckets as rows finish: each (bucket, width) a step of its own, built once."""
    e = engine("static", "ngram", max_batch=8)
    run(e, GREEDY)
    accepted = [c.accepted for c in e.generate([Request(p, GREEDY) for p in PROMPTS])]
    assert len(set(accepted)) > 1
    widths = {key[1] for key in e.static.graphs._steps}
    assert widths - {8}  # some steps ran below the largest bucket
    assert e.static.graphs.captures == len(e.static.graphs)


class SwitchingEngine(Engine):
    """Stages an update after the second admission: it applies mid-call."""

    def __init__(self, model: Transformer, update: dict, **kw) -> None:
        super().__init__(model, **kw)
        self.update, self.admissions = update, 0

    def _admit(self, rows, pending, start) -> None:  # noqa: ANN001
        super()._admit(rows, pending, start)
        self.admissions += 1
        if self.admissions == 2:
            self.stage_weights(self.update, 5, "reverify")


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_inflight_update_static_equals_uncaptured(method: str) -> None:
    """Weights copied in place mid-call (the captured steps read the same tensors): the same
    tokens and versions as the uncaptured engine."""
    new = make_tiny(seed=12, vocab_size=VOCAB)
    update = {k: v.clone() for k, v in new.named_parameters()}
    outs = []
    for mode in ("off", "static"):
        spec = SpecConfig(method, 3) if method != "none" else None
        e = SwitchingEngine(make_tiny(seed=11, vocab_size=VOCAB), update, max_batch=4, spec=spec,
                            step_graphs=mode)  # fmt: skip
        outs.append(run(e, GREEDY))
    off, static = outs
    assert [c.token_ids for c in static] == [c.token_ids for c in off]
    assert [c.token_versions for c in static] == [c.token_versions for c in off]
    assert any(5 in c.token_versions for c in static)


def meta_inputs(width: int, tokens: int) -> dict[str, torch.Tensor]:
    ints = torch.zeros(width, 2 * tokens + 3, dtype=torch.int64, device="meta")
    return {"ints": ints, "floats": torch.ones(width, 2, device="meta")}


MOE = dict(model_type="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=16)  # fmt: skip


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("rule", ["distribution", "sample"])
def test_steps_read_no_device_data_on_the_host(rule: str, moe: bool) -> None:
    """A step on the meta device (no data: any bool(t), t.item(), t.tolist() raises) completes
    with the packed shapes: nothing in it waits for the device (capturable), an MoE target's
    expert routing and recording included."""
    with pytest.raises(Exception):  # noqa: B017, PT011 (the premise: meta data cannot be read)
        bool(torch.zeros(2, device="meta").any())
    with torch.device("meta"):
        model = Transformer(tiny_config(vocab_size=VOCAB, **(MOE if moe else {}))).eval()
    cache = model.new_cache(4, 16)
    layers = (0, 1)
    hints = SamplingHints.of([0.0, 0.7, 1.0, 1.0], [0, 5, 0, 0], [1.0, 0.9, 1.0, 1.0], VOCAB)
    packed, feats, routes = decode_step(model, cache, Static(8), layers, hints, meta_inputs(4, 1))
    assert packed.shape == (4, 3) and feats.shape[:2] == (4, 1)
    assert (routes.shape == (4, 1, 2, 2)) if moe else routes is None
    x = meta_inputs(4, 4) | {
        "drafts": torch.zeros(4, 3, dtype=torch.int64, device="meta"),
        "lengths": torch.zeros(4, dtype=torch.int64, device="meta"),
        "probs": torch.zeros(4, 3, VOCAB, device="meta"),
    }
    packed, _, _ = verify_step(model, cache, STATIC, (), hints, rule, x)
    assert packed.shape == (4, 2 + 3 * 4)


def test_buckets() -> None:
    assert buckets(1) == (1,)
    assert buckets(4) == (1, 2, 4)
    assert buckets(20) == (1, 2, 4, 8, 16, 20)
    assert buckets(64)[-3:] == (48, 56, 64)
    assert bucket_for(3, buckets(20)) == 4 and bucket_for(17, buckets(20)) == 20
    assert bucket_for(21, buckets(20)) is None
    with pytest.raises(ValueError, match="bucket limit"):
        buckets(0)
    spans = [span_for(n, 10_000) for n in (1, 256, 257, 385, 513, 769, 1025, 1537, 2049)]
    assert spans == [256, 256, 384, 512, 768, 1024, 1536, 2048, 3072]
    assert span_for(300, 290) == 290  # never past the cache


def test_step_graphs_reuse_static_buffers() -> None:
    """A key's inputs are copied into its static buffers: the second run sees the new values."""
    graphs = StepGraphs(torch.device("cpu"), capture=False)
    double = lambda x: x["a"] * 2  # noqa: E731
    assert graphs.run("k", double, {"a": torch.tensor([1.0])}).tolist() == [2.0]
    assert graphs.run("k", double, {"a": torch.tensor([3.0])}).tolist() == [6.0]
    assert (graphs.captures, graphs.replays, len(graphs)) == (1, 2, 1)
    graphs.clear()
    assert len(graphs) == 0
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        StepGraphs(torch.device("cpu"), capture=True)


def test_step_graphs_share_buffers_across_keys() -> None:
    """Keys share one buffer per input name / output index and dtype: widths visited from the
    largest down hold the largest key's bytes once; visited upwards at most 4x (a buffer too
    small is at least doubled); every key's results stay right; an output is valid until the
    next run of any key."""

    def step(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, None, torch.Tensor]:
        return x["a"] * 2, None, x["a"].sum(1, keepdim=True).to(torch.int64)  # [W, 3], [W, 1]

    widths = [64, 56, 8, 4, 1]
    for order in (widths, widths[::-1]):
        graphs = StepGraphs(torch.device("cpu"), capture=False)
        for w in order + order:  # built, then run again with new values
            a = torch.arange(3 * w, dtype=torch.float32).view(w, 3) + len(graphs)
            doubled, none, sums = graphs.run(w, step, {"a": a})
            assert none is None and torch.equal(doubled, a * 2)
            assert torch.equal(sums, a.sum(1, keepdim=True).to(torch.int64))
        largest = 64 * 3 * (4 + 4) + 64 * 8  # input and doubled (float32), sums (int64)
        assert (
            graphs.nbytes == largest if order[0] == 64 else largest < graphs.nbytes <= 4 * largest
        )
    graphs = StepGraphs(torch.device("cpu"), capture=False)
    graphs.run(4, step, {"a": torch.ones(4, 3)})
    first = graphs.run(1, step, {"a": torch.ones(1, 3)})[0]
    assert first.tolist() == [[2.0, 2.0, 2.0]]
    graphs.run(4, step, {"a": torch.zeros(4, 3)})
    assert first.tolist() == [[0.0, 0.0, 0.0]]  # key 4's run rewrote key 1's output


def test_modes_and_cache_slots() -> None:
    """'auto' is off on the CPU; 'capture' there is a one-line error; a static engine's cache
    has a slot for each padding row of its bucket (3 rows -> bucket 4)."""
    assert engine("auto", "none").static is None
    with pytest.raises(ValueError, match="needs a CUDA device"):
        engine("capture", "none")
    with pytest.raises(ValueError, match="step_graphs must be one of"):
        engine("graphs", "none")
    e = engine("static", "none", max_batch=8)
    e.generate([Request(p, GREEDY.replace(n=1)) for p in PROMPTS[:3]])
    assert e._kv.cache.slots >= 4


def freed_at_new(owner, old, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Filled in each time ``owner`` makes a new cache: whether ``old`` (the cache it had, held
    weakly) was freed by then."""
    seen, made = [], owner.new_cache

    def new_cache(*shape):
        gc.collect()
        seen.append(old() is None)
        return made(*shape)

    monkeypatch.setattr(owner, "new_cache", new_cache)
    return seen


@pytest.mark.parametrize("method", ["draft", "eagle3"])
def test_a_replaced_cache_is_freed_before_the_new_one(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call with more rows than the cache has slots makes a new target cache and drafter cache:
    the static steps built on the old ones let go of them first (old + new never both held);
    freeing the engine's cache (a backend's close) frees it."""
    e = engine("static", method)
    e.generate([Request(PROMPTS[0], GREEDY.replace(n=1))])
    assert len(e.static.graphs) and len(e.proposer.static.graphs)
    drafter = e.proposer.model if method == "draft" else e.proposer.head
    target_seen = freed_at_new(e.model, weakref.ref(e._kv.cache), monkeypatch)
    drafter_seen = freed_at_new(drafter, weakref.ref(e.proposer.cache), monkeypatch)
    e.generate([Request(p, GREEDY.replace(n=1)) for p in PROMPTS])
    assert target_seen == [True] and drafter_seen == [True]
    current = weakref.ref(e._kv.cache)
    e.free_cache()
    gc.collect()
    assert current() is None


def test_grouped_sdpa_takes_a_strided_kernel_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's memory-efficient kernel returns [B, H, M, D] as a transposed view of [B, M, H, D]:
    the grouped layout must not assume a contiguous output."""
    from specrl.models import attention

    real = torch.nn.functional.scaled_dot_product_attention

    def strided(q, k, v, attn_mask=None):  # noqa: ANN001, ANN202
        return real(q, k, v, attn_mask=attn_mask).transpose(1, 2).contiguous().transpose(1, 2)

    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    mask = torch.rand(2, 1, 3, 5) < 0.7
    mask[..., 0] = True
    want = attention.grouped_sdpa(q, k, v, mask)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", strided)
    torch.testing.assert_close(attention.grouped_sdpa(q, k, v, mask), want)
