"""Sentiment steering: continue a movie-review opening; the gold reward is its positivity.

Responses mix positive and negative words at a per-response rate, so SFT learns a policy
with every shade of sentiment, the reward model learns to prefer the more positive of two
continuations, and PPO should move the policy towards the positive end, which the gold
scorer measures independently of the learned reward. The vocabulary is small (under 120
words) so the builtin tokenizer's vocabulary fits a 128-entry embedding.
"""

from __future__ import annotations

import random

from megatron_rlhf.data.jsonl import PreferenceExample, PromptExample, SFTExample
from megatron_rlhf.data.tasks.base import Task, TaskSizes, TaskSplits, generated_splits

POSITIVE = (
    "great", "wonderful", "brilliant", "delightful", "superb", "excellent", "amazing",
    "charming", "beautiful", "moving", "fantastic", "lovely", "clever", "gripping", "fun",
    "stunning", "touching", "memorable", "perfect", "fresh",
)
NEGATIVE = (
    "awful", "boring", "dull", "terrible", "bad", "weak", "poor", "dreadful", "tedious",
    "clumsy", "bland", "messy", "painful", "stale", "horrible", "lame", "flat", "slow",
    "forgettable", "silly",
)

# Slot fillers; upper-case names in the templates below are slots, everything else is literal.
SLOTS = {
    "DET": ("the", "this"),
    "WORK": ("movie", "film"),
    "PART": (
        "plot", "acting", "story", "cast", "script", "ending", "music", "dialogue", "pacing",
        "camera", "soundtrack", "direction",
    ),
    "GROUP": ("characters", "scenes", "actors", "jokes"),
    "ADV": ("very", "quite", "really", "truly", "rather", "mostly"),
}
SENTIMENT_SLOT = "S"

# Review openings of 3-6 words, each ending where a judgement is expected.
PROMPT_TEMPLATES = (
    "DET WORK was",
    "DET PART felt",
    "i thought DET WORK was",
    "overall DET PART was",
    "i found DET PART to be",
    "the PART of this WORK was",
    "this WORK really was",
    "DET WORK seemed",
)
# A response is one opener, then continuations; every phrase has exactly one sentiment slot.
RESPONSE_OPENERS = ("S", "ADV S")
RESPONSE_CONTINUATIONS = (
    "and S",
    "and ADV S",
    "with S PART",
    "but the PART was S",
    "while the GROUP seemed S",
    "yet the GROUP were ADV S",
    "and its PART was also S",
)
MIN_RESPONSE_WORDS, MAX_RESPONSE_WORDS = 6, 12
# Preference pairs with equal gold scores are redrawn; this bounds the redraws.
MAX_DRAWS_PER_PAIR = 100

_POSITIVE_SET, _NEGATIVE_SET = frozenset(POSITIVE), frozenset(NEGATIVE)


class SentimentTask(Task):
    """Continue a movie-review opening; the gold reward is how positive the continuation is."""

    name = "sentiment"

    def words(self) -> list[str]:
        """The template words, slot fillers and sentiment words, deduplicated in a fixed order."""
        words: list[str] = []
        for template in PROMPT_TEMPLATES + RESPONSE_OPENERS + RESPONSE_CONTINUATIONS:
            words.extend(w for w in template.split() if w not in SLOTS and w != SENTIMENT_SLOT)
        for fillers in SLOTS.values():
            words.extend(fillers)
        words.extend(POSITIVE)
        words.extend(NEGATIVE)
        return list(dict.fromkeys(words))

    def splits(self, seed: int, sizes: TaskSizes) -> TaskSplits:
        """All six splits; each draws from its own RNG derived from `seed` and the split name."""
        return generated_splits(self.name, seed, sizes, self._sft, self._preferences, self._prompts)

    def gold_score(self, prompt: str, response: str) -> float:
        """(positive - negative) / (positive + negative) over the response's words; 0.0 if none."""
        # Lower-cased and stripped of punctuation so decoded text from any tokenizer scores
        # the same; words outside the vocabulary count for nothing.
        words = [word.strip(".,;:!?\"'()").lower() for word in response.split()]
        positive = sum(word in _POSITIVE_SET for word in words)
        negative = sum(word in _NEGATIVE_SET for word in words)
        if positive + negative == 0:
            return 0.0
        return (positive - negative) / (positive + negative)

    def _prompts(self, rng: random.Random, count: int) -> list[PromptExample]:
        return [PromptExample(_prompt(rng)) for _ in range(count)]

    def _sft(self, rng: random.Random, count: int) -> list[SFTExample]:
        return [SFTExample(_prompt(rng), _response(rng)) for _ in range(count)]

    def _preferences(self, rng: random.Random, count: int) -> list[PreferenceExample]:
        pairs: list[PreferenceExample] = []
        for _ in range(count * MAX_DRAWS_PER_PAIR):
            if len(pairs) == count:
                return pairs
            prompt, first, second = _prompt(rng), _response(rng), _response(rng)
            first_score = self.gold_score(prompt, first)
            second_score = self.gold_score(prompt, second)
            if first_score == second_score:
                continue  # no preference to learn
            if first_score > second_score:
                pairs.append(PreferenceExample(prompt, chosen=first, rejected=second))
            else:
                pairs.append(PreferenceExample(prompt, chosen=second, rejected=first))
        if len(pairs) == count:
            return pairs
        raise RuntimeError(f"sentiment: drew only {len(pairs)} of {count} untied preference pairs")


def _prompt(rng: random.Random) -> str:
    return _fill(rng.choice(PROMPT_TEMPLATES), rng, positive_rate=0.0)


def _response(rng: random.Random) -> str:
    # Each response gets its own positive rate so gold scores spread over [-1, 1]
    # instead of clustering at 0.
    positive_rate = rng.random()
    words = _fill(rng.choice(RESPONSE_OPENERS), rng, positive_rate).split()
    while len(words) < MIN_RESPONSE_WORDS:
        words += _fill(rng.choice(RESPONSE_CONTINUATIONS), rng, positive_rate).split()
    while rng.random() < 0.5:
        room = MAX_RESPONSE_WORDS - len(words)
        fitting = [c for c in RESPONSE_CONTINUATIONS if len(c.split()) <= room]
        if not fitting:
            break
        words += _fill(rng.choice(fitting), rng, positive_rate).split()
    return " ".join(words)


def _fill(template: str, rng: random.Random, positive_rate: float) -> str:
    words = []
    for word in template.split():
        if word == SENTIMENT_SLOT:
            words.append(rng.choice(POSITIVE if rng.random() < positive_rate else NEGATIVE))
        elif word in SLOTS:
            words.append(rng.choice(SLOTS[word]))
        else:
            words.append(word)
    return " ".join(words)
