"""The built-in `arithmetic` task and the example rule reward rewards/arithmetic.py."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from megatron_rlhf.data.jsonl import read_prompts
from megatron_rlhf.data.tasks import TASKS, TaskSizes, get_task
from megatron_rlhf.data.tasks.arithmetic import (
    ANSWER_RANGE,
    MAX_WRONG_DISTANCE,
    OPERAND_RANGE,
    PROMPT_TEMPLATES,
    SFT_CORRECT_RATE,
    ArithmeticTask,
)
from megatron_rlhf.data.tokenizers import load_tokenizer

REPO = Path(__file__).resolve().parent.parent
REWARD_FILE = REPO / "rewards" / "arithmetic.py"
SMALL = TaskSizes(
    sft_train=60, sft_eval=10, preference_train=60, preference_eval=10, ppo_prompts=30,
    eval_prompts=10,
)
LARGE = TaskSizes(
    sft_train=4000, sft_eval=400, preference_train=1000, preference_eval=100, ppo_prompts=1000,
    eval_prompts=200,
)
# Responses that must score 0 for "what is 3 plus 4" besides plain wrong numbers.
NOT_THE_ANSWER = ["", "   ", "8", "6", "07", "7 7", "7 apples", "seven", "the answer is 7", "<unk>"]


@pytest.fixture(scope="module")
def task() -> ArithmeticTask:
    return get_task("arithmetic")


@pytest.fixture(scope="module")
def large(task):
    return task.splits(11, LARGE)


@pytest.fixture(scope="module")
def reward():
    spec = importlib.util.spec_from_file_location("user_reward_arithmetic", REWARD_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.score


def operands(prompt: str) -> list[int]:
    # Parsed here independently of the task's own parser, so a bug there shows up.
    return [int(word) for word in prompt.split() if word.isdigit()]


def call_reward(reward, prompts, responses, extras):
    """Call the reward as the RL stage does: every documented keyword."""
    return reward(
        prompts=prompts, responses=responses, prompt_ids=[[1, 2] for _ in prompts],
        response_ids=[[3] for _ in prompts], finished=[True for _ in prompts], extras=extras,
    )


# ---------------------------------------------------------------- registration and data


def test_get_task_finds_arithmetic():
    assert TASKS["arithmetic"] is ArithmeticTask
    task = get_task("arithmetic")
    assert isinstance(task, ArithmeticTask) and task.name == "arithmetic"


def test_splits_are_a_pure_function_of_the_seed(task):
    first, again, other = task.splits(1, SMALL), task.splits(1, SMALL), task.splits(2, SMALL)
    assert first == again
    assert first.sft_train != other.sft_train and first.ppo_prompts != other.ppo_prompts
    # Each split has its own stream: eval prompts are not a copy of the PPO prompts.
    assert first.eval_prompts != first.ppo_prompts[: len(first.eval_prompts)]
    sizes = [len(getattr(first, name)) for name in vars(SMALL)]
    assert sizes == list(vars(SMALL).values())


def test_every_prompt_carries_the_sum_of_its_operands_as_answer(task, large):
    for example in large.ppo_prompts + large.eval_prompts:
        numbers = operands(example.prompt)
        assert len(numbers) == 2, example
        assert example.extra == {"answer": str(sum(numbers))}, example


def test_prompts_cover_every_template_and_operand(task, large):
    prompts = [p.prompt for p in large.ppo_prompts]
    shapes = {" ".join("N" if w.isdigit() else w for w in p.split()) for p in prompts}
    assert shapes == {t.replace("A", "N").replace("B", "N") for t in PROMPT_TEMPLATES}
    seen = {n for p in prompts for n in operands(p)}
    assert seen == set(OPERAND_RANGE)


def test_sft_responses_are_one_number_correct_at_the_configured_rate(task, large):
    examples = large.sft_train
    correct = sum(task.gold_score(e.prompt, e.response) for e in examples)
    n = len(examples)
    # Five standard deviations of a binomial share: a real drift fails, noise does not.
    tolerance = 5 * math.sqrt(SFT_CORRECT_RATE * (1 - SFT_CORRECT_RATE) / n)
    assert abs(correct / n - SFT_CORRECT_RATE) < tolerance, (correct / n, tolerance)
    for example in examples:
        assert example.response.split() == [example.response], example
        answer = sum(operands(example.prompt))
        assert int(example.response) in ANSWER_RANGE
        assert abs(int(example.response) - answer) <= MAX_WRONG_DISTANCE, example


def test_chosen_is_always_correct_and_rejected_never(task, large):
    for pair in large.preference_train + large.preference_eval:
        answer = sum(operands(pair.prompt))
        assert pair.chosen == str(answer), pair
        assert task.gold_score(pair.prompt, pair.chosen) == 1.0, pair
        assert task.gold_score(pair.prompt, pair.rejected) == 0.0, pair
        assert int(pair.rejected) in ANSWER_RANGE
        assert 0 < abs(int(pair.rejected) - answer) <= MAX_WRONG_DISTANCE, pair


def test_builtin_tokenizer_covers_every_split_and_fits_128(task, large):
    tok = load_tokenizer("builtin", task.words())
    assert tok.vocab_size < 128
    assert len(task.words()) == len(set(task.words()))
    texts = [e.prompt + " " + e.response for e in large.sft_train + large.sft_eval]
    texts += [p.prompt + " " + p.chosen + " " + p.rejected
              for p in large.preference_train + large.preference_eval]
    texts += [p.prompt + " " + p.extra["answer"] for p in large.ppo_prompts + large.eval_prompts]
    for text in texts:
        ids = tok.encode(text)
        assert tok.unk_id not in ids, text
        assert tok.decode(ids) == text


def test_written_task_data_keeps_the_answers(task, tmp_path):
    splits = task.splits(6, SMALL)
    paths = splits.write(tmp_path / "data")
    for name in ("ppo_prompts", "eval_prompts"):
        read_back = read_prompts(paths[name])
        assert read_back == getattr(splits, name)
        assert all(set(p.extra) == {"answer"} for p in read_back)


# ---------------------------------------------------------------- gold score


def test_gold_score_is_exact_match_with_the_sum_in_the_prompt(task):
    for prompt in ("what is 3 plus 4", "3 plus 4 equals", "add 3 and 4", "the sum of 3 and 4 is"):
        for response in ("7", " 7 ", "7.", "7!", "7 ?", "\t7,\n"):
            assert task.gold_score(prompt, response) == 1.0, (prompt, response)
        for response in NOT_THE_ANSWER:
            assert task.gold_score(prompt, response) == 0.0, (prompt, response)
    assert task.gold_score("add 9 and 9", "18") == 1.0
    assert task.gold_score("add 0 and 0", "0") == 1.0
    assert task.gold_score("add 9 and 0", "18") == 0.0


def test_gold_score_refuses_prompts_that_are_not_the_tasks(task):
    for prompt in ("the movie was", "add 3 and", "add 3 and 4 and 5"):
        with pytest.raises(ValueError, match="arithmetic: prompt .* not 2"):
            task.gold_score(prompt, "7")


# ---------------------------------------------------------------- example reward file


def test_reward_file_imports_only_the_standard_library():
    import ast
    import sys

    tree = ast.parse(REWARD_FILE.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or ""]
        else:
            continue
        for module in modules:
            assert module.split(".")[0] in sys.stdlib_module_names, module


def test_reward_file_matches_the_gold_score(task, large, reward):
    prompts = large.eval_prompts
    for responses in (
        [p.extra["answer"] for p in prompts],
        [p.extra["answer"] + "." for p in prompts],
        [str(int(p.extra["answer"]) + 1) for p in prompts],
        [p.extra["answer"] + " " + p.extra["answer"] for p in prompts],
        ["" for _ in prompts],
    ):
        scores = call_reward(
            reward, [p.prompt for p in prompts], responses, [p.extra for p in prompts],
        )
        gold = [task.gold_score(p.prompt, r) for p, r in zip(prompts, responses)]
        assert scores == gold
        assert all(isinstance(s, float) and math.isfinite(s) for s in scores)
    # Mixed batch: each row is scored against its own answer.
    assert call_reward(
        reward, ["add 1 and 2", "add 2 and 2", "add 3 and 2"], ["3", "5", " 5 "],
        [{"answer": "3"}, {"answer": "4"}, {"answer": 5}],
    ) == [1.0, 0.0, 1.0]
    assert [call_reward(reward, ["what is 3 plus 4"], [r], [{"answer": "7"}])[0]
            for r in NOT_THE_ANSWER] == [0.0] * len(NOT_THE_ANSWER)


def test_reward_file_names_the_row_without_an_answer(reward):
    extras = [{"answer": "3"}, {"answer": "4"}, {"solution": "5"}]
    with pytest.raises(ValueError, match=r"row 2: the prompt has no 'answer' field.*solution"):
        call_reward(reward, ["a", "b", "c"], ["3", "4", "5"], extras)
