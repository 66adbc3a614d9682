"""Reasoning-gym environment: splits, ordering, answer extraction, rewards and errors."""

import pytest

from specrl.envs import TEMPLATES, Env, ReasoningGymEnv
from specrl.envs.reasoning_gym_env import (
    extract_last_line,
    extract_line,
    extract_tag,
    is_eval_question,
)

ARITH = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


@pytest.fixture(scope="module")
def env() -> ReasoningGymEnv:
    return ReasoningGymEnv("basic_arithmetic", ARITH, num_train=200, num_eval=40, seed=3)


def test_env_protocol_and_split_sizes(env):
    assert isinstance(env, Env)
    assert len(env.prompts("train")) == 200 and len(env.prompts("eval")) == 40


def test_train_and_eval_are_disjoint_by_question(env):
    train = {p.meta["entry"]["question"] for p in env.prompts("train")}
    evals = [p.meta["entry"]["question"] for p in env.prompts("eval")]
    assert not train & set(evals)
    assert len(set(evals)) == len(evals)
    assert not {p.id for p in env.prompts("train")} & {p.id for p in env.prompts("eval")}


def test_order_is_deterministic_per_seed(env):
    ids = lambda ps: [p.id for p in ps]  # noqa: E731
    assert ids(env.prompts("train", seed=1)) == ids(env.prompts("train", seed=1))
    assert ids(env.prompts("train", seed=1)) != ids(env.prompts("train", seed=2))
    assert sorted(ids(env.prompts("train", seed=1))) == sorted(ids(env.prompts("train")))
    again = ReasoningGymEnv("basic_arithmetic", ARITH, num_train=200, num_eval=40, seed=3)
    assert [p.text for p in again.prompts("train", 5)] == [p.text for p in env.prompts("train", 5)]
    other = ReasoningGymEnv("basic_arithmetic", ARITH, num_train=200, num_eval=40, seed=4)
    assert [p.text for p in other.prompts("train")] != [p.text for p in env.prompts("train")]


def test_small_task_space_still_gives_disjoint_eval():
    small = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
             "operators": ["+", "-"], "allow_parentheses": False,
             "allow_negation": False}  # fmt: skip
    env = ReasoningGymEnv("basic_arithmetic", small, num_train=2000, num_eval=48)
    train = {p.meta["entry"]["question"] for p in env.prompts("train")}
    evals = {p.meta["entry"]["question"] for p in env.prompts("eval")}
    assert len(evals) == 48 and not train & evals
    assert len(train) > 100  # most of the ~240 questions are trainable
    assert all(is_eval_question(q) for q in evals) and not any(map(is_eval_question, train))


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_reward_of_correct_and_wrong_answers(env, template):
    env = ReasoningGymEnv("basic_arithmetic", ARITH, num_train=20, num_eval=0, template=template)
    p = env.prompts("train")[0]
    answer = p.meta["answer"]
    good = {"answer_tag": f"Let me think.\n<answer>{answer}</answer>",
            "answer_line": f"Some work.\nAnswer: {answer}",
            "answer_only": f"{answer}",
            "step_by_step": f"First, 2 + 2 = 4.\nSo the answer is {answer}."}[template]  # fmt: skip
    assert env.reward(good, p.meta) == 1.0 and env.correct(good, p.meta)
    wrong = good.replace(answer, str(int(answer) + 1))
    assert env.reward(wrong, p.meta) < 1.0 and not env.correct(wrong, p.meta)
    assert env.reward("", p.meta) == 0.0


def test_format_bonus_only_when_an_answer_is_extracted():
    env = ReasoningGymEnv("basic_arithmetic", ARITH, 10, 0, template="answer_tag", format_bonus=0.1)
    p = env.prompts("train")[0]
    assert env.reward("<answer>banana</answer>", p.meta) == pytest.approx(0.1)
    assert env.reward("no tags here", p.meta) == 0.0
    assert env.reward(f"<answer>{p.meta['answer']}</answer>", p.meta) == pytest.approx(1.1)


def test_extractors():
    assert extract_tag("<answer>1</answer> then <answer> 42 </answer>") == "42"
    assert extract_tag("<answer>7") == "7" and extract_tag("nothing") is None
    assert extract_line("work\nAnswer: **12**.") == "12"
    assert extract_line("so the answer is 5.") == "5" and extract_line("no") is None
    assert extract_last_line("Sure!\n\n 36 \n") == "36"
    assert extract_last_line("The answer is 9.") == "9" and extract_last_line("  ") is None
    assert extract_last_line("5 - 3 = 2") == "2" and extract_last_line("x =") is None
    assert extract_last_line('The answer is "nus."') == "nus"
    assert extract_last_line("The answer is 2.\n\nThere are 2 legs in total.") == "2"
    assert extract_last_line("The answer is 1, which is the total") == "1"


def test_prompt_carries_template_and_question(env):
    p = env.prompts("eval")[0]
    assert p.meta["entry"]["question"] in p.text
    assert p.messages[-1]["role"] == "user" and p.meta["split"] == "eval"


def test_default_config_builds_the_default_env():
    from specrl.config import Config
    from specrl.config_task import RG_NUM_TRAIN

    cfg = Config().env
    env = ReasoningGymEnv.from_config(cfg)
    assert cfg.num_train is None  # unset: reasoning-gym draws RG_NUM_TRAIN
    assert len(env.prompts("train")) == RG_NUM_TRAIN and len(env.prompts("eval")) == cfg.num_eval
    p = env.prompts("eval")[0]
    assert "Reply with only the final answer" in p.text
    assert env.config["operators"] == ("+", "-") and env.config["max_digits"] == 1
    harder = ReasoningGymEnv.from_config(cfg.model_copy(update={"task_config": {"max_digits": 2}}))
    assert harder.config["max_digits"] == 2 and harder.config["operators"] == ("+", "-")
    assert env.correct(f"The answer is {p.meta['answer']}.", p.meta)


def test_other_tasks_and_configs_are_selectable():
    env = ReasoningGymEnv("leg_counting", {"min_animals": 1, "max_animals": 2}, 5, 5,
                          template="answer_only")  # fmt: skip
    p = env.prompts("train")[0]
    assert env.reward(p.meta["answer"], p.meta) == 1.0


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="did you mean leg_counting"):
        ReasoningGymEnv("leg_countng")
    with pytest.raises(ValueError, match="answer_tag"):
        ReasoningGymEnv("basic_arithmetic", template="tag")
    with pytest.raises(ValueError, match="bad config for task"):
        ReasoningGymEnv("basic_arithmetic", {"no_such_option": 1}, 5, 0)
    with pytest.raises(ValueError, match="split"):
        ReasoningGymEnv("basic_arithmetic", ARITH, 5, 0).prompts("test")
    with pytest.raises(ValueError, match="too few distinct questions"):
        one = {"min_animals": 1, "max_animals": 1, "min_instances": 1, "max_instances": 1}
        ReasoningGymEnv("leg_counting", one, 500, 100)
