"""The rollout interface the PPO loop talks to; engines differ in where generation runs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0          # 0: no top-k filter
    top_p: float = 1.0      # 1.0: no nucleus filter
    max_new_tokens: int = 16
    greedy: bool = False


@dataclass
class Rollout:
    """Prompt + response sequences, right-padded, in the training layout.

    tokens [B, S]; prompt_lengths [B]; lengths [B] (prompt + response, incl. EOS when one
    was generated); logprobs [B, S]: at position t, log p(tokens[t+1]) under the sampling
    temperature (unfiltered softmax, as the trainer recomputes it), 0 outside the response;
    finished [B]: True when the response ended with EOS.
    """

    tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    lengths: torch.Tensor
    logprobs: torch.Tensor
    finished: torch.Tensor

    def response_lengths(self) -> torch.Tensor:
        """[B] generated tokens per row (EOS included when one was generated)."""
        return self.lengths - self.prompt_lengths

    def response_ids(self) -> list[list[int]]:
        """Each row's generated token ids, without prompt or padding."""
        return [row[int(p):int(n)] for row, p, n in zip(self.tokens.tolist(), self.prompt_lengths, self.lengths)]

    def response_mask(self) -> torch.Tensor:
        """[B, S] float: 1 at positions t whose next token t+1 is a response token."""
        pos = torch.arange(self.tokens.size(1))
        return ((pos >= self.prompt_lengths[:, None] - 1) & (pos < self.lengths[:, None] - 1)).float()


class RolloutEngine(ABC):
    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seed: int) -> Rollout:
        """Sample one response per prompt. Collective over the model-parallel group."""

    def update_weights(self) -> None:
        """Make the engine use the actor's current weights (no-op for in-place engines)."""
