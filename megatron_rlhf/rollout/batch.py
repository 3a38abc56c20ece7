"""The batch that flows from the score phase to the advantages and the train phase.

Sequence layout: [B, S] tensors where position t holds what predicts token t+1 (the roles'
outputs); `mask` marks the positions whose next token is a response token. The advantage
estimators work in response layout ([B, W], column j = response token j, W =
sampling.max_new_tokens); `response` and `sequence` convert between the two.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class RolloutBatch:
    tokens: Tensor                   # [B, S] long: prompt + response, right-padded
    lengths: Tensor                  # [B] long: prompt + response tokens
    prompt_lengths: Tensor           # [B] long
    mask: Tensor                     # [B, S] float: 1 where the next token is a response token
    group_ids: Tensor                # [B] long: the rows sampled from one prompt share it
    old_logprobs: Tensor             # [B, S] the actor's log-probs before this iteration's updates
    ref_logprobs: Tensor             # [B, S] the reference policy's
    scores: Tensor                   # [B] sequence reward (reward model, clipped)
    values: Tensor | None = None     # [B, S] the critic's (PPO only)
    advantages: Tensor | None = None  # [B, S], set by the advantage estimator
    returns: Tensor | None = None    # [B, S] the critic's targets (PPO only)
    # [B, S] the rollout engine's log-probs, kept only for the mismatch correction (rl.tis_cap,
    # rl.mismatch_mask_threshold)
    rollout_logprobs: Tensor | None = None
    # [B, S, layers, k] the rollout's expert choices, which the actor's train forwards replay
    # (rl.routing_replay; models/routing.py)
    routes: Tensor | None = None

    def __len__(self) -> int:
        return self.tokens.size(0)

    def tensors(self) -> dict[str, Tensor]:
        """The set fields by name: what Role.train_step splits into microbatches."""
        return {k: v for k, v in vars(self).items() if v is not None}

    @classmethod
    def of(cls, microbatch: dict[str, Tensor]) -> RolloutBatch:
        """A microbatch that Role.train_step split from `tensors()`, typed again (fields it
        lacks are None; keys that are not fields are ignored)."""
        return cls(**{f.name: microbatch.get(f.name) for f in dataclasses.fields(cls)})

    def select(self, rows: Tensor) -> RolloutBatch:
        return dataclasses.replace(self, **{k: v[rows] for k, v in self.tensors().items()})

    def response_mask(self, width: int) -> Tensor:
        """[B, width] float: 1 on the response tokens the policy sampled (response layout): `mask`
        in response layout, where a multi-turn episode's environment tokens are 0 between them."""
        return self.response(self.mask, width) * (torch.arange(width, device=self.mask.device)
                                                  < (self.lengths - self.prompt_lengths)[:, None])

    def response(self, x: Tensor, width: int) -> Tensor:
        """[B, S] sequence layout -> [B, width] response layout."""
        idx = (self.prompt_lengths[:, None] - 1 + torch.arange(width, device=x.device)).clamp(max=x.size(1) - 1)
        return x.gather(1, idx)

    def sequence(self, y: Tensor) -> Tensor:
        """[B, width] response layout -> [B, S] sequence layout (zeros elsewhere)."""
        seq_len = self.tokens.size(1)
        out = torch.zeros(y.size(0), seq_len + y.size(1), dtype=y.dtype, device=y.device)
        idx = self.prompt_lengths[:, None] - 1 + torch.arange(y.size(1), device=y.device)
        return out.scatter(1, idx, y)[:, :seq_len]
