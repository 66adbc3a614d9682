"""Experiment tracking: a run's step and eval rows also go to TensorBoard (``run.tensorboard``)
and, with the wandb extra, to an offline W&B run (``run.wandb``); metrics.jsonl stays the
record, and both copies hold exactly its numbers."""

from __future__ import annotations

import json
import shutil
import struct
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from specrl.config import ConfigError
from specrl.pipelines.rundir import RunDir
from specrl.pipelines.tracking import SINKS, WANDB_EXTRA, numbers
from specrl.pipelines.train import train
from tests.pipelines.pipeline_fakes import tiny_config, tiny_parts

pytestmark = pytest.mark.usefixtures("one_thread")

SHORT = ("run.steps=2", "run.eval_every=1", "run.checkpoint_every=1")


def logged(run: Path) -> dict[str, list[tuple[int, float]]]:
    """The record's numbers as ``{"<kind>/<key>": [(step, value), ...]}``."""
    out: dict[str, list[tuple[int, float]]] = {}
    rd = RunDir(run)
    for kind, log in (("train", rd.metrics), ("eval", rd.evals)):
        for row in rd.rows(log):
            for key, value in numbers(row).items():
                out.setdefault(f"{kind}/{key}", []).append((row["step"], value))
    return out


def tensorboard_scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard's own reader finds in ``run/tensorboard``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def as_float32(scalars: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard keeps a scalar as float32."""
    return {k: [(s, float(np.float32(v))) for s, v in pts] for k, pts in scalars.items()}


def test_the_sinks_are_registered_and_only_the_record_is_on_by_default():
    cfg = tiny_config()
    assert [s.name for s in SINKS] == ["jsonl", "tensorboard", "wandb"]
    assert [s.name for s in SINKS if s.on(cfg)] == ["jsonl"]
    assert not cfg.run.tensorboard and not cfg.run.wandb


def test_a_run_with_tensorboard_writes_the_records_numbers_tensorboard_reads_back(tmp_path):
    run = tmp_path / "run"
    rows = train(tiny_parts(tiny_config(*SHORT, "run.tensorboard=true")), str(run), progress=False)
    assert [r["step"] for r in rows] == [0, 1]
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    record = logged(run)
    assert {"train/reward_mean", "train/policy_version", "eval/greedy_accuracy"} <= set(record)
    assert tensorboard_scalars(run) == as_float32(record)
    assert [s for s, _ in record["eval/greedy_accuracy"]] == [0, 1, 2]


def test_a_resumed_run_replaces_the_steps_it_runs_again_in_tensorboard(tmp_path):
    run, cfg = tmp_path / "run", tiny_config(*SHORT, "run.tensorboard=true")
    train(tiny_parts(cfg), str(run), progress=False)
    shutil.rmtree(RunDir(run).checkpoint_dir(2))  # killed after logging step 1, before its save
    again = train(tiny_parts(cfg), str(run), resume=True, progress=False)
    assert [r["step"] for r in again] == [1]
    assert tensorboard_scalars(run) == as_float32(logged(run))  # one point per step, the new ones


def test_tensorboard_is_off_unless_asked(tmp_path):
    train(tiny_parts(tiny_config(*SHORT)), str(tmp_path / "run"), progress=False)
    assert not (tmp_path / "run" / "tensorboard").exists()


# --------------------------------------------------------------------------- W&B, offline


def wandb_records(run: Path) -> list:
    """The records of the offline run's transaction log (``run-<id>.wandb``: a LevelDB-style
    log of ``wandb_internal_pb2.Record`` protobufs in 32 KiB blocks after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run.glob("wandb/offline-run-*/run-*.wandb")
    data, block = path.read_bytes(), 32 * 1024
    assert data[:4] == b":W&B"
    pos, pending, out = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the rest of a block is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def finished_records(run: Path, seconds: float = 30.0) -> list:
    """``wandb_records`` once the log holds W&B's ``exit`` record: its service writes the log
    in another process, and ``finish()`` may return before the last records reach the file."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            records = wandb_records(run)
        except Exception:  # a record cut where the writer stands
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, "the W&B log never got its exit record"
        time.sleep(0.1)


@pytest.fixture
def offline(monkeypatch):
    """No network, no prompt: W&B in offline mode, quiet."""
    pytest.importorskip("wandb")
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                       "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true",
                       "WANDB_CONSOLE": "off"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


@pytest.mark.timeout(300)
def test_a_run_with_wandb_writes_an_offline_run_holding_the_records_numbers(tmp_path, offline):
    run = tmp_path / "run"
    train(tiny_parts(tiny_config(*SHORT, "run.wandb=true")), str(run), progress=False)
    history: dict[str, list[tuple[int, float]]] = {}
    for record in finished_records(run):
        if record.WhichOneof("record_type") != "history":
            continue
        items = record.history.item
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}
        kind = "train" if "train/step" in row else "eval"
        for key, value in row.items():
            if key.startswith(f"{kind}/") and key != f"{kind}/step":
                history.setdefault(key, []).append((row[f"{kind}/step"], value))
    assert history == logged(run)  # exact: W&B keeps the JSON numbers


def test_wandb_without_its_package_is_refused_in_one_line_before_any_work(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # ``import wandb`` raises ImportError
    with pytest.raises(ConfigError) as e:
        tiny_parts(tiny_config("run.wandb=true"))
    assert str(e.value) == WANDB_EXTRA and "\n" not in str(e.value)
