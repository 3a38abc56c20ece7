"""The rollout interface the RL loop talks to, and the sampling step every engine shares."""

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
    # token ids that end a row besides the engine's EOS (a multi-turn episode's tool-call end:
    # envs/episode.py); a row ending with one is `finished` as with EOS
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, section) -> SamplingParams:
        """From the config's sampling section (config/sampling.py)."""
        return cls(section.temperature, section.top_k, section.top_p, section.max_new_tokens)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then nucleus filtering of [B, V] logits (filtered entries -> -inf)."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the token crossing top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, generator: torch.Generator,
                sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token ids [B] (long) and their log-probs [B] (fp32) from fp32 logits [B, V].

    Runs where `logits` are (no host sync); `generator` must be on that device, seeded, so the
    same seed gives the same tokens. The token is drawn from the temperature-scaled, top-k /
    top-p filtered distribution (argmax when greedy); its log-prob is under the *unfiltered*
    temperature-scaled softmax, which is what the trainer recomputes.
    """
    if generator.device != logits.device:
        raise ValueError(f"sampling generator is on {generator.device} but the logits are on {logits.device}; "
                         "create it with torch.Generator(device=logits.device)")
    # Called once per token: x / 1.0 is x exactly, so the default temperature skips the op; ids
    # stay [B, 1] (what multinomial returns, what gather takes) until the end.
    if sampling.temperature != 1.0:
        logits = logits / sampling.temperature
    if sampling.greedy:
        ids = logits.argmax(-1, keepdim=True)
    else:
        probs = filter_logits(logits, sampling.top_k, sampling.top_p).softmax(-1)
        ids = torch.multinomial(probs, 1, generator=generator)
    return ids.squeeze(-1), logits.log_softmax(-1).gather(-1, ids).squeeze(-1)


@dataclass
class Rollout:
    """Prompt + response sequences, right-padded, in the training layout.

    All tensors are on the device generation ran on (the actor's; `.to("cpu")` for host copies).
    tokens [B, S] long; prompt_lengths [B] long; lengths [B] long (prompt + response, incl. EOS
    when one was generated); logprobs [B, S] fp32: at position t, log p(tokens[t+1]) under the
    sampling temperature (unfiltered softmax, as the trainer recomputes it), 0 outside the
    response; finished [B] bool: True when the response ended with EOS.

    routes [B, S, layers, k] (mixture-of-experts actors, in-place engine): the experts each MoE
    layer of this pipeline stage chose for each token while sampling (models/routing.py); None
    otherwise.

    Multi-turn episodes (rollout/episodes.py): policy_mask [B, S] float: 1 at positions t whose
    next token t+1 the policy sampled (environment and template tokens are context: 0), which
    response_mask() returns; env_reward [B]: each episode's reward from its environment. None
    for single-turn rollouts.

    `lengths` and `finished` are the only record of where a row ends and whether it ended with
    EOS: the padding after `lengths` may be EOS itself (pad_id == eos_id), so nothing may
    derive them from the tokens.
    """

    tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    lengths: torch.Tensor
    logprobs: torch.Tensor
    finished: torch.Tensor
    routes: torch.Tensor | None = None
    policy_mask: torch.Tensor | None = None
    env_reward: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> Rollout:
        return Rollout(**{name: t.to(device) if t is not None else None for name, t in vars(self).items()})

    def __len__(self) -> int:
        return self.tokens.size(0)

    def select(self, rows: torch.Tensor) -> Rollout:
        """The rows `rows` (an index tensor on the tokens' device), in that order."""
        return Rollout(**{name: t[rows] if t is not None else None for name, t in vars(self).items()})

    @staticmethod
    def cat(parts: list[Rollout], pad_id: int) -> Rollout:
        """Rows of several rollouts, right-padded to the widest (tokens with pad_id, log-probs 0,
        routes unrouted)."""
        width = max(p.tokens.size(1) for p in parts)

        def pad(t: torch.Tensor, value) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.size(1)), value=value)

        routes = policy_mask = env_reward = None
        if parts[0].routes is not None:
            unrouted = torch.iinfo(parts[0].routes.dtype).max  # models/routing.py: no expert
            routes = torch.cat([pad(p.routes, unrouted) for p in parts])
        if parts[0].policy_mask is not None:
            policy_mask = torch.cat([pad(p.policy_mask, 0.0) for p in parts])
            env_reward = torch.cat([p.env_reward for p in parts])
        return Rollout(torch.cat([pad(p.tokens, pad_id) for p in parts]), torch.cat([p.prompt_lengths for p in parts]),
                       torch.cat([p.lengths for p in parts]), torch.cat([pad(p.logprobs, 0.0) for p in parts]),
                       torch.cat([p.finished for p in parts]), routes, policy_mask, env_reward)

    def response_lengths(self) -> torch.Tensor:
        """[B] generated tokens per row (EOS included when one was generated), on the tokens' device."""
        return self.lengths - self.prompt_lengths

    def response_ids(self) -> list[list[int]]:
        """Each row's generated token ids, without prompt or padding (host lists)."""
        rows, starts, ends = self.tokens.tolist(), self.prompt_lengths.tolist(), self.lengths.tolist()
        return [row[p:n] for row, p, n in zip(rows, starts, ends)]

    def response_mask(self) -> torch.Tensor:
        """[B, S] float on the tokens' device: 1 at positions t whose next token t+1 is a response
        token (multi-turn: one the policy sampled, policy_mask)."""
        if self.policy_mask is not None:
            return self.policy_mask
        pos = torch.arange(self.tokens.size(1), device=self.tokens.device)
        return ((pos >= self.prompt_lengths[:, None] - 1) & (pos < self.lengths[:, None] - 1)).float()


class RolloutEngine(ABC):
    needs_refit = False  # True: a separate copy of the weights that update_weights() must refresh
    pad_id: int
    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seed: int) -> Rollout:
        """Sample one response per prompt. Collective over the model-parallel group."""

    def update_weights(self) -> None:
        """Make the engine use the actor's current weights (no-op for in-place engines)."""

    def metrics(self) -> dict[str, float]:
        """The engine's latest refit / memory numbers, for the iteration's metrics (this rank's)."""
        return {}

    def shutdown(self) -> None:
        """Stop what the engine started (nothing for in-place engines)."""

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
