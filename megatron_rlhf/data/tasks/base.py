"""What a built-in task provides: a vocabulary, seeded data splits and a gold scorer.

A built-in task makes the whole pipeline checkable without downloads: its data is a pure
function of the seed, and its gold scorer tells whether PPO really improved the policy
(rather than only fooling the learned reward model).
"""

from __future__ import annotations

import dataclasses
import os
import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatron_rlhf.data.jsonl import PreferenceExample, PromptExample, SFTExample, write_jsonl


@dataclass
class TaskSizes:
    """How many examples each split gets."""

    sft_train: int = 2000  # SFT examples the task generates
    sft_eval: int = 200  # held-out SFT examples
    preference_train: int = 2000  # preference pairs (RM, DPO)
    preference_eval: int = 200  # held-out preference pairs
    ppo_prompts: int = 1000  # RL training prompts
    eval_prompts: int = 100  # held-out prompts for RL and DPO evaluations

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            # An empty split would only fail later, when its JSONL file is read back.
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TaskSizes.{field.name}: expected a positive int, got {value!r}")


@dataclass
class TaskSplits:
    """All the data one pipeline run needs, split by stage."""

    sft_train: list[SFTExample]
    sft_eval: list[SFTExample]
    preference_train: list[PreferenceExample]
    preference_eval: list[PreferenceExample]
    ppo_prompts: list[PromptExample]
    eval_prompts: list[PromptExample]

    def write(self, directory: str | os.PathLike[str]) -> dict[str, Path]:
        """Write each split to `directory/<split>.jsonl`; returns split name -> path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        paths = {}
        for field in dataclasses.fields(self):
            path = directory / f"{field.name}.jsonl"
            write_jsonl(path, getattr(self, field.name))
            paths[field.name] = path
        return paths


class Task(ABC):
    """A built-in task: vocabulary for the builtin tokenizer, splits, and a gold reward."""

    name: str

    @abstractmethod
    def words(self) -> list[str]:
        """Every word the task's data can contain, in a fixed order (the builtin vocabulary)."""

    @abstractmethod
    def splits(self, seed: int, sizes: TaskSizes) -> TaskSplits:
        """All data splits, a pure function of `seed` and `sizes`."""

    @abstractmethod
    def gold_score(self, prompt: str, response: str) -> float:
        """The true quality of `response` to `prompt`, the target the reward model learns."""


def generated_splits(name: str, seed: int, sizes: TaskSizes, sft: Callable[[random.Random, int], list],
                     preferences: Callable[[random.Random, int], list],
                     prompts: Callable[[random.Random, int], list]) -> TaskSplits:
    """The six splits of a task whose examples come from generators (rng, count) -> examples;
    each split draws from its own RNG derived from the task's `name`, `seed` and the split's
    name. String seeds are hashed with SHA-512 by `random`, so this is stable across processes
    and Python versions, and no split shares another's stream."""

    def rng(split: str) -> random.Random:
        return random.Random(f"{name}:{seed}:{split}")

    return TaskSplits(
        sft_train=sft(rng("sft_train"), sizes.sft_train),
        sft_eval=sft(rng("sft_eval"), sizes.sft_eval),
        preference_train=preferences(rng("preference_train"), sizes.preference_train),
        preference_eval=preferences(rng("preference_eval"), sizes.preference_eval),
        ppo_prompts=prompts(rng("ppo_prompts"), sizes.ppo_prompts),
        eval_prompts=prompts(rng("eval_prompts"), sizes.eval_prompts),
    )
