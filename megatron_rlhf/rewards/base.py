"""What every reward source receives and how it fails.

A reward source maps a batch of responses to one float per response. All sources get the
same `RewardInputs` (rows in rollout order); a source that cannot score stops the stage with
a `RewardSourceError` naming the source (file and function, or URL) and the problem.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field


class RewardSourceError(RuntimeError):
    """A reward source failed (a rule function raised or returned bad scores, a reward service
    is down, slow or answered wrongly). The message names the source and the failure."""


@dataclass
class RewardInputs:
    """One row per response. `response_ids` are the generated tokens (the EOS included when
    the response ended with one, `finished`); `extras` are each prompt's JSONL fields other
    than `prompt` (e.g. a reference `answer`), {} when it has none."""

    prompts: list[str]
    responses: list[str]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    finished: list[bool]
    extras: list[dict] = field(default_factory=list)

    def __post_init__(self):
        if not self.extras:
            self.extras = [{} for _ in self.prompts]
        n = len(self.prompts)
        if not all(len(x) == n for x in (self.responses, self.prompt_ids, self.response_ids, self.finished, self.extras)):
            raise ValueError("RewardInputs: every field needs one entry per response")

    def __len__(self) -> int:
        return len(self.prompts)

    def rows(self, start: int, stop: int) -> "RewardInputs":
        return RewardInputs(self.prompts[start:stop], self.responses[start:stop], self.prompt_ids[start:stop],
                            self.response_ids[start:stop], self.finished[start:stop], self.extras[start:stop])


def finite_scores(scores, expected: int) -> list[float]:
    """`scores` as `expected` floats, if it is a sequence of that many finite real numbers
    (bools are not numbers); ValueError naming the first problem otherwise."""
    if hasattr(scores, "tolist"):  # numpy arrays, tensors
        scores = scores.tolist()
    if not isinstance(scores, (list, tuple)):
        raise ValueError(f"returned {type(scores).__name__}, expected a list of {expected} floats")
    if len(scores) != expected:
        raise ValueError(f"returned {len(scores)} scores for {expected} samples")
    floats = []
    for index, value in enumerate(scores):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"score {index} is {value!r:.100} ({type(value).__name__}), not a number")
        try:
            floats.append(float(value))
        except OverflowError:  # an int (or Fraction) past the largest float, e.g. 10**400
            raise ValueError(f"score {index} ({type(value).__name__}) is too large for a float (over 1.8e308; "
                             "scores must be finite)") from None
        if not math.isfinite(floats[-1]):
            raise ValueError(f"score {index} is {value} (scores must be finite)")
    return floats
