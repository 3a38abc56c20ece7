"""Arithmetic on two- and three-digit numbers, solvable with a calculator tool: the built-in
multi-turn task (`data.task: calculator`; its environment is envs/calculator.py CalculatorEnv).

The builtin tokenizer is a word tokenizer, so numbers are written digit by digit ("347" is
the words "3 4 7", "-22" is "- 2 2") and the vocabulary stays ~40 words. A prompt:

    what is 3 4 7 * 2 1

A policy that uses the tool writes a turn ending at "</calc>", the environment answers between
"<obs>" and "</obs>" (TURN_TEMPLATE), and the policy's last turn is its answer:

    <calc> 3 4 7 * 2 1 </calc>  <obs> 7 2 8 7 </obs>  answer 7 2 8 7 <eos>
    '------ policy ------'      '- environment -'     '--- policy ---'

Every marker is one word of the vocabulary, so the trajectory's ids are the concatenation of
each part's ids: the environment's "7 2 8 7" is encoded alone and appended between the ids of
"<obs>" and "</obs>"; nothing is encoded twice.

SFT data: SFT_TOOL_RATE of the demonstrations call the tool and answer right; the others
answer at once with a near miss (one digit off), as a policy guessing a product would. SFT
therefore learns to call the tool about half the time and RL has room to raise the tool-call
rate and the exact-match rate. Preference pairs: tool-use answer (chosen) vs a near miss.
The gold scorer reads only the text: the policy's final turn must be "answer <the value>".
"""

from __future__ import annotations

import random

from megatron_rlhf.data.jsonl import PreferenceExample, PromptExample, SFTExample
from megatron_rlhf.data.tasks.base import Task, TaskSizes, TaskSplits, generated_splits

OPERAND_RANGE = range(10, 1000)
OPERATORS = ("+", "-", "*")
DIGITS = tuple(str(d) for d in range(10))
# Markers: the tool call, the observation around the tool's output, the final answer.
TOOL_NAME = "calc"
CALL_OPEN, CALL_CLOSE = f"<{TOOL_NAME}>", f"</{TOOL_NAME}>"
OBSERVATION_OPEN, OBSERVATION_CLOSE = "<obs>", "</obs>"
ANSWER = "answer"
ERROR = "error"  # the tool's answer to an expression it cannot evaluate
PROMPT_TEMPLATES = ("what is X", "compute X", "X equals")
# Share of SFT demonstrations that call the tool; the rest guess (and miss by one digit).
SFT_TOOL_RATE = 0.5
# The calculator refuses numbers longer than this and results beyond MAX_MAGNITUDE, so a
# policy cannot make it build huge integers.
MAX_DIGITS = 12
MAX_MAGNITUDE = 10 ** 18


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate (the policy's mistake)."""


def evaluate(expression: str) -> int:
    """The value of an integer expression of + - * (usual precedence, unary minus), spaces
    ignored ("3 4 7 * 2 1" is 347*21). No eval(): a small recursive-descent parser."""
    text = "".join(expression.split())
    if not text:
        raise CalculatorError("empty expression")
    position = 0

    def peek() -> str:
        return text[position] if position < len(text) else ""

    def number() -> int:
        nonlocal position
        sign = 1
        while peek() == "-":  # a loop, not recursion: "- - - ... 5" of any length is fine
            sign, position = -sign, position + 1
        start = position
        while peek() in DIGITS:  # ASCII digits only (str.isdigit accepts "²")
            position += 1
        if position == start:
            raise CalculatorError(f"expected a number at {text[start:start + 10]!r}")
        if position - start > MAX_DIGITS:
            raise CalculatorError(f"a number longer than {MAX_DIGITS} digits")
        return sign * int(text[start:position])

    def bounded(value: int) -> int:
        if abs(value) > MAX_MAGNITUDE:
            raise CalculatorError(f"a value beyond {MAX_MAGNITUDE:.0e}")
        return value

    def product() -> int:
        nonlocal position
        value = number()
        while peek() == "*":
            position += 1
            value = bounded(value * number())
        return value

    value = product()
    while peek() in ("+", "-"):
        operator = peek()
        position += 1
        value = bounded(value + product() if operator == "+" else value - product())
    if position != len(text):
        raise CalculatorError(f"unexpected {text[position:position + 10]!r}")
    return value


def spell(value: int) -> str:
    """`value` as words of the vocabulary: 7287 -> "7 2 8 7", -22 -> "- 2 2"."""
    return " ".join(("-" if value < 0 else "") + str(abs(value)))


def read_number(words: list[str]) -> int | None:
    """The integer spelled by `words` (spell's inverse), or None if they spell none."""
    digits = words[1:] if words[:1] == ["-"] else words
    if not digits or not all(w in DIGITS for w in digits):
        return None
    value = int("".join(digits))
    return -value if words[0] == "-" else value


def final_answer(response: str) -> int | None:
    """The number of the policy's last turn (the text after the last observation), when that
    turn is exactly "answer <number>"; else None."""
    last_turn = response.rsplit(OBSERVATION_CLOSE, 1)[-1].split()
    if last_turn[:1] != [ANSWER]:
        return None
    return read_number(last_turn[1:])


def expression_of(prompt: str) -> str:
    """The arithmetic of a task prompt ("what is 3 4 7 * 2 1" -> "3 4 7 * 2 1")."""
    words = prompt.split()
    start = next((i for i, w in enumerate(words) if w in DIGITS), None)
    if start is None:
        raise ValueError(f"calculator: prompt {prompt!r} holds no number; the calculator gold scorer only scores the "
                         "task's own prompts (data.task=calculator without replacing data.prompts_*)")
    end = start
    while end < len(words) and (words[end] in DIGITS or words[end] in OPERATORS):
        end += 1
    return " ".join(words[start:end])


def demonstration(expression: str, value: int) -> str:
    """A tool-using response: the call, the observation as the environment frames it, the answer."""
    return (f"{CALL_OPEN} {expression} {CALL_CLOSE} {OBSERVATION_OPEN} {spell(value)} {OBSERVATION_CLOSE} "
            f"{ANSWER} {spell(value)}")


class CalculatorTask(Task):
    """Two operands in OPERAND_RANGE joined by + - or *; gold 1.0 for the exact final answer."""

    name = "calculator"

    def words(self) -> list[str]:
        template_words = [w for t in PROMPT_TEMPLATES for w in t.split() if w != "X"]
        markers = [CALL_OPEN, CALL_CLOSE, OBSERVATION_OPEN, OBSERVATION_CLOSE, ANSWER, ERROR]
        return list(dict.fromkeys([*template_words, *DIGITS, *OPERATORS, *markers]))

    def splits(self, seed: int, sizes: TaskSizes) -> TaskSplits:
        """All six splits; each draws from its own RNG derived from `seed` and the split name."""
        return generated_splits(self.name, seed, sizes, _sft, _preferences, _prompts)

    def gold_score(self, prompt: str, response: str) -> float:
        """1.0 when the response's final turn is "answer" and the prompt's exact value."""
        return 1.0 if final_answer(response) == evaluate(expression_of(prompt)) else 0.0


def _problem(rng: random.Random) -> tuple[str, str, int]:
    """(prompt, expression, value)."""
    first, second = rng.choice(OPERAND_RANGE), rng.choice(OPERAND_RANGE)
    expression = f"{spell(first)} {rng.choice(OPERATORS)} {spell(second)}"
    return rng.choice(PROMPT_TEMPLATES).replace("X", expression), expression, evaluate(expression)


def _near_miss(rng: random.Random, value: int) -> int:
    """`value` with one digit changed (a plausible wrong guess; never `value`)."""
    digits = list(str(abs(value)))
    index = rng.randrange(len(digits))
    choices = [d for d in DIGITS if d != digits[index] and not (index == 0 and d == "0" and len(digits) > 1)]
    digits[index] = rng.choice(choices)
    return int("".join(digits)) * (-1 if value < 0 else 1)


def _prompts(rng: random.Random, count: int) -> list[PromptExample]:
    examples = []
    for _ in range(count):
        prompt, _, value = _problem(rng)
        examples.append(PromptExample(prompt, extra={"answer": str(value)}))
    return examples


def _sft(rng: random.Random, count: int) -> list[SFTExample]:
    examples = []
    for _ in range(count):
        prompt, expression, value = _problem(rng)
        if rng.random() < SFT_TOOL_RATE:
            examples.append(SFTExample(prompt, demonstration(expression, value)))
        else:
            examples.append(SFTExample(prompt, f"{ANSWER} {spell(_near_miss(rng, value))}"))
    return examples


def _preferences(rng: random.Random, count: int) -> list[PreferenceExample]:
    pairs = []
    for _ in range(count):
        prompt, expression, value = _problem(rng)
        pairs.append(PreferenceExample(prompt, chosen=demonstration(expression, value),
                                       rejected=f"{ANSWER} {spell(_near_miss(rng, value))}"))
    return pairs
