"""``specrl export``: a run's checkpoint as a Hugging Face model directory (pipelines/export.py).

- A tiny run (a random Llama-shaped model directory with a real byte-level BPE tokenizer,
  ``model.name`` = it, two GRPO steps): transformers loads the export and its logits equal
  specrl's ``Transformer`` holding the checkpoint's weights to float32 rounding (and differ from
  the untrained model's: the weights are the run's); config, generation config and tokenizer
  files are the model's; ``--step`` picks an older checkpoint; a damaged newer one is skipped.
- The same from a run on 2 train workers (FSDP2 ranks on Ray; a DCP checkpoint).
- vLLM loads the export and its greedy tokens equal specrl's in fp32 (their logprobs to 1e-4).
- A checkpoint in bf16 with untied embeddings and a small shard size: HF's shards + index
  covering every tensor, each in bf16, and transformers loads it.
- ``--merge-drafter``: the EAGLE-3 head a run trained lands in OUT/drafter in vLLM's layout
  and reads back as the checkpoint's head; a run without one is refused.
- The CLI's bad inputs (and a checkpoint that does not fit the run's model, a model that is
  gone): one ``error:`` line, exit code 2, nothing written; a failure while writing (a full
  disk) leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from specrl.cli import app
from specrl.config import Config
from specrl.envs.synthetic import IdCodec, ModFourEnv
from specrl.models.checkpoints import hf_state_dict, load_model, load_state, load_tokenizer
from specrl.models.config import tiny_config as tiny_model_config
from specrl.models.transformer import Transformer
from specrl.pipelines.build import build_run
from specrl.pipelines.checkpoint import read_checkpoint, save_checkpoint
from specrl.pipelines.export import (
    INDEX,
    ModelExportError,
    expected_shapes,
    export_model,
    parse_size,
)
from specrl.pipelines.manifest import SHARDED
from specrl.pipelines.rundir import RunDir
from specrl.pipelines.train import train
from tests.conftest import ON_SERVER_WORKER
from tests.pipelines.pipeline_fakes import tiny_config
from tests.pipelines.test_kill_resume import make_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")

# A Llama shape vLLM's CPU attention runs (head_dim 64), small enough to train in seconds.
SHAPE = dict(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=1,
             head_dim=64, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)  # fmt: skip
RUN_SETS = ("run.steps=2", "run.checkpoint_every=1", "run.eval_every=0", "learner.lr=1e-2")
PROMPTS = [[5, 17, 42, 99, 7], [200, 3, 3, 150, 64, 12, 8, 77, 31], [1, 120, 250]]


def model_dir(path: Path, seed: int = 0, **shape) -> Path:
    """A HF model directory: ``make_model_dir``'s tokenizer (ChatML, bos 1, eos 2) and a random
    model of ``SHAPE`` (weights ~ N(0, 0.1^2)) over its vocabulary."""
    make_model_dir(path, seed)
    vocab = load_tokenizer(path).vocab_size
    config = tiny_model_config(**(SHAPE | {"vocab_size": vocab} | shape))
    torch.manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    save_file(hf_state_dict(model), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    return path


def run_config(model: Path, *sets: str) -> Config:
    return tiny_config(f"model.name={model}", *RUN_SETS, *sets)


def train_run(model: Path, run: Path, *sets: str) -> Path:
    """Two GRPO steps on ``model`` (the synthetic mod-4 task), a checkpoint after each."""
    torch.manual_seed(0)
    parts = build_run(run_config(model, *sets), codec=IdCodec(), env=ModFourEnv())
    try:
        train(parts, str(run), progress=False)
    finally:
        parts.close()
    return run


def checkpoint_policy(ckpt: Path, model: Path) -> Transformer:
    """specrl's float32 ``Transformer`` of ``model`` holding a one-process checkpoint's policy
    (read by ``read_checkpoint``, not by the export)."""
    policy = load_model(model)
    load_state(policy, {k: v.float() for k, v in read_checkpoint(ckpt).policy.items()})
    return policy


@torch.no_grad()
def specrl_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids])
    return model(x, torch.arange(len(ids))[None]).logits[0].float()  # [T, V]


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()  # [T, V]


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def assert_same_logits(hf, ours: Transformer) -> None:
    """Equal to float32 rounding on every prompt and position."""
    for ids in PROMPTS:
        want = specrl_logits(ours, ids)
        torch.testing.assert_close(hf_logits(hf, ids), want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return model_dir(tmp_path_factory.mktemp("export") / "model")


@pytest.fixture(scope="module")
def run(model, tmp_path_factory) -> Path:
    return train_run(model, tmp_path_factory.mktemp("export") / "run")


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory) -> Path:
    return export_model(run, tmp_path_factory.mktemp("export") / "hf")


# --------------------------------------------------------------------------- one process


def test_transformers_loads_the_export_and_matches_specrl_logits(run, model, exported):
    ckpt = RunDir(run).latest_checkpoint()
    assert ckpt.name == "step_000002"
    policy = checkpoint_policy(ckpt, model)
    hf = hf_model(exported)
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert_same_logits(hf, policy)
    # the run's weights, not the model it started from
    base = load_model(model)
    diff = (hf_logits(hf, PROMPTS[0]) - specrl_logits(base, PROMPTS[0])).abs().max()
    assert diff > 1e-3, diff


def test_the_export_has_the_models_config_tokenizer_and_generation_ids(model, exported):
    config = json.loads((exported / "config.json").read_text())
    source = json.loads((model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "float32"
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim",
                "vocab_size", "rope_theta", "rms_norm_eps"):  # fmt: skip
        assert config[key] == source[key], key
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (exported / name).read_bytes() == (model / name).read_bytes(), name
    assert "chat_template" in json.loads((exported / "tokenizer_config.json").read_text())
    gen = json.loads((exported / "generation_config.json").read_text())
    tok = load_tokenizer(model)
    assert gen["bos_token_id"] == tok.tok.token_to_id("<|im_start|>") == 1
    eos = gen["eos_token_id"]
    assert eos[0] == tok.eos_token_id == 2 and sorted(eos) == sorted(tok.stop_token_ids)
    with safe_open(str(exported / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names  # tied: HF ties it to the embedding
    assert names == set(expected_shapes(load_model(model).config))
    assert sorted(p.name for p in exported.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json"]
    )  # fmt: skip


def test_step_picks_an_older_checkpoint_and_a_damaged_newest_is_skipped(run, model, tmp_path):
    old = export_model(run, tmp_path / "old", step=1)
    policy = checkpoint_policy(run / "checkpoints/step_000001", model)
    assert_same_logits(hf_model(old), policy)
    newest = export_model(run, tmp_path / "newest")
    a = load_file(str(old / "model.safetensors"))
    b = load_file(str(newest / "model.safetensors"))
    assert any(not torch.equal(a[k], b[k]) for k in a)  # step 1 is not step 2
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    target = copy / "checkpoints/step_000002/policy.safetensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    result = cli(copy, tmp_path / "fallback")
    assert result.exit_code == 0, result.output
    note = "skipped damaged checkpoint step_000002 (policy.safetensors: sha256 mismatch)"
    assert note in result.stderr
    fallback = (tmp_path / "fallback/model.safetensors").read_bytes()
    assert fallback == (old / "model.safetensors").read_bytes()
    with pytest.raises(ModelExportError, match="step_000002 is damaged .*sha256 mismatch"):
        export_model(copy, tmp_path / "picked", step=2)
    (copy / "checkpoints/step_000001/state.json").write_text("{}")
    line = one_error(cli(copy, tmp_path / "picked"))
    assert "no checkpoint of" in line and "step_000002 (" in line and "step_000001 (" in line
    assert not (tmp_path / "picked").exists()


# --------------------------------------------------------------------------- train workers


@pytest.fixture(scope="module")
def ray_session(one_thread):
    pytest.importorskip("ray")
    from tests.backends.ray_helpers import local_ray

    yield from local_ray()


@ON_SERVER_WORKER
def test_a_two_worker_runs_sharded_checkpoint_exports_the_same_way(ray_session, model, tmp_path,
                                                                   monkeypatch):  # fmt: skip
    from specrl.rl.learner import Learner
    from specrl.rl.sharded_checkpoint import load_learner

    run = train_run(model, tmp_path / "run", "cluster.train_workers=2")
    ckpt = RunDir(run).latest_checkpoint()
    assert (ckpt / SHARDED).is_dir() and not (ckpt / "policy.safetensors").exists()
    assert len(list((ckpt / SHARDED).glob("shard-*.safetensors"))) == 2
    # the reference: the DCP checkpoint read back into a one-process learner by specrl's loader
    cfg = run_config(model)
    fresh = Learner(load_model(model), cfg.learner, max_len=8)
    load_learner(fresh, ckpt / SHARDED)
    out = export_model(run, tmp_path / "hf")
    tensors = load_file(str(out / "model.safetensors"))
    want = hf_state_dict(fresh.model)
    assert tensors.keys() == want.keys() and "lm_head.weight" not in tensors
    for name, t in want.items():
        assert torch.equal(tensors[name], t), name
    hf = hf_model(out)
    assert_same_logits(hf, fresh.model)
    base = load_model(model)
    diff = (hf_logits(hf, PROMPTS[0]) - specrl_logits(base, PROMPTS[0])).abs().max()
    assert diff > 1e-3, diff  # trained
    assert_vllm_greedy_equal(out, fresh.model, monkeypatch)


# --------------------------------------------------------------------------- vLLM


@torch.no_grad()
def specrl_greedy(model: Transformer, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """``n`` greedy tokens of ``model`` (argmax of a full forward per token) and their
    logprobs; each step's top-2 margin must leave no doubt which token is greedy."""
    ids, logprobs = list(prompt), []
    for _ in range(n):
        last = specrl_logits(model, ids)[-1]  # [V]
        top = last.topk(2).values
        assert top[0] - top[1] > 1e-4, ("a near tie: pick other prompts", ids, top)
        ids.append(int(last.argmax()))
        logprobs.append(float(torch.log_softmax(last, -1)[ids[-1]]))
    return ids[len(prompt) :], logprobs


def assert_vllm_greedy_equal(exported: Path, policy: Transformer, monkeypatch) -> None:
    """vLLM (fp32, eager) loads ``exported``; its greedy tokens equal ``policy``'s, their
    logprobs to 1e-4."""
    from specrl.backends.vllm import ENV_DEFAULTS, vllm_available
    from specrl.backends.vllm_worker import patch_vllm, process_state_kept

    if not vllm_available():
        pytest.skip("vllm is not installed (specrl[vllm])")
    for key, value in ENV_DEFAULTS.items() | {("VLLM_CPU_KVCACHE_SPACE", "1")}:
        if key not in os.environ:
            monkeypatch.setenv(key, value)
    patch_vllm()  # process-wide fixes other tests' engines in this process rely on
    from vllm import LLM, SamplingParams

    with process_state_kept():  # vLLM's worker reseeds and pins torch threads
        llm = LLM(model=str(exported), dtype="float32", enforce_eager=True, seed=0,
                  max_model_len=256, max_num_seqs=4)  # fmt: skip
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    for prompt, out in zip(PROMPTS, outs, strict=True):
        tokens, logprobs = specrl_greedy(policy, prompt, 12)
        assert list(out.outputs[0].token_ids) == tokens, prompt
        theirs = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
        torch.testing.assert_close(torch.tensor(theirs), torch.tensor(logprobs), rtol=0,
                                   atol=1e-4)  # fmt: skip


@ON_SERVER_WORKER
def test_vllm_loads_the_export_and_its_greedy_tokens_equal_specrls(run, model, exported,
                                                                  monkeypatch):  # fmt: skip
    policy = checkpoint_policy(RunDir(run).latest_checkpoint(), model)
    assert_vllm_greedy_equal(exported, policy, monkeypatch)


# --------------------------------------------------------------------------- sharding, bf16


def write_run(path: Path, model: Path, policy: Transformer, step: int = 3) -> Path:
    """A run directory with config.toml and one checkpoint of ``policy`` (no training)."""
    run = RunDir(path).create()
    run.config.write_text(run_config(model).to_toml())
    optimizer = torch.optim.AdamW(policy.parameters())
    save_checkpoint(run.checkpoint_dir(step), policy, optimizer,
                    {"step": step, "policy_version": step})  # fmt: skip
    return path


def test_small_shard_size_gives_hf_shards_and_index_in_the_checkpoints_bf16(tmp_path):
    model = model_dir(tmp_path / "model", seed=3, tie_word_embeddings=False)
    policy = load_model(model)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # not the model directory's weights
    bf16 = policy.to(torch.bfloat16)
    run = write_run(tmp_path / "run", model, bf16)
    out = export_model(run, tmp_path / "hf", shard_size=parse_size("40KB"))
    index = json.loads((out / INDEX).read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 3 and not (out / "model.safetensors").exists()
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                      for i in range(1, len(shards) + 1)]  # fmt: skip
    want = hf_state_dict(bf16)
    assert "lm_head.weight" in want  # untied
    assert set(index["weight_map"]) == set(want)
    assert set(index["weight_map"].values()) == set(shards)
    total = 0
    for shard in shards:
        tensors = load_file(str(out / shard))
        assert {n for n, f in index["weight_map"].items() if f == shard} == set(tensors)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= 40_000 or len(tensors) == 1, (shard, size)
        for name, t in tensors.items():
            assert t.dtype == torch.bfloat16 and torch.equal(t, want[name]), name
        total += size
    assert index["metadata"]["total_size"] == total
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["tie_word_embeddings"] is False
    reference = load_model(model)  # float32, with the bf16 weights upcast (exactly)
    load_state(reference, {k: v.float() for k, v in want.items()})
    assert_same_logits(hf_model(out), reference)


def test_a_checkpoint_that_does_not_fit_the_runs_model_or_a_lost_model_is_refused(tmp_path):
    model = model_dir(tmp_path / "model")
    deeper = load_model(model_dir(tmp_path / "deeper", num_layers=3))
    run = write_run(tmp_path / "run", model, deeper)  # config.toml names the 2-layer model
    with pytest.raises(ModelExportError, match="does not fit the run's model: it has "
                       "model.layers.2.*no place for"):  # fmt: skip
        export_model(run, tmp_path / "hf")
    shutil.rmtree(model)
    line = one_error(cli(run, tmp_path / "hf"))
    assert "the run's model" in line and "config.toml model.name" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deeper", "run"]


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500mb") == 5 * 10**8
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("1000") == 1000
    assert parse_size("1.5 KB") == 1500
    for bad in ("", "0", "-1", "5 GX", "nan", "inf", "1e400"):
        with pytest.raises(ValueError):
            parse_size(bad)


# --------------------------------------------------------------------------- drafter


HEAD_SETS = ("rollout.spec=eagle3", "drafter.mode=online", "rollout.max_new_tokens=12")


def test_merge_drafter_writes_the_trained_eagle3_head_in_vllms_layout(model, tmp_path, monkeypatch):
    from specrl.drafters.export import import_eagle3
    from specrl.models.head_kinds import fresh_head
    from specrl.models.heads import save_head

    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "cache"))  # no cached drafter
    policy = load_model(model)
    layers = (0, 1)  # not the default layers of a 2-layer target
    start = fresh_head(policy, "eagle3", seed=1, arch="eagle3", vocab=64)  # d2t: 64 ids
    start = type(start)(policy, "eagle3", layers, start.d2t, arch="eagle3")
    head_dir = save_head(start, tmp_path / "head")
    run = train_run(model, tmp_path / "run", *HEAD_SETS, f"rollout.drafter_path={head_dir}")
    ckpt = RunDir(run).latest_checkpoint()
    out = export_model(run, tmp_path / "hf", merge_drafter=True)
    config = json.loads((out / "drafter/config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2]  # vLLM's ids: layer + 1
    assert config["specrl_export"]["source"] == str(ckpt / "drafter.safetensors")
    files = sorted(p.name for p in (out / "drafter").iterdir())
    assert files == ["config.json", "manifest.json", "model.safetensors"]
    exported = load_model(out)  # specrl reads the export back as a model directory too
    head = import_eagle3(out / "drafter", exported)
    assert head.feature_layers == layers and torch.equal(head.d2t, start.d2t)
    saved = load_file(str(ckpt / "drafter.safetensors"))  # the trainer's state: param.<name>
    trained = {k.removeprefix("param."): v for k, v in saved.items() if k.startswith("param.")}
    ours = head.state_dict()
    assert set(trained) == set(ours) - {"d2t"}
    for name, t in trained.items():
        assert torch.equal(ours[name], t), name
    assert any(not torch.equal(t, start.state_dict()[n].float()) for n, t in trained.items())
    lm = load_file(str(out / "drafter/model.safetensors"))["lm_head.weight"]  # [Vd, H]
    torch.testing.assert_close(lm, exported.lm_head.weight[start.d2t], rtol=0, atol=0)


def test_merge_drafter_refuses_a_head_vllm_cannot_load(model, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "cache"))
    run = train_run(model, tmp_path / "run", *HEAD_SETS)  # from scratch: specrl's proj layout
    with pytest.raises(ModelExportError, match="'proj' layout"):
        export_model(run, tmp_path / "hf", merge_drafter=True)
    assert not (tmp_path / "hf").exists()
    assert export_model(run, tmp_path / "plain").is_dir()  # the policy alone exports


# --------------------------------------------------------------------------- CLI


def cli(*args: str):
    return CliRunner().invoke(app, ["export", *map(str, args)])


def one_error(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "Traceback" not in result.output
    return lines[0]


def test_cli_writes_the_directory_and_prints_it(run, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()  # an empty directory is replaced
    result = cli(run, out, "--step", "1")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().splitlines()[-1] == str(out)
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left


def test_cli_bad_inputs_are_one_line_before_any_work(run, tmp_path, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("the export started")

    monkeypatch.setattr("specrl.pipelines.export.write_export", no_work)
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    no_ckpt = tmp_path / "no_ckpt"
    no_ckpt.mkdir()
    (no_ckpt / "config.toml").write_text((run / "config.toml").read_text())
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    out = tmp_path / "out"
    cases = [
        ((tmp_path / "missing", out), "run dir", "does not exist"),
        ((a_file, out), "run dir", "is not a directory"),
        ((tmp_path, out), "no config.toml"),
        ((no_ckpt, out), "holds no checkpoint"),
        ((run, out, "--step", "7"), "no checkpoint of step 7", "steps 1, 2"),
        ((run, out, "--step", "-1"), "--step must be in [0, 1000000]"),
        ((run, full), "is not empty"),
        ((run, a_file), "is not a directory"),
        ((run, a_file / "under"), "cannot write OUT"),
        ((run, out, "--shard-size", "lots"), "--shard-size", "not a size"),
        ((run, out, "--merge-drafter"), "--merge-drafter", "holds no trained drafter"),
    ]
    if os.geteuid() != 0:  # root writes anywhere
        cases.append(((run, locked / "out"), "no permission to write"))
    try:
        for args, *words in cases:
            line = one_error(cli(*args))
            assert all(w in line for w in words), (args, words, line)
    finally:
        locked.chmod(0o700)
    assert not out.exists() and [p.name for p in full.iterdir()] == ["x"]


def test_help_explains_the_command():
    result = CliRunner().invoke(app, ["export", "--help"])
    assert result.exit_code == 0
    for words in ("Hugging Face", "--step", "--merge-drafter", "--shard-size", "vllm"):
        assert words in result.output, words


def test_a_failure_while_writing_leaves_nothing(run, tmp_path, monkeypatch):
    import specrl.pipelines.export as export

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "write_weights", full_disk)
    out = tmp_path / "out"
    line = one_error(cli(run, out))
    assert "No space left on device" in line
    assert list(tmp_path.iterdir()) == []
    out.mkdir()
    with pytest.raises(OSError):
        export_model(run, out)
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and not any(out.iterdir())
