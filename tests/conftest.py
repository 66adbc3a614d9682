"""Shared fixtures: tiny random models for speed, the real SmolLM2 for slow tests."""

from __future__ import annotations

import gc
import os
import sys

import pytest
import torch

from specrl.malloc import return_freed_memory
from specrl.models.config import tiny_config
from specrl.models.transformer import Transformer

# Devices the exactness tests run on: the CPU, and CUDA where present (`specrl bench gpu`
# runs them there with ``-k cuda``).
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def make_tiny(seed: int = 0, **overrides) -> Transformer:
    """A tiny random decoder (fp32, eval mode, no grad)."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model.eval().requires_grad_(False)


def assert_teacher_forced(target: Transformer, layers, seen) -> None:
    """Each (history, features [n, F]) in ``seen``, handed to a drafter, equals the target's
    teacher-forced outputs of ``layers`` at history positions len-1-n .. len-2."""
    for history, feats in seen:
        n = feats.shape[0]
        ids = torch.tensor([history])
        full = target(ids, torch.arange(len(history))[None], capture=layers)
        want = torch.cat(full.captured, -1)[0, len(history) - 1 - n : len(history) - 1]
        torch.testing.assert_close(feats, want, atol=1e-4, rtol=1e-4)


@pytest.fixture
def tiny() -> Transformer:
    return make_tiny()


@pytest.fixture(scope="session")
def smollm2() -> Transformer:
    from specrl.models.checkpoints import load_model

    return load_model(dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_bf16() -> Transformer:
    from specrl.models.checkpoints import load_model

    return load_model(dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def smollm2_tok():
    from specrl.models.checkpoints import load_tokenizer

    return load_tokenizer()


# pytest-xdist group (``make test`` runs two workers, ``--dist loadgroup``): the tests of a group
# run on one worker, one after another. Every test that starts a Ray cluster or builds vLLM
# engines (in process or in a subprocess) takes GBs: with the vLLM ones on both workers a worker
# was killed for memory, and with vLLM on one worker beside a Ray run on the other (CI's 24 GiB
# down to 1.3-1.8 GB available) Ray's memory monitor killed the run's actors. One group for both.
ON_SERVER_WORKER = pytest.mark.xdist_group("servers")
# The vLLM engines of the tests (tiny runs, a few short sequences) get a 1 GiB KV cache instead of
# the backend's 2 GiB: the online-drafter tests peak at 12-13 GB of resident memory on their
# worker, and the other worker's tests share CI's 24 GiB (a worker was killed for memory).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "solo: needs most of the machine's memory (10-13 GB resident); `make test` runs these "
        "after the parallel run, one at a time",
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a ``--dist loadgroup`` worker, stop the run when xdist did not tag a grouped test's id
    with its group: the groups would be ignored without a word (pytest 9.2 with xdist 3.8.0 did
    that, and CI's two workers then ran vLLM engines side by side until one was killed). The
    message goes to the real stderr: a worker's own report of why it stopped is not shown."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
            sys.__stderr__.write(
                f"pytest-xdist did not group {item.nodeid} (pytest {pytest.__version__}): its "
                "xdist_group marks would be ignored; install the pinned pytest (make install)\n"
            )
            pytest.exit("pytest-xdist ignored the xdist_group marks", returncode=4)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After a module's last test (its module fixtures torn down), a worker holding more than
    ``TRIM_ABOVE_MB`` collects garbage and hands freed heap back to the system: a worker that ran
    the vLLM tests kept ~8 GB to the end of the run, ~3 GB of it freed but not returned, and
    beside the next vLLM subprocess and a Ray training run Ray's memory monitor killed actors."""
    result = yield
    if (nextitem is None or nextitem.module is not item.module) and resident_mb() > TRIM_ABOVE_MB:
        gc.collect()
        return_freed_memory()
    return result


TRIM_ABOVE_MB = 2048


def resident_mb() -> int:
    """This process's resident memory (MiB), from /proc."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20


# Twenty varied prompts for equivalence tests on the real model.
PROMPTS = [
    "What is 2+2?",
    "Write a haiku about autumn.",
    "Name three colors.",
    "Explain gravity to a child.",
    "What is the capital of Japan?",
    "List the days of the week.",
    "Translate 'thank you' into French.",
    "Give me a synonym for happy.",
    "How many legs does a cat have?",
    "What is the boiling point of water in Celsius?",
    "Write one sentence about the ocean.",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "Spell the word 'banana' backwards.",
    "What color is the sky on a clear day?",
    "Suggest a name for a pet goldfish.",
    "What is the opposite of cold?",
    "Describe a rainbow in five words.",
    "Count from one to five.",
    "Why do leaves change color in the fall?",
]


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (tiny models: thread start-up costs more than it saves,
    and two threads crawl on a busy 2-core box); the previous count is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
