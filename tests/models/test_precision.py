"""'auto' precision: bf16 only where this CPU multiplies bf16 natively."""

from __future__ import annotations

import pytest

from specrl.config import load_config
from specrl.models import precision
from specrl.rl.learner import Learner
from tests.conftest import make_tiny


def test_auto_follows_the_cpu(monkeypatch):
    for native, want in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(precision, "fast_bf16", lambda native=native: native)
        assert precision.resolve_precision("auto") == want
        assert precision.torch_dtype("auto") == precision.TORCH_DTYPES[want]
    assert precision.resolve_precision("bf16") == "bf16"
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        precision.resolve_precision("fp8")


def test_fast_bf16_reads_the_cpu_flags():
    info = precision.Path("/proc/cpuinfo")
    if not info.exists():
        pytest.skip("no /proc/cpuinfo")
    flags = info.read_text()
    expected = any(f" {flag}" in flags for flag in precision.BF16_FLAGS)
    assert precision.fast_bf16() == expected


def test_learner_resolves_auto_precision(monkeypatch):
    monkeypatch.setattr(precision, "fast_bf16", lambda: False)
    cfg = load_config(None, ["learner.dtype=auto"])
    assert cfg.learner.dtype == "auto"
    assert Learner(make_tiny(), cfg.learner).dtype == "fp32"
