"""Edges of ``specrl generate`` / ``specrl bench generate`` / ``--set`` / Ctrl-C (issue 20):
every bad input ends in exactly one ``error:`` line and exit code 2 before any work; a bad prompt
never stops the good ones (one line each, exit 2); nothing is silently ignored; results that
cannot be written are printed instead; Ctrl-C says so and exits 130.

``generate`` runs on a tiny random model directory (byte-level tokenizer, chat template) written
by a fixture, so no test here needs SmolLM2."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from tokenizers import pre_tokenizers
from typer.testing import CliRunner

from specrl import cli, cli_bench, cli_generate
from specrl.bench import BENCH_QUESTIONS
from specrl.cli import app
from specrl.config import Config, ConfigError, load_config
from specrl.models import checkpoints
from specrl.models.tokenizer import from_gguf_vocab
from tests.conftest import make_tiny

pytestmark = pytest.mark.usefixtures("one_thread")

CONTEXT = 64  # the tiny model's max_position_embeddings
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def write_tiny_model(path: Path, chat_template: str | None = TEMPLATE) -> Path:
    """A model directory ``--model`` accepts: tiny random weights, byte-level tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["<|im_end|>"]
    tok = from_gguf_vocab(tokens, [1] * 256 + [3], [], {"eos": 256}, chat_template)
    tok.save(path)
    model = make_tiny(vocab_size=len(tokens), max_position_embeddings=CONTEXT)
    save_file(checkpoints.hf_state_dict(model), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture
def no_work(monkeypatch):
    """Loading a model (or running a benchmark) fails the test: the error must come first."""

    def boom(*args, **kwargs):
        raise AssertionError("work started before the input was checked")

    monkeypatch.setattr(checkpoints, "load_model", boom)
    monkeypatch.setattr(checkpoints, "load_tokenizer", boom)
    monkeypatch.setattr("specrl.bench.run_generate_bench", boom)


def invoke(args: list[str]):
    return CliRunner().invoke(app, args)


def error_lines(result) -> list[str]:
    return [ln for ln in result.stderr.splitlines() if ln.strip()]


def assert_one_error(result, *words: str) -> str:
    """Exit code 2, nothing on stdout, exactly one line on stderr: ``error: ...``."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = error_lines(result)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert not result.stdout.strip(), result.stdout
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def gen(tiny_dir: Path, *args: str) -> list[str]:
    return ["generate", "--model", str(tiny_dir), "--dtype", "float32", "--json",
            "--max-new-tokens", "3", "--seed", "1", *args]  # fmt: skip


def answered(result) -> dict[int, int]:
    """prompt_index -> completions, from ``--json`` stdout."""
    out: dict[int, int] = {}
    for line in result.stdout.splitlines():
        row = json.loads(line)
        out[row["prompt_index"]] = out.get(row["prompt_index"], 0) + 1
    return out


# --------------------------------------------------------------------------- generate: prompts


def test_good_prompts_are_answered_with_exit_0(tiny_dir):
    result = invoke(gen(tiny_dir, "hello", "two", "--n", "2"))
    assert result.exit_code == 0, result.output
    assert answered(result) == {0: 2, 1: 2} and not error_lines(result)


def test_lone_surrogate_fails_only_its_prompt(tiny_dir, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('"good one"\n"\\ud800 bad"\n{"prompt": "good two"}\n')
    result = invoke(gen(tiny_dir, "--prompts-file", str(f)))
    assert result.exit_code == 2, result.output
    lines = error_lines(result)
    assert len(lines) == 1 and lines[0].startswith("error: prompt 2: "), lines
    assert "lone surrogate \\ud800" in lines[0]
    assert answered(result) == {0: 1, 2: 1}  # numbered among every prompt given


@pytest.mark.parametrize(
    "item, why",
    [
        ("42", "got a number (42)"),
        ('{"prompt": 42}', "got a number (42)"),
        ("[1, 2]", "got a list"),
        ("null", "got null"),
        ("true", "got a boolean"),
        ('{"text": "hi"}', 'with neither a "prompt" nor a "messages" key'),
        ('{"prompt": {"a": 1}}', "got an object"),
        ('"   "', "empty prompt"),
        ('{"messages": []}', '"messages" to be a non-empty list'),
        ('{"messages": [{"role": "user"}]}', '"messages" to be a non-empty list'),
        ('{"messages": [{"role": "user", "content": " "}]}', "empty prompt"),
        ('{"messages": [{"role": "user", "content": "\\ud800"}]}', "lone surrogate"),
        ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "both"),
    ],
)
def test_non_string_prompt_fails_only_its_prompt(tiny_dir, tmp_path, item, why):
    f = tmp_path / "p.jsonl"
    f.write_text(f'"first"\n{item}\n\n"third"\n')
    result = invoke(gen(tiny_dir, "arg prompt", "--prompts-file", str(f)))
    assert result.exit_code == 2, result.output
    lines = error_lines(result)
    assert len(lines) == 1 and lines[0].startswith("error: prompt 3: "), lines
    assert why in lines[0]
    assert answered(result) == {0: 1, 1: 1, 3: 1}


def test_chat_messages_are_prompts_with_the_chat_template(tiny_dir, tmp_path):
    """The JSONL format ``train-drafter --prompts`` reads too (``specrl.jsonl_prompts``): a
    {"messages": [...]} line is rendered with the chat template, as a bare string is."""
    f = tmp_path / "p.jsonl"
    rows = ["hi", {"prompt": "hi"}, {"messages": [{"role": "user", "content": "hi"}]}]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    result = invoke(gen(tiny_dir, "--prompts-file", str(f)))
    assert result.exit_code == 0, result.output
    out = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt_index"] for r in out] == [0, 1, 2]
    assert out[0]["token_ids"] == out[1]["token_ids"] == out[2]["token_ids"]  # same prompt, seed
    plain = invoke(gen(tiny_dir, "--no-chat-template", "--prompts-file", str(f)))
    lines = error_lines(plain)
    assert plain.exit_code == 2 and len(lines) == 1, plain.output
    assert lines[0].startswith("error: prompt 3: ") and "needs the chat template" in lines[0]


def test_prompt_too_long_for_the_context_fails_alone(tiny_dir):
    result = invoke(gen(tiny_dir, "ok", "x" * (2 * CONTEXT), "fine", "--n", "3"))
    assert result.exit_code == 2, result.output
    lines = error_lines(result)
    assert len(lines) == 1 and lines[0].startswith("error: prompt 2: prompt has "), lines
    assert answered(result) == {0: 3, 2: 3}


def test_every_prompt_bad_exits_before_loading_the_model(tiny_dir, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("model loaded for nothing")

    monkeypatch.setattr(checkpoints, "load_model", boom)
    f = tmp_path / "p.jsonl"
    f.write_text('42\n"\\udfff"\n')
    result = invoke(gen(tiny_dir, "--prompts-file", str(f)))
    assert result.exit_code == 2
    assert [ln.split(":")[0:2] for ln in error_lines(result)] == [
        ["error", " prompt 1"],
        ["error", " prompt 2"],
    ]
    assert not result.stdout.strip()


def unreadable_paths(tmp: Path) -> dict[str, tuple[Path, str]]:
    (tmp / "binary.jsonl").write_bytes(b'"ok"\n\xff\xfe\x00\x81garbage\n')
    (tmp / "dir.jsonl").mkdir()
    (tmp / "afile").write_text("x")
    return {
        "binary": (tmp / "binary.jsonl", "not UTF-8"),
        "directory": (tmp / "dir.jsonl", "is a directory"),
        "missing": (tmp / "missing.jsonl", "not found"),
        "under-a-file": (tmp / "afile" / "p.jsonl", "cannot read prompts file"),
        "not-json": (tmp / "afile", "not JSON"),
    }


@pytest.mark.parametrize("kind", ["binary", "directory", "missing", "under-a-file", "not-json"])
def test_unreadable_prompts_file_is_one_line(tmp_path, no_work, kind):
    path, words = unreadable_paths(tmp_path)[kind]
    assert_one_error(invoke(["generate", "--prompts-file", str(path)]), words, str(path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_prompts_file_without_read_permission_is_one_line(tmp_path, no_work):
    f = tmp_path / "p.jsonl"
    f.write_text('"x"\n')
    f.chmod(0)
    assert_one_error(invoke(["generate", "--prompts-file", str(f)]), "cannot read prompts file")


def test_tokenizer_without_chat_template_is_one_line(tmp_path):
    bare = write_tiny_model(tmp_path / "bare", chat_template=None)
    assert_one_error(invoke(gen(bare, "hi")), "no chat template", "--no-chat-template")
    result = invoke(gen(bare, "hi", "--no-chat-template"))
    assert result.exit_code == 0 and answered(result) == {0: 1}, result.output


# --------------------------------------------------------------------------- generate: options


@pytest.mark.parametrize(
    "args, words",
    [
        (["--temperature", "inf"], ["temperature", "finite", "inf"]),
        (["--temperature", "nan"], ["temperature", "finite", "nan"]),
        (["--temperature", "-1"], ["temperature must be >= 0"]),
        (["--top-p", "0"], ["top_p", "(0, 1]"]),
        (["--top-p", "1.5"], ["top_p", "1.5"]),
        (["--top-p", "nan"], ["top_p", "nan"]),
        (["--top-k", "-1"], ["top_k must be >= 0"]),
        (["--max-new-tokens", "0"], ["max_new_tokens must be >= 1"]),
        (["--n", "0"], ["n must be >= 1"]),
        (["--seed", "18446744073709551616"], ["seed", "2**63 - 1", "18446744073709551616"]),
        (["--seed", "9223372036854775808"], ["seed", "2**63 - 1"]),
        (["--seed", "-1"], ["seed", "-1"]),
        (["--max-batch", "0"], ["--max-batch must be >= 1"]),
        (["--num-spec-tokens", "99", "--spec", "ngram"], ["num_spec_tokens"]),
        (["--spec-siblings", "99"], ["siblings"]),
        (["--spec", "bogus"], ["unknown speculation method 'bogus'"]),
        (["--spec-exact", "bitwise"], ["spec_exact", "'bitwise'"]),
        (["--spec", "draft", "--spec-exact", "sample", "--spec-siblings", "2"], ["no siblings"]),
        (["--dtype", "float8"], ["unknown dtype"]),
        (["--model", "/no/such/model"], ["does not exist"]),
        # issue 42: bounded where parsed; nothing given where it cannot apply
        (["--top-k", "9223372036854775808"], ["--top-k", "10000000"]),
        (["--n", "100000000"], ["--n", "65536"]),
        (["--max-batch", str(10**30)], ["--max-batch", "4096"]),
        (["--spec", "ngram", "--spec-siblings", "3"], ["spec_siblings=3", "not to spec 'ngram'"]),
        (["--spec-siblings", "3"], ["spec_siblings=3", "not to spec 'none'"]),
        (["--num-spec-tokens", "5"], ["--num-spec-tokens applies only with --spec"]),
        (["--spec", "ngram", "--num-spec-tokens", "0"], ["--num-spec-tokens 0 drafts nothing"]),
        (["--spec", "ngram", "--drafter", "x"], ["--drafter applies only with", "not ngram"]),
    ],
)
def test_bad_generate_option_is_one_line_before_work(monkeypatch, args, words):
    if "--model" not in args:  # the model's own check needs load_tokenizer itself
        monkeypatch.setattr(checkpoints, "load_tokenizer", _boom)
    monkeypatch.setattr(checkpoints, "load_model", _boom)
    assert_one_error(invoke(["generate", "hi", *args]), *words)


def _boom(*args, **kwargs):
    raise AssertionError("work started before the input was checked")


def test_largest_seed_is_accepted_and_differs_from_seed_0(tiny_dir):
    def tokens(seed: str) -> list[int]:
        result = invoke(gen(tiny_dir, "hi", "--temperature", "1", "--max-new-tokens", "12",
                            "--seed", seed))  # fmt: skip
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout.splitlines()[0])["token_ids"]

    assert tokens(str(2**63 - 1)) != tokens("0")


def test_spec_exact_sample_prints_what_plain_sampling_prints(tiny_dir):
    def tokens(*spec: str) -> list[list[int]]:
        result = invoke(gen(tiny_dir, "hi", "w1 w2 w1 w2 w1", "--temperature", "1", "--n", "2",
                            "--max-new-tokens", "16", "--seed", "5", *spec))  # fmt: skip
        assert result.exit_code == 0, result.output
        return [json.loads(line)["token_ids"] for line in result.stdout.splitlines()]

    plain = tokens()
    assert tokens("--spec", "ngram", "--spec-exact", "sample") == plain
    assert tokens("--spec", "self", "--spec-exact", "sample") == plain
    assert tokens("--spec", "self") != plain  # the standard rule: same distribution, not tokens


# --------------------------------------------------------------------------- bench generate


@pytest.fixture
def no_vllm(monkeypatch):
    real = cli_bench.importlib.util.find_spec
    monkeypatch.setattr(
        cli_bench.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "vllm" else real(name),
    )


@pytest.mark.parametrize(
    "args, words",
    [
        (["--repeats", "0"], ["--repeats must be >= 1, got 0"]),
        (["--repeats", "-3"], ["--repeats must be >= 1"]),
        (["--new-tokens", "0"], ["--new-tokens must be >= 1"]),
        (["--batch-sizes", "0"], ["batch sizes must be >= 1"]),
        (["--batch-sizes", "a,b"], ["--batch-sizes must be integers"]),
        (["--compare", "sglang"], ["unknown --compare engine 'sglang'"]),
        (["--spec", "bogus"], ["unknown speculation method"]),
        (["--group-size", "3", "--batch-sizes", "4"], ["--group-size 3"]),
        (["--batch-sizes", "99999999999999999999"], ["batch sizes must be <= 4096"]),
        (["--batch-sizes", "1,,2"], ["no empty entry", "'1,,2'"]),
        (["--spec", "ngram", "--num-spec-tokens", "0"], ["--num-spec-tokens 0 drafts nothing"]),
        (["--num-spec-tokens", "4"], ["--num-spec-tokens applies only with --spec"]),
        (["--dtype", "int8"], ["unknown dtype"]),
        (["--model", "/no/such/model"], ["does not exist"]),
        (
            ["--spec-exact", "bits"],
            ["--spec-exact must be one of distribution, sample, got 'bits'"],
        ),
    ],
)
def test_bad_bench_option_is_one_line_before_work(no_work, args, words):
    assert_one_error(invoke(["bench", "generate", *args]), *words)


def test_compare_vllm_without_vllm_is_refused(no_work, no_vllm):
    assert_one_error(
        invoke(["bench", "generate", "--compare", "hf,vllm"]),
        "--compare vllm needs the vllm extra (pip install 'specrl[vllm]')",
    )


@pytest.mark.parametrize("kind", ["directory", "under-a-file", "under-a-file-deeper", "proc"])
def test_unwritable_json_path_is_refused_before_the_benchmark(tmp_path, no_work, kind):
    (tmp_path / "dir").mkdir()
    (tmp_path / "afile").write_text("x")
    path, words = {
        "directory": (tmp_path / "dir", "is a directory"),
        "under-a-file": (tmp_path / "afile" / "out.json", f"{tmp_path / 'afile'} is a file"),
        "under-a-file-deeper": (tmp_path / "afile" / "a" / "out.json", "afile is a file"),
        "proc": (Path("/proc/specrl-bench-test.json"), "cannot write --json"),
    }[kind]
    assert_one_error(invoke(["bench", "generate", "--json", str(path)]), words)
    assert (tmp_path / "afile").read_text() == "x" and not list((tmp_path / "dir").iterdir())


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_json_path_without_write_permission_is_refused(tmp_path, no_work):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    assert_one_error(invoke(["bench", "generate", "--json", str(locked / "o.json")]), "--json")


RESULT = {"meta": {"command": "test"}, "results": [{"engine": "specrl", "tokens_per_s": 1.0}]}


def test_json_written_and_not_left_behind_when_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("specrl.bench.run_generate_bench", lambda b: RESULT)
    monkeypatch.setattr(checkpoints, "resolve_model", lambda m: Path(m))
    out = tmp_path / "new" / "deep" / "r.json"
    result = invoke(["bench", "generate", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text()) == RESULT
    refused = invoke(["bench", "generate", "--repeats", "0", "--json", str(tmp_path / "x.json")])
    assert refused.exit_code == 2 and not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("rule", ["distribution", "sample"])
def test_bench_spec_exact_reaches_the_benchmark(monkeypatch, rule):
    seen = []
    monkeypatch.setattr("specrl.bench.run_generate_bench", lambda b: seen.append(b) or RESULT)
    monkeypatch.setattr(checkpoints, "resolve_model", lambda m: Path(m))
    result = invoke(["bench", "generate", "--spec", "ngram", "--spec-exact", rule])
    assert result.exit_code == 0, result.output
    assert seen[0].exact == rule and seen[0].methods == ["ngram"]


def test_results_printed_when_the_final_write_fails(tmp_path, monkeypatch):
    """The path was writable up front; during the run its directory became a file."""
    target = tmp_path / "out"

    def run(bench):
        target.rmdir()
        target.write_text("now a file")
        return RESULT

    target.mkdir()
    monkeypatch.setattr("specrl.bench.run_generate_bench", run)
    monkeypatch.setattr(checkpoints, "resolve_model", lambda m: Path(m))
    result = invoke(["bench", "generate", "--json", str(target / "r.json")])
    assert result.exit_code == 2
    assert json.loads(result.stdout) == RESULT  # nothing lost
    lines = error_lines(result)
    assert len(lines) == 1 and lines[0].startswith("error: cannot write --json"), lines


class FakeVllm:
    """A stand-in ``vllm`` module recording what the benchmark asks of it."""

    calls: list[dict] = []

    class SamplingParams:
        def __init__(self, **kw) -> None:
            self.kw = kw

    class LLM:
        def __init__(self, **kw) -> None:
            FakeVllm.calls.append({"init": kw})

        def generate(self, inputs, params, use_tqdm=True):
            FakeVllm.calls.append({"inputs": inputs, "params": params.kw})
            n = params.kw["max_tokens"]
            out = types.SimpleNamespace(token_ids=list(range(n)))
            return [types.SimpleNamespace(outputs=[out]) for _ in inputs]


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = FakeVllm.LLM, FakeVllm.SamplingParams
    monkeypatch.setitem(sys.modules, "vllm", module)
    real = cli_bench.importlib.util.find_spec
    monkeypatch.setattr(
        cli_bench.importlib.util,
        "find_spec",
        lambda name, *a: types.SimpleNamespace() if name == "vllm" else real(name),
    )
    FakeVllm.calls = []
    return FakeVllm


def test_compare_vllm_runs_vllm_on_the_same_prompts(tiny_dir, tmp_path, fake_vllm):
    """--compare vllm is not accepted-and-ignored: vLLM generates exactly new_tokens on the
    same token prompts (min_tokens = max_tokens), and its row and ratio are in the JSON."""
    out = tmp_path / "r.json"
    result = invoke(["bench", "generate", "--model", str(tiny_dir), "--dtype", "float32",
                     "--batch-sizes", "2,4", "--new-tokens", "5", "--group-size", "2",
                     "--compare", "vllm", "--json", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    rows = {(r["engine"], r["batch_size"]): r for r in data["results"]}
    assert set(rows) == {("specrl", 2), ("vllm", 2), ("specrl", 4), ("vllm", 4)}
    assert rows["vllm", 4]["new_tokens"] == 5
    assert any(r["name"] == "specrl" and r["baseline"] == "vllm" for r in data["ratios"])
    inits = [c["init"] for c in fake_vllm.calls if "init" in c]
    assert inits == [{"model": str(tiny_dir), "dtype": "float32", "seed": 0}]  # built once
    timed = [c for c in fake_vllm.calls if "params" in c and c["params"]["max_tokens"] == 5]
    assert timed and all(c["params"]["min_tokens"] == 5 for c in timed)
    assert all(c["params"]["ignore_eos"] for c in timed)
    prompts = [x["prompt_token_ids"] for x in timed[0]["inputs"]]
    assert len(prompts) == 2 and prompts[0] == prompts[1]  # one prompt, group of 2
    tok = checkpoints.load_tokenizer(tiny_dir)
    assert prompts[0] == tok.encode_chat(BENCH_QUESTIONS[0])  # the prompt specrl gets


def test_bench_with_a_learned_drafter_and_no_head_is_one_line(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "cache"))
    result = invoke(["bench", "generate", "--model", str(tiny_dir), "--dtype", "float32",
                     "--batch-sizes", "1", "--new-tokens", "2", "--spec", "eagle3"])  # fmt: skip
    assert_one_error(result, "needs a trained head", "specrl train-drafter --drafter eagle3")


# --------------------------------------------------------------------------- fuzz

TEXT = st.text(st.characters(exclude_categories=()), max_size=12)  # lone surrogates too
JSON_ITEMS = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=4,
)
LINES = st.lists(
    JSON_ITEMS.map(json.dumps) | st.builds(lambda t: json.dumps({"prompt": t}), TEXT) | TEXT,
    min_size=1,
    max_size=4,
)


def assert_contract(result) -> None:
    """Success, or exit 2 with only ``error:`` lines on stderr; never a traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = error_lines(result)
    assert all(ln.startswith("error: ") for ln in lines), lines
    assert (result.exit_code, bool(lines)) in ((0, False), (2, True)), (result.exit_code, lines)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=LINES)
def test_fuzz_prompts_files(tiny_dir, tmp_path_factory, lines):
    f = tmp_path_factory.mktemp("fuzz") / "p.jsonl"
    f.write_text("\n".join(lines), encoding="utf-8", errors="surrogatepass")
    assert_contract(invoke(gen(tiny_dir, "--max-new-tokens", "1", "--prompts-file", str(f))))


@settings(max_examples=30, deadline=None)
@given(data=st.binary(max_size=64))
def test_fuzz_binary_prompts_files(tmp_path_factory, data):
    f = tmp_path_factory.mktemp("fuzz") / "p.jsonl"
    f.write_bytes(data)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoints, "load_model", _boom)
        mp.setattr(checkpoints, "load_tokenizer", _boom)
        result = invoke(["generate", "--prompts-file", str(f)])
    assert result.exit_code == 2  # no good prompt survives the boom: never gets that far
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert all(ln.startswith("error: ") for ln in error_lines(result))


CONFIG_KEYS = [f"{section}.{key}" for section, cls in type(Config()).model_fields.items()
               for key in cls.annotation.model_fields]  # fmt: skip
TOML_VALUES = st.sampled_from(
    ["true", "false", "0", "-1", "3", "2.5", "inf", "nan", "-inf", '"x"', '"3"', "[1, 2]",
     "[0.9, 0.95]", "{a = 1}", "1e400", "18446744073709551616", "", "[", "auto"]
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(key=st.sampled_from(CONFIG_KEYS), value=TOML_VALUES)
def test_fuzz_config_overrides(key, value):
    """Every ``--set key=value`` gives a valid config or one ``ConfigError`` line; a value that
    is accepted has the field's type (no bool for an int, no string for a number)."""
    try:
        cfg = load_config(None, [f"{key}={value}"])
    except ConfigError as e:
        assert "\n" not in str(e) and str(e)
        return
    section, name = key.split(".")
    got = getattr(getattr(cfg, section), name)
    default = getattr(getattr(Config(), section), name)
    if isinstance(default, bool):
        assert isinstance(got, bool)
    elif isinstance(default, int) and name != "max_tokens_per_forward":
        assert type(got) is int
    elif isinstance(default, float):
        assert type(got) is float and math.isfinite(got)


# --------------------------------------------------------------------------- config --set


@pytest.mark.parametrize(
    "override, words",
    [
        ("run.steps=true", ["run.steps", "expected an integer", "true"]),
        ("rollout.temperature=inf", ["rollout.temperature", "finite"]),
        ('learner.lr="1e-5"', ["learner.lr", "expected a number"]),
    ],
)
def test_train_set_with_a_wrong_type_is_one_line(tmp_path, monkeypatch, override, words):
    monkeypatch.setenv("SPECRL_CACHE", str(tmp_path / "cache"))
    result = invoke(["train", "--run-dir", str(tmp_path / "run"), "--set", override])
    assert_one_error(result, *words)
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_prints_one_line_and_exits_130(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_generate, "read_prompts", interrupted)
    monkeypatch.setattr(sys, "argv", ["specrl", "generate", "hi"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 130
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err == ["error: interrupted by Ctrl-C"]


def test_other_exits_get_no_interrupt_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["specrl", "generate", "--n", "0", "hi"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "interrupted" not in err and err.startswith("error: n must be >= 1")


def test_command_name_skips_options():
    assert cli.command_name(["--help"]) is None
    assert cli.command_name(["train", "--set", "x=1"]) == "train"
    assert cli.command_name(["bench", "generate"]) == "bench"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a FIFO")
def test_sigint_during_generate_says_interrupted(tmp_path):
    """A real process blocked reading its prompts file (a FIFO nobody writes) gets SIGINT."""
    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from specrl.cli import main; main()",
            "generate",
            "--prompts-file",
            str(fifo),
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        # a suite started in the background (``pytest &``) ignores SIGINT, and so would the
        # child (Python keeps an inherited SIG_IGN): start it as a terminal would
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        with open(fifo, "w"):  # returns once the process has opened the FIFO to read it
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert [ln for ln in err.splitlines() if ln.strip()] == ["error: interrupted by Ctrl-C"]
    assert not out
