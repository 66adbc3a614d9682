"""Static drafting steps (EAGLE-3, MTP, block, draft model): the same drafts (q to float
rounding) and completions as uncaptured drafting (engine and proposer level, rows moving between
slots, new and finished rows, a reduced draft vocabulary); weights loaded in place keep the
steps, a vocabulary switch drops them; the drafting step reads no device data on the host (meta
device)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specrl.engine import Engine
from specrl.models.graphs import StepGraphs, buckets
from specrl.models.heads import DraftHead
from specrl.models.transformer import Transformer
from specrl.rollout_types import Request
from specrl.sampling import STREAM_DRAFT, SamplingHints, SamplingParams
from specrl.spec.config import SpecConfig
from specrl.spec.proposers import static_draft
from specrl.spec.proposers.base import ProposerBatch
from specrl.spec.proposers.block import BlockProposer
from specrl.spec.proposers.draft_model import DraftModelProposer, model_draft_step
from specrl.spec.proposers.eagle3 import Eagle3Proposer, head_draft_step
from specrl.spec.proposers.mtp import MtpProposer
from specrl.spec.proposers.static_draft import PAD_SETTINGS, DraftKey, StaticDrafts, place
from tests.conftest import make_tiny, tiny_config
from tests.drafters.test_lossless_learned import noisy_head
from tests.engine.test_static_steps import SwitchingEngine

VOCAB = 8  # small: random drafters' drafts are accepted now and then
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 5, 6], [0, 0, 0], [4, 3, 2, 1, 4, 3, 2, 1, 4]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=14, n=2, seed=3, stop_token_ids=(7,))
SAMPLED = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, max_new_tokens=10, n=2, seed=4)
METHODS = ["draft", "eagle3", "mtp", "eagle3-vocab", "block", "block-vocab"]  # -vocab: reduced


def target() -> Transformer:
    return make_tiny(seed=11, vocab_size=VOCAB)


def draft_model(seed: int = 0) -> Transformer:
    """The target with noise on its weights: a draft model that agrees with it now and then."""
    model = target()
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def spec_for(method: str, model: Transformer, seed: int = 0) -> SpecConfig:
    if method == "draft":
        return SpecConfig("draft", 3)
    head = noisy_head(model, method, seed)
    return SpecConfig(head.kind, 3, options={"drafter": head})


def engine(mode: str, method: str, cls: type = Engine, **kw) -> Engine:
    """An engine over the tiny target with ``method`` (the same weights every time)."""
    model = target()
    draft = draft_model() if method == "draft" else None
    return cls(model, max_batch=4, spec=spec_for(method, model), draft_model=draft,
               step_graphs=mode, **kw)  # fmt: skip


def run(e: Engine, params: SamplingParams) -> list:
    return e.generate([Request(p, params) for p in PROMPTS])


def assert_same(static: list, off: list) -> None:
    """The same tokens, finishes and per-row draft and acceptance counts."""
    assert [c.token_ids for c in static] == [c.token_ids for c in off]
    assert [c.finish_reason for c in static] == [c.finish_reason for c in off]
    assert [(c.drafted, c.accepted) for c in static] == [(c.drafted, c.accepted) for c in off]


@pytest.mark.parametrize("method", METHODS)
def test_static_drafting_equals_uncaptured(method: str) -> None:
    """8 rows through 4 slots (rows retire and move), greedy and sampled: the same completions,
    token for token, and the same acceptance; every draft a static step; EAGLE-3/MTP read
    nothing back, the draft model its last drafts once per propose (a step later)."""
    accepted = 0
    for params in (GREEDY, SAMPLED):
        off = run(engine("off", method), params)
        e = engine("static", method)
        static = run(e, params)
        assert_same(static, off)
        assert e.stats.drafted > e.stats.accepted
        accepted += e.stats.accepted
        st = e.proposer.static
        assert st.graphs.captures == len(st.graphs) > 0
        proposes = st.graphs.replays  # each propose one static step
        assert proposes >= e.stats.spec_steps > 0
        assert st.host_reads == (proposes - 1 if method == "draft" else 0)
    assert accepted > 0


def test_hybrid_keeps_uncaptured_drafting() -> None:
    """The hybrid drafter (head drafts on sub-batches) gets no static drafting steps."""
    model = target()
    e = Engine(model, max_batch=4, spec=SpecConfig("hybrid", 3), step_graphs="static")
    assert e.proposer.static is None
    assert engine("static", "mtp").proposer.static is not None


# ---------------------------------------------------------------------- proposer level

STEPS = [([10, 11, 12], 3), ([12, 10, 13], 3), ([13, 14, 10, 12], 2), ([12, 13], 1), ([13], 3)]


def settings(rows: int) -> list[tuple[float, int, float]]:
    cycle = [(0.0, 0, 1.0), (0.75, 5, 0.875), (1.0, 0, 1.0), (0.5, 0, 0.75)]  # exact in fp32
    return [cycle[i % 4] for i in range(rows)]


def batch_of(row_ids: list[int], histories: dict, hidden: dict | None) -> ProposerBatch:
    s = settings(len(row_ids))
    return ProposerBatch(
        histories=[histories[r] for r in row_ids],
        group_keys=list(row_ids),
        row_ids=list(row_ids),
        temperature=torch.tensor([t for t, _, _ in s]),
        top_k=torch.tensor([k for _, k, _ in s]),
        top_p=torch.tensor([p for _, _, p in s]),
        seeds=torch.tensor(row_ids) * 7,
        counters=torch.tensor([len(histories[r]) for r in row_ids]),
        hidden=None if hidden is None else [hidden[r] for r in row_ids],
        settings=s,
    )


def drive(proposer, features: int) -> list:
    """``STEPS`` through ``proposer``: new rows, finished rows (11, 14), rows changing places,
    k changing; each row accepts some of its drafts. Returns every draft."""
    histories: dict[int, list[int]] = {}
    gen = torch.Generator().manual_seed(0)
    drafts, last = [], {}
    for step, (row_ids, k) in enumerate(STEPS):
        hidden = {}
        for r in row_ids:
            if r not in histories:
                histories[r] = torch.randint(0, VOCAB, (3 + r % 5,), generator=gen).tolist()
                new = len(histories[r]) - 1
            else:
                took = last[r][: (r + step) % (len(last[r]) + 1)]
                histories[r] = (
                    histories[r] + took + [int(torch.randint(0, VOCAB, (1,), generator=gen))]
                )
                new = len(took) + 1
            hidden[r] = torch.randn(new, features, generator=gen)
        if step == 2:
            proposer.finish(11, 11, [])
        if step == 4:
            proposer.finish(14, 14, [])
        d = proposer.propose(batch_of(row_ids, histories, hidden if features else None), k)
        drafts.append((d.tokens.clone(), d.lengths.clone(), d.probs.clone()))
        last = dict(zip(row_ids, d.tokens.tolist(), strict=True))
    return drafts


def proposers(method: str) -> tuple:
    """Two proposers of ``method`` with the same weights, the second drafting statically."""
    model = target()
    if method == "draft":
        pair = [DraftModelProposer(draft_model()) for _ in range(2)]
    else:
        head = noisy_head(model, method)
        cls = {"mtp": MtpProposer, "block": BlockProposer}.get(head.kind, Eagle3Proposer)
        pair = [cls(model, drafter=head) for _ in range(2)]
    pair[1].use_static(StepGraphs(torch.device("cpu"), capture=False), buckets(4))
    for p in pair:
        p.bind(4, 64, VOCAB)
    return tuple(pair)


@pytest.mark.parametrize("method", METHODS)
def test_proposer_static_drafts_equal_uncaptured(method: str) -> None:
    """The same batches through both: draft tokens equal and q to float rounding, with rows
    moving between slots, finishing, arriving, buckets 1 to 4 and k 1 to 3."""
    plain, static = proposers(method)
    features = 0 if method == "draft" else len(plain.hidden_layers) * target().config.hidden_size
    for (t0, n0, q0), (t1, n1, q1) in zip(drive(plain, features), drive(static, features),
                                          strict=True):  # fmt: skip
        assert torch.equal(t0, t1) and torch.equal(n0, n1)
        # attention over the whole cache sums in another order: rounding (large random weights)
        torch.testing.assert_close(q0, q1, rtol=1e-4, atol=1e-5)
    assert static.static.graphs.replays == len(STEPS)
    assert len({key.width for key in static.static.graphs._steps}) > 1  # several buckets


def test_place_binds_rows_to_batch_slots() -> None:
    """Row b to slot b; a row outside the batch keeps its slot or moves past the batch; the
    moves form one permutation-safe copy."""
    slot_of = {7: 0, 8: 1, 9: 2}  # row 9 is not in the batch, row 5 is new
    new, src, dst = place(slot_of, [8, 7, 5], 5)
    assert {r: new[r] for r in (8, 7, 5)} == {8: 0, 7: 1, 5: 2}
    assert new[9] in (3, 4)
    assert sorted(zip(src, dst, strict=True)) == sorted([(1, 0), (0, 1), (2, new[9])])
    with pytest.raises(RuntimeError, match="cache is full"):
        place({1: 0, 2: 1}, [3, 4], 3)


def test_hints_from_host_settings_or_read_and_counted() -> None:
    """Hints come from the batch's host settings, padding rows plain; a batch without them
    (built by hand) has its tensors read: the same hints, one host read counted."""
    drafts = StaticDrafts(StepGraphs(torch.device("cpu"), capture=False), buckets(4))
    histories = {r: [1, 2] for r in (1, 2, 3)}
    batch = batch_of([1, 2, 3], histories, None)
    hints = drafts.hints(batch, 4, VOCAB)
    assert drafts.host_reads == 0
    temps, top_ks, top_ps = zip(*settings(3), PAD_SETTINGS, strict=True)
    assert hints == SamplingHints.of(temps, top_ks, top_ps, VOCAB)
    assert drafts.hints(replace(batch, settings=None), 4, VOCAB) == hints
    assert drafts.host_reads == 1


# ---------------------------------------------------------------------- weights


@pytest.mark.parametrize("method", ["draft", "eagle3-vocab"])
def test_weights_loaded_in_place_keep_the_steps(method: str) -> None:
    """New drafter weights copied into place: the steps stay (the same objects) and the next
    call still equals the uncaptured engine with the same weights."""
    model = target()
    if method == "draft":
        state = dict(draft_model(seed=1).named_parameters())
    else:
        state = noisy_head(model, method, seed=1).state_dict()
    engines = [engine("off", method), engine("static", method)]
    for e in engines:
        run(e, GREEDY)
    steps = dict(engines[1].proposer.static.graphs._steps)
    outs = []
    for e in engines:
        e.proposer.load_weights({k: v.clone() for k, v in state.items()})
        outs.append(run(e, GREEDY))
    assert_same(outs[1], outs[0])
    kept = engines[1].proposer.static.graphs._steps
    assert all(kept.get(key) is step for key, step in steps.items())


def test_vocabulary_switch_drops_the_steps() -> None:
    """A head state with another draft vocabulary: the steps are built anew, same results."""
    model = target()
    other = DraftHead(model, "eagle3", draft_vocab=torch.arange(0, VOCAB, 3))
    state = noisy_head(model, "eagle3", seed=2).state_dict() | {"d2t": other.d2t}
    engines = [engine("off", "eagle3-vocab"), engine("static", "eagle3-vocab")]
    for e in engines:
        run(e, GREEDY)
    before = dict(engines[1].proposer.static.graphs._steps)
    outs = []
    for e in engines:
        e.proposer.load_weights(dict(state))
        outs.append(run(e, GREEDY))
    assert_same(outs[1], outs[0])
    after = engines[1].proposer.static.graphs._steps
    assert not any(after.get(key) is step for key, step in before.items())


def test_inflight_target_update_refreshes_the_reduced_lm_head() -> None:
    """Target weights copied in place mid-call: a reduced-vocabulary head's LM rows follow in
    place (the steps read them), the same tokens and versions as uncaptured."""
    update = {k: v.clone() for k, v in make_tiny(seed=12, vocab_size=VOCAB).named_parameters()}
    engines = [engine(mode, "eagle3-vocab", SwitchingEngine, update=update)
               for mode in ("off", "static")]  # fmt: skip
    head = engines[1].proposer.head
    rows = head.lm_head().weight
    before = rows.clone()
    outs = [run(e, GREEDY) for e in engines]
    assert_same(outs[1], outs[0])
    assert head.lm_head().weight is rows  # the same storage, the new target's rows
    assert torch.equal(rows, head.target.lm_head.weight[head.d2t])
    assert not torch.equal(rows, before)
    assert [c.token_versions for c in outs[1]] == [c.token_versions for c in outs[0]]
    assert any(5 in c.token_versions for c in outs[1])


# ---------------------------------------------------------------------- no host reads

W, K = 4, 3


def meta_inputs(width: int) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        return {
            "start": torch.zeros(W, 1, width),
            "positions": torch.zeros(W, K - 1, dtype=torch.int64),
            "floats": torch.ones(W, 2),
            "ints": torch.zeros(W, 3, dtype=torch.int64),
        }


def meta_steps() -> list:
    """Each static drafting step over meta tensors, with its expected output shapes."""
    with torch.device("meta"):
        model = Transformer(tiny_config(vocab_size=VOCAB)).eval()
    head = DraftHead(model, "eagle3", draft_vocab=torch.arange(0, VOCAB, 2))
    h = model.config.hidden_size
    return [  # the hints of the distribution each draws from: the head's reduced vocabulary
        (head_draft_step, head, head.new_cache(W + 1, 16), meta_inputs(h), VOCAB // 2),
        (model_draft_step, model, model.new_cache(W, 16), meta_inputs(h), VOCAB),
    ]


def check_meta_steps() -> None:
    for fn, module, cache, x, vocab in meta_steps():
        settings = ([0.0, 0.7, 1.0, 1.0], [0, 3, 0, 0], [1.0, 0.9, 1.0, 1.0])
        hints = SamplingHints.of(*settings, vocab)
        tokens, q = fn(module, cache, DraftKey(W, K, STREAM_DRAFT, hints), x)
        assert tokens.shape == (W, K) and q.shape == (W, K, VOCAB)


def test_drafting_steps_read_no_device_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """The drafting steps on the meta device (any read of tensor data raises), with a
    stand-in for ``draw`` (sampling's own reads are the hints' business, next test)."""

    def stand_in(logits, temperature, top_k, top_p, u, hints=None):  # noqa: ANN001, ANN202
        return logits.argmax(-1), torch.softmax(logits, -1)

    monkeypatch.setattr(static_draft, "draw", stand_in)
    check_meta_steps()


def test_drafting_steps_with_draw_read_no_device_data() -> None:
    """The same with the real ``draw`` given hints: no host read at all (capturable)."""
    check_meta_steps()
