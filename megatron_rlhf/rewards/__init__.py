"""The RL stage's reward: the weighted sum of its reward sources (rl.rewards).

    reward = sum_i weight_i * score_i      (then rl.missing_eos_penalty and rl.reward_clip)

A source is the reward model role (`model`), a rule function (`function`, rewards/function.py),
a reward service (`http`, rewards/http.py; served by `python -m megatron_rlhf serve-reward`) or a
multi-turn episode's environment (`environment`, rollout/episodes.py).
Each source's own mean score is logged as reward_<name>, so a user sees which one moved.

Device and process discipline: the reward model runs on every rank of its model-parallel group
(a collective forward). A function or service is called once per data-parallel replica, by the
replica's first rank, and its scores are broadcast to the rest of the replica as a device
tensor; a failure anywhere stops every rank with the same error (no rank left waiting).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rlhf.config import RewardSourceConfig
from megatron_rlhf.parallel.collectives import errors_agreed
from megatron_rlhf.rewards.base import RewardInputs, RewardSourceError

__all__ = ["RewardInputs", "RewardSourceError", "RewardSources"]


class EnvironmentReward:
    """The `environment` source: each multi-turn episode's reward from its environment, which
    the rollout carries (Rollout.env_reward: rollout/episodes.py); nothing to call."""

    @staticmethod
    def scores(rollout) -> torch.Tensor:
        if rollout.env_reward is None:
            raise RewardSourceError("the reward source of type environment scores multi-turn episodes; this rollout "
                                    "is single-turn (rl.environment.type=none)")
        return rollout.env_reward.float()


def build_source(src: RewardSourceConfig, index: int, reward_role):
    """The scorer of `src`, rl.rewards[index]: the reward role, a FunctionReward, an
    HttpRewardClient or the EnvironmentReward."""
    if src.type == "model":
        return reward_role
    if src.type == "environment":
        return EnvironmentReward()
    if src.type == "function":
        from megatron_rlhf.rewards.function import FunctionReward

        return FunctionReward(src.function, src.label, f"rl.rewards[{index}].function")
    from megatron_rlhf.rewards.http import HttpRewardClient

    return HttpRewardClient(src.url, name=src.label, timeout_s=src.timeout_s, max_retries=src.max_retries,
                            backoff_s=src.backoff_s, max_backoff_s=src.max_backoff_s, batch_size=src.batch_size,
                            max_concurrency=src.max_concurrency)


class RewardSources:
    """Scores rollouts with every source of `sources` (rl.rewards) and combines them. The reward
    model source is `reward_role`, run over microbatches of `micro_batch_size` rows (or
    `micro_batch_tokens` tokens: rl.micro_batch_size, rl.micro_batch_tokens)."""

    def __init__(self, sources: list[RewardSourceConfig], reward_role=None, *, micro_batch_size: int,
                 micro_batch_tokens: int = 0):
        self.micro_batch_size, self.micro_batch_tokens = micro_batch_size, micro_batch_tokens
        self.sources = [(src.label, src.weight, build_source(src, i, reward_role)) for i, src in enumerate(sources)]

    def score(self, rollout, inputs_fn) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """([B] combined reward (penalty and clip not applied), {name: [B] that source's
        scores}), float32 on the rollout's device. `inputs_fn()` builds the RewardInputs
        (decoded text), only when a function or service needs them."""
        inputs, per_source = None, {}
        for label, _, source in self.sources:
            if hasattr(source, "forward"):  # the reward model role: a collective forward
                per_source[label] = rm_scores(source, rollout, self.micro_batch_size, self.micro_batch_tokens)
                continue
            if isinstance(source, EnvironmentReward):  # already on every rank of the replica
                per_source[label] = source.scores(rollout)
                continue
            inputs = inputs if inputs is not None else inputs_fn()
            per_source[label] = on_replica_leader(source.score, inputs, rollout.tokens.device)
        return weighted_sum(per_source, {label: weight for label, weight, _ in self.sources}), per_source

    def pop_stats(self) -> dict[str, float]:
        """Service statistics since the last call (requests, retries, latency) per source."""
        stats = {}
        for label, _, source in self.sources:
            if hasattr(source, "pop_stats"):
                stats.update({f"reward_{label}_{k}": v for k, v in source.pop_stats().items()})
        return stats

    def close(self) -> None:
        for _, _, source in self.sources:
            if hasattr(source, "close"):
                source.close()


def rm_scores(reward_model, rollout, micro_batch_size: int, token_budget: int = 0) -> torch.Tensor:
    """[B] a reward model's (normalised, unclipped) scores of the rollout's sequences."""
    from megatron_rlhf.models.batching import padded_forward

    seqs = {"tokens": rollout.tokens, "lengths": rollout.lengths}
    return padded_forward(reward_model, seqs, micro_batch_size, token_budget)["rewards"]


def weighted_sum(scores: dict[str, torch.Tensor], weights: dict[str, float]) -> torch.Tensor:
    """sum_i weights[i] * scores[i] in float32, on the scores' device."""
    total = None
    for name, weight in weights.items():
        term = weight * scores[name].float()
        total = term if total is None else total + term
    return total


def replica_leader_and_group():
    """(global rank of this data-parallel replica's first rank, the replica's process group)."""
    from megatron.core import parallel_state

    group = parallel_state.get_model_parallel_group()
    return dist.get_process_group_ranks(group)[0], group


def on_replica_leader(score_fn, inputs: RewardInputs, device: torch.device) -> torch.Tensor:
    """score_fn(inputs) on the replica's first rank, broadcast to the replica as a float32
    device tensor. A RewardSourceError on any rank is raised on every rank."""
    leader, group = replica_leader_and_group()
    scores = torch.zeros(len(inputs), dtype=torch.float64, device=device)
    # every rank stops, none waits in a later collective
    with errors_agreed(lambda: RewardSourceError("a reward source failed on another rank (its error is in that "
                                                 "rank's log)"), catch=RewardSourceError):
        if dist.get_rank() == leader:
            scores = torch.tensor(score_fn(inputs), dtype=torch.float64, device=device)
    if dist.get_world_size(group) > 1:
        dist.broadcast(scores, src=leader, group=group)
    return scores.float()
