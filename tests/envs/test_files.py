"""Prompts from the user's files: formats, splits, meta, the DAPO layout and one-line errors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pandas as pd
import pytest
from datasets import Dataset, DatasetDict

from specrl.config import EnvCfg
from specrl.envs import FileEnv, FileEnvError, Prompt
from specrl.envs.files import load_rows

DAPO = Path(__file__).parent.parent / "fixtures" / "dapo_math_tiny.jsonl"

ROWS = [
    {"prompt": "What is 2 + 3?", "answer": 5, "level": 1, "tags": ["add"], "src": {"k": "a"}},
    {"prompt": "What is 7 - 4?", "answer": 3, "level": 2, "tags": [], "src": {"k": "b"}},
    {"prompt": "What is 6 * 7?", "answer": 42, "level": 3, "tags": ["mul", "x"], "src": {"k": "c"}},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def numbered(n: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"question {i}", "answer": str(i)} for i in range(start, start + n)]


def texts(prompts: list[Prompt]) -> list[str]:
    return [p.text for p in prompts]


# --------------------------------------------------------------------------- formats


def test_jsonl_rows_become_prompts_with_every_other_column_in_meta(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    env = FileEnv(path, num_eval=0)
    train = env.prompts("train")
    assert [p.id for p in train] == ["train/0", "train/1", "train/2"]
    assert train[2].messages == ({"role": "user", "content": "What is 6 * 7?"},)
    assert train[2].meta == {"answer": 42, "level": 3, "tags": ["mul", "x"], "src": {"k": "c"},
                             "row": 2, "file": str(path)}  # fmt: skip
    assert env.prompts("eval") == []
    assert FileEnv.default_rewards == ("math",)


def _write_parquet(path: Path, rows: list[dict]) -> None:
    Dataset.from_list(rows).to_parquet(str(path))


def _write_csv(path: Path, rows: list[dict]) -> None:
    pd.DataFrame([{k: r[k] for k in ("prompt", "answer", "level")} for r in rows]).to_csv(
        path, index=False
    )


def _write_json(path: Path, rows: list[dict]) -> None:
    path.write_text(json.dumps(rows))


@pytest.mark.parametrize(
    ("name", "write"),
    [("t.parquet", _write_parquet), ("t.csv", _write_csv), ("t.json", _write_json)],
)
def test_parquet_csv_and_json_array_read_like_jsonl(tmp_path, name, write):
    write(tmp_path / name, ROWS)
    train = FileEnv(tmp_path / name, num_eval=0).prompts("train")
    assert texts(train) == [r["prompt"] for r in ROWS]
    assert [(p.meta["answer"], p.meta["level"], p.meta["row"]) for p in train] == [
        (5, 1, 0), (3, 2, 1), (42, 3, 2)
    ]  # fmt: skip


def test_save_to_disk_directories(tmp_path):
    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "plain"))
    DatasetDict({"train": Dataset.from_list(ROWS[:2]), "test": Dataset.from_list(ROWS[2:])}
                ).save_to_disk(str(tmp_path / "dict"))  # fmt: skip
    assert texts(FileEnv(tmp_path / "plain", num_eval=0).prompts("train")) == texts(
        FileEnv(write_jsonl(tmp_path / "t.jsonl", ROWS), num_eval=0).prompts("train")
    )
    assert [r["answer"] for r in load_rows(tmp_path / "dict")] == [5, 3]


def test_reading_is_offline_writes_only_temp_files_and_restores_datasets_settings(
    tmp_path, monkeypatch
):
    import logging

    import datasets

    home = tmp_path / "home"  # where datasets would cache by default
    for name in ("HF_DATASETS_CACHE", "HF_MODULES_CACHE", "DOWNLOADED_DATASETS_PATH",
                 "EXTRACTED_DATASETS_PATH"):  # fmt: skip
        monkeypatch.setattr(datasets.config, name, home / name)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # as with a network
    requests: list[tuple] = []  # datasets asks the Hub through this session unless offline
    monkeypatch.setattr(datasets.load, "get_session", lambda *a: requests.append(a))
    cfg = datasets.config
    state = lambda: (datasets.are_progress_bars_disabled(), logging.getLogger("datasets").level,
                     cfg.HF_HUB_OFFLINE, cfg.HF_UPDATE_DOWNLOAD_COUNTS)  # fmt: skip
    before = state()
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    _write_parquet(tmp_path / "t.parquet", ROWS)
    assert len(load_rows(path)) == len(load_rows(tmp_path / "t.parquet")) == len(ROWS)
    assert not home.exists() and requests == []
    assert state() == before


# --------------------------------------------------------------------------- prompts


def test_chat_message_prompts_and_system_prompt(tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": "hi"}], "answer": "1"},
        {"prompt": [{"role": "system", "content": "Own."}, {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
         "answer": "2"},
    ]  # fmt: skip
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    plain, sys_ = (
        FileEnv(path, num_eval=0, system_prompt=s).prompts("train") for s in (None, "Be.")
    )
    assert plain[0].messages == ({"role": "user", "content": "hi"},)
    assert plain[1].messages == tuple(rows[1]["prompt"])
    assert sys_[0].messages == ({"role": "system", "content": "Be."}, *plain[0].messages)
    assert sys_[1].messages == plain[1].messages  # it has its own system turn
    assert sys_[1].system == "Own." and sys_[1].text == "c"
    text = FileEnv(write_jsonl(tmp_path / "t.jsonl", ROWS), num_eval=0, system_prompt="Be.")
    assert text.prompts("train")[0].messages[0] == {"role": "system", "content": "Be."}


def test_parquet_messages_keep_role_and_content_and_a_renamed_answer_column(tmp_path):
    rows = [  # Parquet gives every message every key seen in the column (None where absent)
        {"prompt": [{"role": "user", "content": "a"}], "solution": "1", "id": 7},
        {"prompt": [{"role": "user", "content": "b", "name": "n"}], "solution": "2", "id": 8},
    ]
    _write_parquet(tmp_path / "m.parquet", rows)
    train = FileEnv(tmp_path / "m.parquet", answer_column="solution", num_eval=0).prompts("train")
    assert [p.messages for p in train] == [({"role": "user", "content": "a"},),
                                           ({"role": "user", "content": "b"},)]  # fmt: skip
    assert train[1].meta == {"answer": "2", "id": 8, "row": 1, "file": str(tmp_path / "m.parquet")}


def test_seeded_order_is_a_deterministic_permutation_and_splits_are_named(tmp_path):
    env = FileEnv(write_jsonl(tmp_path / "t.jsonl", numbered(20)), num_eval=4)
    ids = lambda ps: [p.id for p in ps]
    assert ids(env.prompts("train", seed=1)) == ids(env.prompts("train", seed=1))
    assert ids(env.prompts("train", seed=1)) != ids(env.prompts("train", seed=2))
    assert sorted(ids(env.prompts("train", seed=1))) == sorted(ids(env.prompts("train")))
    with pytest.raises(ValueError, match="unknown split 'test'"):
        env.prompts("test")


# --------------------------------------------------------------------------- splits


def test_eval_from_a_second_file_capped_at_num_eval(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", numbered(6))
    held = write_jsonl(tmp_path / "eval.jsonl", numbered(5, start=100))
    env = FileEnv(train, eval_file=held, num_eval=3)
    assert texts(env.prompts("train")) == [f"question {i}" for i in range(6)]
    evals = env.prompts("eval")
    assert [p.id for p in evals] == ["eval/0", "eval/1", "eval/2"]
    assert texts(evals) == ["question 100", "question 101", "question 102"]
    assert {p.meta["file"] for p in evals} == {str(held)}


def _sha(prompt) -> str:
    return hashlib.sha1(json.dumps(prompt, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def test_hash_holdout_is_stable_under_reordering_and_disjoint_from_train(tmp_path):
    rows = numbered(40)
    rows.append(dict(rows[7], answer="dup"))  # a second copy of one prompt
    a = FileEnv(write_jsonl(tmp_path / "a.jsonl", rows), num_eval=10)
    b = FileEnv(write_jsonl(tmp_path / "b.jsonl", rows[::-1]), num_eval=10)
    evals = texts(a.prompts("eval"))
    smallest = sorted({r["prompt"] for r in rows}, key=_sha)[:10]
    assert sorted(evals) == sorted(smallest) == sorted(texts(b.prompts("eval")))
    assert not set(evals) & set(texts(a.prompts("train")))
    assert len(a.prompts("train")) + len(evals) + ("question 7" in evals) == len(rows)
    assert texts(a.prompts("train")) == [r["prompt"] for r in rows if r["prompt"] not in evals]
    assert [p.id for p in a.prompts("eval")] == [f"eval/{p.meta['row']}" for p in a.prompts("eval")]


def test_num_train_caps_train_rows_in_file_order_only_when_set(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", numbered(2010))  # more than num_train's default
    held = write_jsonl(tmp_path / "e.jsonl", numbered(2, start=5000))
    assert texts(FileEnv(path, held, num_train=4).prompts("train")) == [
        f"question {i}" for i in range(4)
    ]
    default = FileEnv.from_config(EnvCfg(kind="file", train_file=str(path), num_eval=5))
    assert len(default.prompts("train")) == 2005 and len(default.prompts("eval")) == 5
    capped = FileEnv.from_config(
        EnvCfg(kind="file", train_file=str(path), eval_file=str(held), num_train=3,
               system_prompt="S.", prompt_column="prompt", answer_column="answer")
    )  # fmt: skip
    assert texts(capped.prompts("train")) == ["question 0", "question 1", "question 2"]
    assert capped.prompts("eval")[0].system == "S."
    # config.toml round trip (a resume): an unset num_train stays unset, so all rows again
    from specrl.config import Config, load_run_config

    cfg = Config(env=EnvCfg(kind="file", train_file=str(path), num_eval=5))
    (tmp_path / "config.toml").write_text(cfg.to_toml())
    again = load_run_config(tmp_path / "config.toml").env
    assert len(FileEnv.from_config(again).prompts("train")) == 2005


def test_drop_long_counts_and_removes_from_both_splits(tmp_path):
    rows = [{"prompt": "x" * n, "answer": "1"} for n in (5, 50, 8, 70, 9)]
    held = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "y" * n, "answer": "1"} for n in (3, 90)])
    env = FileEnv(write_jsonl(tmp_path / "t.jsonl", rows), held)
    length = lambda p: len(p.text)
    assert env.drop_long(length, 10) == 3
    assert [len(t) for t in texts(env.prompts("train"))] == [5, 8, 9]
    assert [len(t) for t in texts(env.prompts("eval"))] == [3]
    assert env.drop_long(length, 10) == 0
    with pytest.raises(FileEnvError, match=r"longer than 4 tokens \(the shortest has 5\)") as e:
        env.drop_long(length, 4)
    assert str(tmp_path / "t.jsonl") in str(e.value) and "\n" not in str(e.value)
    assert len(env.prompts("train")) == 3  # nothing removed by the refusal


# --------------------------------------------------------------------------- DAPO-Math-17K


def test_dapo_layout_with_a_dotted_answer_path():
    raw = [json.loads(line) for line in DAPO.read_text().splitlines()]
    assert len(raw) == 8
    env = FileEnv(DAPO, answer_column="reward_model.ground_truth", num_eval=2)
    prompts = env.prompts("train") + env.prompts("eval")
    assert len(env.prompts("train")) == 6 and len(prompts) == 8
    for p in prompts:
        row = raw[p.meta["row"]]
        assert p.messages == tuple(row["prompt"])
        assert p.text.startswith("Solve the following math problem step by step.")
        assert p.meta["answer"] == row["reward_model"]["ground_truth"]
        assert p.meta["answer"].isdigit()
        assert {k: p.meta[k] for k in ("data_source", "ability", "reward_model", "extra_info")} == {
            k: row[k] for k in ("data_source", "ability", "reward_model", "extra_info")
        }
        assert "prompt" not in p.meta


# --------------------------------------------------------------------------- errors


def _jsonl(rows):
    return lambda path: write_jsonl(path, rows)


def _text(content: str):
    return lambda path: path.write_text(content)


BAD = [
    ("missing.jsonl", None, {}, ["no such file"]),
    ("t.txt", _text("hello\n"), {}, ["unsupported file kind '.txt'", ".jsonl", ".parquet", ".csv"]),
    ("t.jsonl", _text('{"prompt": "a"}\n{"prompt": \n'), {}, ["cannot read it as json"]),
    ("t.parquet", _text("PAR1 not really"), {}, ["cannot read it as parquet"]),
    ("t.jsonl", _text(""), {}, ["the file is empty"]),
    ("t.jsonl", _text("\n  \n"), {}, ["the file is empty"]),
    ("t.csv", _text("prompt,answer\n"), {}, ["the file has no rows"]),
    ("t.jsonl", _jsonl([{"question": "a", "answer": 1}]), {},
     ["no prompt column 'prompt'", "columns: question, answer"]),
    ("t.jsonl", _jsonl([{"prompt": "a", "solution": 1}]), {},
     ["no answer column 'answer'", "columns: prompt, solution"]),
    ("t.jsonl", _jsonl([{"prompt": "a", "answer": 1}] * 17 + [{"prompt": 3, "answer": 1}]), {},
     ["row 17 column 'prompt': expected text or a list of chat messages, got int"]),
    ("t.jsonl", _jsonl([{"prompt": "a", "answer": 1}, {"prompt": "  ", "answer": 1}]), {},
     ["row 1 column 'prompt'", "got an empty string"]),
    ("t.jsonl", _jsonl([{"prompt": None, "answer": 1}]), {}, ["row 0 column 'prompt'", "got null"]),
    ("t.jsonl", _jsonl([{"prompt": [], "answer": 1}]), {}, ["row 0", "got an empty list"]),
    ("t.jsonl", _jsonl([{"prompt": [{"role": "tool", "content": "x"}], "answer": 1}]), {},
     ["row 0 column 'prompt'", "message 0 has role 'tool'"]),
    ("t.jsonl", _jsonl([{"prompt": [{"role": "user", "content": "q"},
                                    {"role": "assistant", "content": "a"}], "answer": 1}]), {},
     ["row 0 column 'prompt'", "the last message has role 'assistant', not 'user'"]),
    ("t.jsonl", _jsonl([{"prompt": ["hi"], "answer": 1}]), {},
     ["row 0 column 'prompt'", "message 0 is str"]),
    ("t.jsonl", _jsonl([{"prompt": [{"role": "user", "content": 5}], "answer": 1}]), {},
     ["row 0 column 'prompt'", "message 0 has content int"]),
    ("t.jsonl", _jsonl([{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": None}]), {},
     ["row 1 column 'answer': the answer is null"]),
    ("t.csv", _text("prompt,answer\na,1\nb,\n"), {}, ["row 1 column 'answer'", "null"]),
    ("t.jsonl", _jsonl([{"prompt": "a", "rm": {"gt": "1"}}, {"prompt": "b", "rm": {"s": "x"}}]),
     {"answer_column": "rm.gt"}, ["row 1 column 'rm.gt'", "'rm' has no key 'gt'"]),
    ("t.jsonl", _jsonl([{"prompt": "a", "src": "web"}]), {"answer_column": "src.gt"},
     ["row 0 column 'src.gt'", "'src' is str, not a dict"]),
    ("t.jsonl", _jsonl([{"prompt": "a", "answer": 1, "solution": 2}]),
     {"answer_column": "solution"}, ["column 'answer' clashes"]),
    ("t.jsonl", _jsonl([{"prompt": "a", "answer": 1, "row": 2}]), {}, ["column 'row' clashes"]),
    ("t.jsonl", _jsonl(numbered(5)), {"num_eval": 5},
     ["num_eval=5", "has 5 distinct prompts", "env.eval_file"]),
]  # fmt: skip


@pytest.mark.parametrize(("name", "write", "kwargs", "says"), BAD)
def test_every_problem_is_one_line_naming_the_file(tmp_path, name, write, kwargs, says):
    path = tmp_path / name
    if write is not None:
        write(path)
    with pytest.raises(FileEnvError) as e:
        FileEnv(path, **{"num_eval": 0, **kwargs})
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    for part in says:
        assert part in message


def test_directory_errors_are_one_line(tmp_path):
    DatasetDict({"test": Dataset.from_list(ROWS), "dev": Dataset.from_list(ROWS)}).save_to_disk(
        str(tmp_path / "dict")
    )
    (tmp_path / "junk").mkdir()
    for path, says in [(tmp_path / "dict", "no 'train' split; splits: test, dev"),
                       (tmp_path / "junk", "cannot read it as a saved dataset")]:  # fmt: skip
        with pytest.raises(FileEnvError, match=says) as e:
            FileEnv(path, num_eval=0)
        assert "\n" not in str(e.value) and str(e.value).startswith(f"{path}: ")


def test_an_answer_column_of_none_passes_answer_through(tmp_path):
    env = FileEnv(write_jsonl(tmp_path / "t.jsonl", ROWS), answer_column=None, num_eval=0)
    assert env.prompts("train")[0].meta["answer"] == 5
    rows = [{"prompt": "a", "answer": None}]
    assert FileEnv(write_jsonl(tmp_path / "n.jsonl", rows), answer_column=None, num_eval=0)
