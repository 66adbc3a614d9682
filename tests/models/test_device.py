"""The device setting: resolution, refusals before any work, and the engine's memory budget."""

from __future__ import annotations

import pytest
import torch

from specrl.backends import plan_rollout
from specrl.config import ConfigError, load_config
from specrl.engine import Engine
from specrl.models import device as device_module
from specrl.models.device import (
    DeviceError,
    memory_budget,
    on,
    peak_flops,
    resolve_device,
)
from specrl.models.precision import resolve_precision
from specrl.rollout_types import Request
from specrl.sampling import SamplingParams
from tests.conftest import make_tiny

NO_CUDA = not torch.cuda.is_available()


def test_auto_is_cuda_when_present_else_cpu():
    assert resolve_device("auto").type == ("cpu" if NO_CUDA else "cuda")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:-1", "CPU", "", "cuda:0:1"])
def test_unknown_device_names_are_refused(name):
    with pytest.raises(DeviceError, match="unknown device"):
        resolve_device(name)


@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_one_line(name):
    with pytest.raises(DeviceError) as e:
        resolve_device(name)
    assert name in str(e.value) and "\n" not in str(e.value)


def test_cpu_has_no_budget_and_no_peak():
    cpu = torch.device("cpu")
    assert memory_budget(cpu, 0.5) is None
    assert peak_flops(cpu) is None
    t = torch.ones(3)
    assert on(cpu, t)[0] is t  # no copy on the CPU


def test_peak_table_matches_longest_names_first(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA GB200")
    assert peak_flops(torch.device("cuda", 0)) == 2.5e15  # not B200's
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA H200")
    assert peak_flops(torch.device("cuda", 0)) == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "Some Future GPU")
    assert peak_flops(torch.device("cuda", 0)) is None


def test_budget_counts_what_is_in_use(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (60 * gib, 100 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 30 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 25 * gib)
    cuda = torch.device("cuda", 0)
    assert memory_budget(cuda, 0.9) == 55 * gib  # 90 allowed, 40 in use of which 5 cached
    assert memory_budget(cuda, 0.9, held=10 * gib) == 65 * gib  # the engine's own cache
    assert memory_budget(cuda, 0.3) == 0


def test_precision_auto_follows_the_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert resolve_precision("auto", torch.device("cuda", 0)) == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert resolve_precision("auto", torch.device("cuda", 0)) == "fp32"
    assert resolve_precision("fp32", torch.device("cuda", 0)) == "fp32"


def test_config_device_field():
    assert load_config(None, ["model.device=cuda:1"]).model.device == "cuda:1"
    with pytest.raises(ConfigError, match="model.device"):
        load_config(None, ["model.device=gpu"])
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        load_config(None, ["model.gpu_memory_utilization=0"])


@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal on a machine without CUDA")
def test_run_device_refuses_cuda_here_in_one_line():
    with pytest.raises(ConfigError, match="model.device: device 'cuda'"):
        plan_rollout(load_config(None, ["model.device=cuda"]))


def fake_cuda(monkeypatch):
    monkeypatch.setattr(device_module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device_module.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(device_module.torch.cuda, "device_count", lambda: 2)


def test_gpu_runs_are_colocated(monkeypatch):
    fake_cuda(monkeypatch)
    cfg = load_config(None, ["model.device=cuda", "pipeline.mode=async"])
    assert plan_rollout(cfg).placement == "inline"  # the CPU's 'auto' is a worker process
    with pytest.raises(ConfigError, match="placement='process' with model.device='cuda'"):
        plan_rollout(load_config(None, ["model.device=cuda", "rollout.placement=process"]))
    with pytest.raises(ConfigError, match="rollout.backend='vllm' with model.device='cuda:1'"):
        plan_rollout(load_config(None, ["model.device=cuda:1", "rollout.backend=vllm"]))
    with pytest.raises(ConfigError, match="only 2 CUDA device"):
        plan_rollout(load_config(None, ["model.device=cuda:2"]))
    cpu = load_config(None, ["model.device=cpu", "pipeline.mode=async"])
    assert plan_rollout(cpu).placement == "process"  # CPU behaviour unchanged


def rows_for(budget_rows: int, model, limit: int) -> int:
    """A budget of exactly ``budget_rows`` full-length rows of ``model``'s cache."""
    return model.new_cache(1, 1).nbytes * limit * budget_rows


def test_memory_fraction_caps_concurrent_rows_not_results(monkeypatch):
    """Under a memory budget the engine runs fewer rows at once; outputs are unchanged (the
    engine's randomness is per request, so batching changes no token)."""
    model = make_tiny(seed=2)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=5, seed=3)
    requests = [Request([1, 2, 3], params), Request([4, 5], params)]
    free = Engine(model, max_batch=8).generate(requests)
    limit = 3 + 6 + 1 + 1  # longest prompt + new tokens + the cache's spare positions
    budget = rows_for(4, model, limit)  # 3 rows + the stash slot
    monkeypatch.setattr("specrl.engine.kv.memory_budget", lambda d, f, held=0: budget)
    engine = Engine(model, max_batch=8, memory_fraction=0.5)
    capped = engine.generate(requests)
    assert engine._kv.batch_cap == 3
    assert engine.cache.slots <= 4
    assert [c.token_ids for c in capped] == [c.token_ids for c in free]


def test_memory_fraction_too_small_is_one_line(monkeypatch):
    model = make_tiny(seed=2)
    monkeypatch.setattr("specrl.engine.kv.memory_budget", lambda d, f, held=0: 10)
    engine = Engine(model, max_batch=8, memory_fraction=0.25)
    params = SamplingParams(max_new_tokens=4, seed=1)
    with pytest.raises(MemoryError, match="memory_fraction=0.25"):
        engine.generate([Request([1, 2], params)])
    with pytest.raises(ValueError, match="memory_fraction must be in"):
        Engine(model, memory_fraction=1.5)


def test_a_smaller_budget_makes_the_cache_anew(monkeypatch):
    """A cache kept from a call with more room is not grown past a later, smaller budget: the
    next call makes one with only the slots it may use."""
    model = make_tiny(seed=2)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=5, seed=3)
    limit = 3 + 6 + 1 + 1
    budget = [rows_for(9, model, limit)]  # 8 rows + the stash slot
    monkeypatch.setattr("specrl.engine.kv.memory_budget", lambda d, f, held=0: budget[0])
    engine = Engine(model, max_batch=8, memory_fraction=0.5)
    first = engine.generate([Request([1, 2, 3], params), Request([4, 5], params)])
    assert engine.cache.slots == 9
    budget[0] = rows_for(3, model, limit)  # 2 rows + the stash slot
    again = engine.generate([Request([1, 2, 3], params), Request([4, 5], params)])
    assert engine.cache.slots == 3 and engine._kv.batch_cap == 2
    assert [c.token_ids for c in again] == [c.token_ids for c in first]


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "Hi", "--device", "gpu"],
        ["train", "--device", "cuda:x"],
        ["train-drafter", "--device", "tpu", "--out", "{out}"],
        *(
            [
                ["generate", "Hi", "--device", "cuda"],
                ["train", "--device", "cuda", "--run-dir", "{out}"],
                ["train-drafter", "--device", "cuda:0", "--out", "{out}"],
            ]
            if NO_CUDA
            else []
        ),
    ],
)
def test_device_options_refuse_in_one_line_before_any_work(args, tmp_path):
    from typer.testing import CliRunner

    from specrl.cli import app

    out = tmp_path / "out"
    result = CliRunner().invoke(app, [a.replace("{out}", str(out)) for a in args])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "device" in lines[0], lines
    assert not out.exists()  # nothing written
