"""An example rule reward: exact match against each prompt's reference `answer`.

Use it from a pipeline config with

    rl:
      rewards:
        - {type: function, function: rewards/arithmetic.py:score}

It fits the built-in `arithmetic` task, whose prompt records carry `{"answer": "7"}`, and
any prompts JSONL whose records have an `answer` field (a prompt record's fields other than
`prompt` reach the reward as that row's `extras`).

A reward function has this signature:

    def score(prompts: list[str], responses: list[str], extras: list[dict], **kwargs)
        -> list[float]

It is called with keyword arguments, one list entry per response: `prompts`, `responses`
(decoded text), `prompt_ids`, `response_ids` (token ids), `finished` (whether the response
ended with EOS) and `extras`. `**kwargs` takes the ones it does not use, and any keywords
added later. It must return one finite float per response, in the same order.

This file is loaded by its path, not imported as part of a package, so it uses only the
standard library.
"""

from __future__ import annotations

# Characters a response may start or end with and still count as its bare answer ("7.").
PUNCTUATION = ".,!?;:"


def score(prompts: list[str], responses: list[str], extras: list[dict], **kwargs) -> list[float]:
    """1.0 for each response that is exactly its prompt's `answer`, else 0.0."""
    if not len(prompts) == len(responses) == len(extras):
        raise ValueError(
            f"rewards/arithmetic.py: got {len(prompts)} prompts, {len(responses)} responses "
            f"and {len(extras)} extras; expected one of each per response"
        )
    return [
        1.0 if normalize(response) == normalize(_answer(row, extra)) else 0.0
        for row, (response, extra) in enumerate(zip(responses, extras))
    ]


def normalize(text: str) -> str:
    """`text` without surrounding whitespace and punctuation (as the task's gold scorer)."""
    return text.strip().strip(PUNCTUATION).strip()


def _answer(row: int, extra: dict) -> str:
    if "answer" not in extra:
        raise ValueError(
            f"rewards/arithmetic.py: row {row}: the prompt has no 'answer' field (its extra "
            f"fields: {sorted(extra) or 'none'}); add \"answer\" to every record of the "
            "prompts JSONL file"
        )
    # str() so a file that stores numbers ({"answer": 7}) matches the response text too.
    return str(extra["answer"])
