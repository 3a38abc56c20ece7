"""Single-digit addition with exact answers: a verifiable task for rule rewards.

A prompt asks for the sum of two operands in OPERAND_RANGE in one of a few phrasings ("what is
3 plus 4"); the response is the answer as one word ("7"). Numbers are words of the builtin
vocabulary, so the whole vocabulary is about thirty words and fits a 128-entry embedding.

The SFT data is deliberately noisy: a response is correct with probability SFT_CORRECT_RATE,
otherwise it is a wrong answer near the right one. Supervised learning can only imitate that
mix, so the SFT policy answers correctly about SFT_CORRECT_RATE of the time when sampling (a
bit more when decoding greedily, since the correct answer is the single most likely one).
That leaves RL room to improve: every prompt record carries its `answer` in `extra`, so an
exact-match rule reward (rewards/arithmetic.py) can raise accuracy towards 1.0, and
`gold_score` measures that accuracy from the prompt text alone. Preference pairs (correct vs.
wrong answer) let a learned reward model route train on the same task.
"""

from __future__ import annotations

import random

from megatron_rlhf.data.jsonl import PreferenceExample, PromptExample, SFTExample
from megatron_rlhf.data.tasks.base import Task, TaskSizes, TaskSplits, generated_splits

OPERAND_RANGE = range(0, 5)
ANSWER_RANGE = range(2 * OPERAND_RANGE[0], 2 * OPERAND_RANGE[-1] + 1)
# Share of SFT responses that are correct; the rest are near misses for RL to fix.
SFT_CORRECT_RATE = 0.5
# Wrong answers are this close to the right one, so they look plausible, not random.
MAX_WRONG_DISTANCE = 3
# Characters a response may end or start with and still count as its bare answer ("7.").
PUNCTUATION = ".,!?;:"

# "A" and "B" are the operand slots; every other word is literal.
OPERAND_SLOTS = ("A", "B")
PROMPT_TEMPLATES = (
    "what is A plus B",
    "A plus B equals",
    "add A and B",
    "the sum of A and B is",
    "what is the sum of A and B",
)


class ArithmeticTask(Task):
    """Add two single-digit numbers; the gold reward is 1.0 for the exact sum, else 0.0."""

    name = "arithmetic"

    def words(self) -> list[str]:
        """The template words, then every number an operand or answer can be, in order."""
        words = [w for t in PROMPT_TEMPLATES for w in t.split() if w not in OPERAND_SLOTS]
        words.extend(str(number) for number in ANSWER_RANGE)  # operands are answers too
        return list(dict.fromkeys(words))

    def splits(self, seed: int, sizes: TaskSizes) -> TaskSplits:
        """All six splits; each draws from its own RNG derived from `seed` and the split name."""
        return generated_splits(self.name, seed, sizes, _sft, _preferences, _prompts)

    def gold_score(self, prompt: str, response: str) -> float:
        """1.0 when the response is exactly the sum of the prompt's two operands, else 0.0."""
        first, second = parse_operands(prompt)
        return 1.0 if normalize_answer(response) == str(first + second) else 0.0


def parse_operands(prompt: str) -> tuple[int, int]:
    """The two numbers in `prompt`; ValueError when it does not hold exactly two."""
    # The gold scorer gets only the text, so the operands are read back from it, not from
    # the record's `answer` extra.
    numbers = [int(word) for word in prompt.split() if word.isdecimal()]
    if len(numbers) != 2:
        raise ValueError(
            f"arithmetic: prompt {prompt!r} holds {len(numbers)} numbers, not 2; the arithmetic "
            "gold scorer only scores the task's own prompts (use data.task=arithmetic without "
            "replacing data.prompts_* with other files, or data.task=null)"
        )
    return numbers[0], numbers[1]


def normalize_answer(response: str) -> str:
    """The response without surrounding whitespace and punctuation, as compared to the sum."""
    return response.strip().strip(PUNCTUATION).strip()


def _problem(rng: random.Random) -> tuple[str, int]:
    """A prompt and its correct answer."""
    operands = {slot: rng.choice(OPERAND_RANGE) for slot in OPERAND_SLOTS}
    template = rng.choice(PROMPT_TEMPLATES)
    prompt = " ".join(str(operands[w]) if w in operands else w for w in template.split())
    return prompt, sum(operands.values())


def _wrong_answer(rng: random.Random, answer: int) -> int:
    """A wrong answer within MAX_WRONG_DISTANCE of `answer`, inside ANSWER_RANGE."""
    # Drawing among in-range neighbours (rather than clipping) never lands on the answer.
    near = [
        answer + sign * distance
        for distance in range(1, MAX_WRONG_DISTANCE + 1)
        for sign in (-1, 1)
        if answer + sign * distance in ANSWER_RANGE
    ]
    return rng.choice(near)


def _prompts(rng: random.Random, count: int) -> list[PromptExample]:
    examples = []
    for _ in range(count):
        prompt, answer = _problem(rng)
        examples.append(PromptExample(prompt, extra={"answer": str(answer)}))
    return examples


def _sft(rng: random.Random, count: int) -> list[SFTExample]:
    examples = []
    for _ in range(count):
        prompt, answer = _problem(rng)
        if rng.random() >= SFT_CORRECT_RATE:
            answer = _wrong_answer(rng, answer)
        examples.append(SFTExample(prompt, str(answer)))
    return examples


def _preferences(rng: random.Random, count: int) -> list[PreferenceExample]:
    pairs = []
    for _ in range(count):
        prompt, answer = _problem(rng)
        wrong = _wrong_answer(rng, answer)
        pairs.append(PreferenceExample(prompt, chosen=str(answer), rejected=str(wrong)))
    return pairs
