"""The real ``specrl train`` CLI, killed and resumed, on a tiny random model directory.

- SIGKILL at 20 seeded random moments (during start-up, mid-run, inside checkpoint saves), each
  time resumed with ``--resume``: the final metrics (all but timing keys), eval rows and final
  checkpoint equal an uninterrupted run's. A kill counts as inside a save only when verified
  without timing luck: the process is frozen (SIGSTOP, every thread stopped) while its new
  ``step_N.tmp`` is seen still unrenamed, then killed; some kills must be such.
- SIGINT / SIGTERM: the step in progress is finished and checkpointed, one line says so, the exit
  code is 130 / 143, the async producer and the engine worker process shut down, and the run
  resumes to the uninterrupted result. A second signal aborts at once.
- Resume errors that need a loadable model: all checkpoints damaged is one ``error:`` line.

The model directory holds a random 2-layer Llama and a byte-level tokenizer (259 tokens), so a
process starts in a few seconds and a step takes tens of milliseconds.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import pre_tokenizers
from typer.testing import CliRunner

from specrl.cli import app
from specrl.models.checkpoints import hf_state_dict
from specrl.models.config import tiny_config
from specrl.models.tokenizer import from_gguf_vocab
from specrl.models.transformer import Transformer
from specrl.pipelines.checkpoint import read_checkpoint
from specrl.pipelines.loop import TIMING_KEYS
from specrl.pipelines.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]
SAVE_TRIES = 4  # saves a 'save' kill may miss before it kills anyway
# > the most rows 20 launches can add (3 per 'delay'/'rows' kill, 1 + SAVE_TRIES per 'save'
# kill): the run cannot finish before the 20th kill
STEPS = 80
KILLS = 20
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_model_dir(path: Path, seed: int = 0) -> Path:
    """A Hugging Face-style directory ``specrl train --set model.name=DIR`` loads: a random
    tiny Llama (config.json, model.safetensors) and a byte-level BPE tokenizer with ChatML."""
    path.mkdir(parents=True, exist_ok=True)
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = special + sorted(pre_tokenizers.ByteLevel.alphabet())
    types = [3] * len(special) + [1] * (len(tokens) - len(special))
    tok = from_gguf_vocab(tokens, types, [], {"bos": 1, "eos": 2, "pad": 0}, CHAT_TEMPLATE)
    tok.save(path)
    cfg = tiny_config(vocab_size=len(tokens), max_position_embeddings=512, bos_token_id=1,
                      eos_token_id=2)  # fmt: skip
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    save_file(hf_state_dict(model), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    return path


def train_sets(model: Path, *extra: str) -> list[str]:
    """``--set`` arguments of a small run on ``model`` (weight decay: every step changes the
    weights even when a group's rewards are all equal). A fixed speculation cap: under the
    default 'auto' the controller picks k from measured times, and in fp32 a token's logprob
    from a k + 1 wide verify differs from a plain step's in the last bits (the tokens do not;
    tests/spec/test_controller.py), so two runs agree in tokens but not in every weight bit."""
    sets = [f"model.name={model}", "model.dtype=fp32", "learner.dtype=fp32",
            "rollout.max_tokens_per_forward=16",
            "rollout.group_size=4", "rollout.prompts_per_step=4", "rollout.max_new_tokens=12",
            "env.num_train=16", "env.num_eval=4", f"run.steps={STEPS}", "run.checkpoint_every=1",
            "run.eval_every=7", "learner.weight_decay=0.1", "learner.lr=0.01", *extra]  # fmt: skip
    return [a for s in sets for a in ("--set", s)]


def launch(args: list[str]) -> subprocess.Popen:
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "specrl.cli", "train", "--no-compare", "--no-progress", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def finish(proc: subprocess.Popen, timeout: float = 300.0) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def rows(path: Path) -> list[dict]:
    return RunDir(path.parent).rows(path) if path.exists() else []


def untimed(rs: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rs]


def final_files(run: Path, step: int = STEPS) -> dict[str, bytes | dict]:
    """The final checkpoint: its files' bytes, and state.json less the torch RNG (a process's
    own, unseeded: nothing in training draws from it)."""
    ckpt = run / f"checkpoints/step_{step:06d}"
    names = ("policy.safetensors", "optimizer.safetensors", "backend.json")
    state = json.loads((ckpt / "state.json").read_text())
    return {name: (ckpt / name).read_bytes() for name in names} | {
        "state.json": {k: v for k, v in state.items() if k != "torch_rng"}
    }


def assert_same_run(run: Path, reference: Path) -> None:
    assert untimed(rows(run / "metrics.jsonl")) == untimed(rows(reference / "metrics.jsonl"))
    assert untimed(rows(run / "eval.jsonl")) == untimed(rows(reference / "eval.jsonl"))
    assert final_files(run) == final_files(reference)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory) -> Path:
    """An uninterrupted run."""
    run = tmp_path_factory.mktemp("reference") / "run"
    rc, out, err = finish(launch(["--run-dir", str(run), *train_sets(model_dir)]))
    assert rc == 0, err[-3000:]
    assert len(rows(run / "metrics.jsonl")) == STEPS
    return run


# --------------------------------------------------------------------------- SIGKILL


def start_or_resume(run: Path, model: Path) -> subprocess.Popen:
    """What a user does after a kill: resume a run that got as far as its config, else start
    it again."""
    if (run / "config.toml").exists():
        return launch(["--resume", str(run)])
    shutil.rmtree(run, ignore_errors=True)
    return launch(["--run-dir", str(run), *train_sets(model)])


def saving(run: Path) -> set[str]:
    """Checkpoint directories being written right now."""
    try:
        return {n for n in os.listdir(run / "checkpoints") if n.endswith(".tmp")}
    except OSError:
        return set()


def thread_states(pid: int) -> set[str]:
    """The scheduler state letters of the process's threads (Linux /proc; "T" = stopped)."""
    states = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        states.add(stat.rsplit(")", 1)[1].split()[0])
    return states


def freeze(proc: subprocess.Popen) -> bool:
    """SIGSTOP ``proc`` and wait until every thread of it has stopped (then it changes no file
    until SIGCONT or SIGKILL); False if it ended instead."""
    proc.send_signal(signal.SIGSTOP)
    while proc.poll() is None:
        if thread_states(proc.pid) <= {"T", "t"}:
            return True
        time.sleep(0.0005)
    return False


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def kill_inside_a_save(proc: subprocess.Popen, run: Path, rng: random.Random) -> bool:
    """SIGKILL ``proc`` inside one of its own checkpoint saves, made certain while it is
    stopped: as soon as a new ``step_N.tmp`` appears (after letting 0 or 1 of this launch's
    saves finish) freeze the process; if the ``.tmp`` directory is still there, the save is
    unfinished (not renamed to ``step_N``): SIGKILL. Otherwise that save ended before the
    freeze: SIGCONT and wait for the next one; after ``SAVE_TRIES`` such misses, SIGKILL anyway.
    Returns whether the kill was verified to be inside a save. Leftovers of the previous kill
    (present at launch, removed on resume) are never taken for a save of this launch."""
    stale, seen, skip, misses = saving(run), set(), rng.randint(0, 1), 0
    while proc.poll() is None:
        now = saving(run)
        stale &= now
        fresh = now - stale - seen
        seen |= fresh
        if fresh and len(seen) > skip:
            if not freeze(proc):
                break
            if saving(run) & fresh:
                kill(proc)
                return True
            misses += 1
            if misses >= SAVE_TRIES:
                break
            proc.send_signal(signal.SIGCONT)
        time.sleep(0.0002)
    kill(proc)
    return False


def kill_at_random(proc: subprocess.Popen, run: Path, how: str, rng: random.Random) -> None:
    """SIGKILL ``proc`` when ``how`` says: 'delay' after a random time (mostly start-up),
    'rows' a few ms after 1-2 new metric rows (mid-step); never after 3 new rows (bounded
    progress)."""
    t0, before = time.monotonic(), len(rows(run / "metrics.jsonl"))
    delay, want_rows = rng.uniform(0.0, 5.0), rng.randint(1, 2)
    while proc.poll() is None:
        new_rows = len(rows(run / "metrics.jsonl")) - before
        due = new_rows >= 3 or (
            time.monotonic() - t0 >= delay if how == "delay" else new_rows >= want_rows
        )
        if due:
            if how == "rows":
                time.sleep(rng.uniform(0.0, 0.03))
            break
        time.sleep(0.002)
    kill(proc)


def kill_as_planned(proc: subprocess.Popen, run: Path, how: str, rng: random.Random) -> bool:
    """SIGKILL ``proc`` the way ``how`` names; whether it was verifiably inside a save."""
    if how == "save":
        return kill_inside_a_save(proc, run, rng)
    kill_at_random(proc, run, how, rng)
    return False


def test_sigkill_at_20_random_moments_then_resume_equals_uninterrupted(
    model_dir, reference, tmp_path
):
    rng = random.Random(20)
    plan = ["delay"] * 7 + ["rows"] * 6 + ["save"] * 7
    rng.shuffle(plan)
    run, landed = tmp_path / "run", []  # per kill: (rows before, rows after, inside a save)
    for how in plan:
        before = len(rows(run / "metrics.jsonl"))
        proc = start_or_resume(run, model_dir)
        mid_save = kill_as_planned(proc, run, how, rng)
        assert proc.returncode == -signal.SIGKILL, f"the run ended before kill {len(landed) + 1}"
        landed.append((before, len(rows(run / "metrics.jsonl")), mid_save))
    assert any(after <= before for before, after, _ in landed)  # killed before a step ended
    assert any(after > before for before, after, _ in landed)  # killed mid-run
    assert any(mid_save for _, _, mid_save in landed), landed  # killed inside a save
    rc, out, err = finish(start_or_resume(run, model_dir))
    assert rc == 0, err[-3000:]
    assert "damaged" not in out + err  # an interrupted save is never taken for a checkpoint
    assert_same_run(run, reference)
    assert not [p for p in (run / "checkpoints").iterdir() if not p.name[5:].isdigit()]


# --------------------------------------------------------------------------- SIGINT / SIGTERM


def stop_line(sig: str, run: Path, steps: int) -> str:
    saved = f"checkpoint saved: {run}/checkpoints/step_{steps:06d}"
    return (
        f"stopped by {sig} after {steps} steps; {saved}; continue with: specrl train --resume {run}"
    )


def signal_after_rows(proc: subprocess.Popen, run: Path, sig: int, n: int) -> None:
    while len(rows(run / "metrics.jsonl")) < n:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.005)
    proc.send_signal(sig)


def worker_pids(pid: int) -> list[int]:
    """The engine worker processes among ``pid``'s children (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return [c for c in found if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def test_sigint_checkpoints_the_step_in_progress_and_resumes_exactly(
    model_dir, reference, tmp_path
):
    # checkpoint_every=0: no checkpoint would exist until the end without the stop
    run = tmp_path / "run"
    proc = launch(["--run-dir", str(run), *train_sets(model_dir, "run.checkpoint_every=0")])
    signal_after_rows(proc, run, signal.SIGINT, 3)
    rc, out, err = finish(proc)
    done = len(rows(run / "metrics.jsonl"))
    assert rc == 130, err[-3000:]
    assert 3 <= done < STEPS
    assert err.strip().splitlines()[-1] == stop_line("SIGINT", run, done)
    assert "Traceback" not in err
    assert [p.name for p in (run / "checkpoints").iterdir()] == [f"step_{done:06d}"]
    read_checkpoint(run / f"checkpoints/step_{done:06d}")  # complete and verified
    rc, out, err = finish(launch(["--resume", str(run), "--set", "run.checkpoint_every=1"]))
    assert rc == 0, err[-3000:]
    assert_same_run(run, reference)


def test_sigterm_stops_async_run_and_its_worker_process(model_dir, tmp_path):
    run = tmp_path / "run"
    extra = ("pipeline.mode=async", "pipeline.max_staleness=1", "rollout.placement=process",
             "rollout.threads=1", "run.checkpoint_every=0")  # fmt: skip
    proc = launch(["--run-dir", str(run), *train_sets(model_dir, *extra)])
    signal_after_rows(proc, run, signal.SIGTERM, 2)
    workers = worker_pids(proc.pid)
    rc, out, err = finish(proc)
    done = len(rows(run / "metrics.jsonl"))
    assert rc == 143, err[-3000:]
    assert err.splitlines()[-1] == stop_line("SIGTERM", run, done)  # nothing after it
    assert "Traceback" not in err and "leaked" not in err
    assert workers and not any(Path(f"/proc/{w}").exists() for w in workers)
    rc, out, err = finish(launch(["--resume", str(run)]))
    assert rc == 0, err[-3000:]
    assert [r["step"] for r in rows(run / "metrics.jsonl")] == list(range(STEPS))


SECOND_SIGNAL = """
import os, signal, time
from specrl.pipelines.signals import stop_on_signals
with stop_on_signals() as stop:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    assert stop.requested, "the first signal was not recorded"
    print("first signal recorded", flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)
print("not aborted")
"""


def test_second_signal_aborts_at_once():
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SECOND_SIGNAL], env=env, capture_output=True,
                          text=True, timeout=20)  # fmt: skip
    assert proc.stdout == "first signal recorded\n", proc.stderr
    assert proc.returncode == -signal.SIGINT
    assert "aborting without saving" in proc.stderr and "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- resume errors


def test_resume_with_every_checkpoint_damaged_is_one_line(model_dir, tmp_path):
    run = tmp_path / "run"
    rc, _, err = finish(launch(["--run-dir", str(run), *train_sets(model_dir, "run.steps=2")]))
    assert rc == 0, err[-3000:]
    for ckpt in RunDir(run).checkpoints_newest_first():
        (ckpt / "policy.safetensors").write_bytes(b"garbage")
    result = CliRunner().invoke(app, ["train", "--resume", str(run), "--no-progress"])
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2, result.output
    assert lines[-1].startswith(f"error: cannot resume {run}: no checkpoint verifies: ")
    assert "step_000002 (policy.safetensors: 7 bytes" in lines[-1]
    assert "step_000001 (policy.safetensors: 7 bytes" in lines[-1]
