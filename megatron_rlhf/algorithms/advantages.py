"""Advantage estimators, one per algorithm, behind one signature (torch only):

    estimator(scores [B], kl_penalty [B, T], mask [B, T], values [B, T] | None, s: Settings)
        -> (advantages [B, T], returns [B, T] | None)

`scores` are the sequence rewards (reward model, clipped); `kl_penalty` is -kl_coef * KL per
token when the KL is in the reward, zeros when it is in the loss; `values` exist only for
PPO (the critic); `returns` are the critic's targets (None without a critic). Rows of one
prompt's group are consecutive (group i is rows i*n .. i*n+n-1, n = s.group_size) and stay on
one data-parallel rank; statistics over the whole batch use `s.reduce` (the data-parallel sum).

  ppo                     GAE over token rewards with the critic's values, whitened over the batch
  grpo                    (R - mean_group) / std_group; Dr.GRPO: group_std=False, no division
  rloo                    R - mean of the group's other samples
  reinforce_pp            discounted token returns, whitened over the global batch (REINFORCE++)
  reinforce_pp_baseline   scores minus their group mean, then as reinforce_pp
  batch_mean              R - mean of R over the global batch
with R = score + sum_t kl_penalty_t, the sequence's return (gamma ignored for sequence-level R).

A row without policy tokens (mask row sum 0: a failed multi-turn episode, which keeps its row so
its group keeps its size) is no sample: it is absent from every statistic (the group mean, GRPO's
std, RLOO's count of others, the batch mean), so its score (0, or rl.missing_eos_penalty) cannot
move its siblings' advantages, and its own advantage is 0. A group with fewer than two valid rows
has nothing to compare with: advantage 0 for all its rows, never NaN. A group whose rows are all
valid (every single-turn group) gets exactly the numbers it got before rows could be invalid.

References: Schulman et al. 2016 (GAE); Shao et al. 2024 (GRPO); Liu et al. 2025 (Dr.GRPO);
Ahmadian et al. 2024 (RLOO); Hu 2025 (REINFORCE++).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from megatron_rlhf.algorithms.stats import masked, masked_moments, whiten

Reduce = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class Settings:
    gamma: float = 1.0
    lam: float = 0.95
    whiten: bool = True           # ppo: whiten the GAE advantages over the global batch
    group_size: int = 1           # samples per prompt
    group_std: bool = True        # grpo: divide by the group's std (False: Dr.GRPO)
    eps: float = 1e-6
    reduce: Reduce | None = None  # sums a tensor over data-parallel ranks; None: this batch only


def token_rewards(kl_penalty: Tensor, scores: Tensor, mask: Tensor) -> Tensor:
    """r_t = kl_penalty_t, plus the sequence score on the last valid token. kl_penalty, mask:
    [B, T]; scores [B] -> [B, T], zero where mask is 0 (right padding, or a multi-turn episode's
    environment tokens between the policy's: the score goes on the policy's last token)."""
    rewards = masked(kl_penalty, mask)
    lengths = mask.sum(dim=1).long()
    columns = torch.arange(mask.size(1), device=mask.device)
    last = torch.where(mask != 0, columns, torch.zeros_like(columns)).amax(dim=1, keepdim=True)
    # An all-padding row has no token to carry its score, so it gets none.
    score = torch.where(lengths > 0, scores.to(rewards.dtype), torch.zeros_like(rewards[:, 0]))
    return rewards.scatter_add(1, last, score.unsqueeze(1))


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation. All [B, T] -> (advantages, returns).

    delta_t = r_t + gamma * V_{t+1} - V_t,  A_t = delta_t + gamma * lam * A_{t+1}, with V and A
    after the last valid token = 0; returns = A + V. Both 0 where mask is 0."""
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_adv = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        valid = mask[:, t] != 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(valid, adv, torch.zeros_like(adv))
        # A padded slot is skipped, not bootstrapped: the carry passes through it unchanged.
        next_value = torch.where(valid, values[:, t], next_value)
        next_adv = torch.where(valid, adv, next_adv)
    returns = torch.where(mask != 0, advantages + values, torch.zeros_like(values))
    return advantages, returns


@torch.no_grad()
def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = sum_{k >= t} gamma^(k-t) r_k over valid tokens. [B, T] -> [B, T], 0 at padding."""
    zeros = torch.zeros_like(rewards)
    return gae(rewards, zeros, mask, gamma, 1.0)[0]


def sequence_returns(scores: Tensor, kl_penalty: Tensor, mask: Tensor) -> Tensor:
    """R = score + the summed per-token KL penalty. -> [B] float32."""
    return scores.float() + masked(kl_penalty, mask).sum(dim=1).float()


def group_view(x: Tensor, group_size: int) -> Tensor:
    """[B] -> [B / n, n]: one row per prompt's group (consecutive rows)."""
    if x.size(0) % group_size:
        raise ValueError(f"{x.size(0)} rows are not whole groups of rl.n_samples_per_prompt={group_size}")
    return x.view(-1, group_size)


def valid_rows(mask: Tensor) -> Tensor:
    """[B, T] -> [B] bool: the rows with at least one policy token; the others (a failed
    episode's, an empty response) are no sample of their group or batch."""
    return mask.sum(dim=1) > 0


def group_moments(x: Tensor, valid: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Each group's statistics over its valid rows only. x [B], valid [B] bool ->
    (deviation of each row from its group's mean [B/n, n], the group's unbiased std [B/n, 1],
    its count of valid rows [B/n, 1]). An invalid row's deviation is 0, and so is every row's in
    a group of fewer than two valid rows (its std 0, not NaN). A group with every row valid gets
    torch's own mean and std, bit for bit what the estimators computed before rows could be invalid."""
    groups, ok = group_view(x, group_size), group_view(valid, group_size)
    count = ok.sum(dim=1, keepdim=True)
    full = count == group_size
    mean = torch.where(full, groups.mean(dim=1, keepdim=True),
                       masked(groups, ok).sum(dim=1, keepdim=True) / count.clamp(min=1))
    centred = torch.where(ok & (count > 1), groups - mean, torch.zeros_like(groups))
    var = (centred * centred).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
    return centred, torch.where(full, groups.std(dim=1, keepdim=True), var.sqrt()), count


def broadcast(per_sequence: Tensor, mask: Tensor) -> Tensor:
    """A per-sequence advantage on every valid token of its row. [B] -> [B, T]."""
    return masked(per_sequence[:, None].to(mask.dtype).expand_as(mask), mask)


# ----------------------------------------------------------------------------- estimators


def ppo(scores, kl_penalty, mask, values, s: Settings):
    advantages, returns = gae(token_rewards(kl_penalty, scores, mask), values * mask, mask, s.gamma, s.lam)
    if s.whiten:
        _, mean, var = masked_moments(advantages, mask, s.reduce)
        advantages = whiten(advantages, mask, mean, var)
    return advantages, returns


def grpo(scores, kl_penalty, mask, values, s: Settings):
    centred, std, _ = group_moments(sequence_returns(scores, kl_penalty, mask), valid_rows(mask), s.group_size)
    if s.group_std:  # unbiased std, as GRPO's reference implementations; 0 for equal rewards
        centred = centred / (std + s.eps)
    return broadcast(centred.flatten(), mask), None


def rloo(scores, kl_penalty, mask, values, s: Settings):
    centred, _, count = group_moments(sequence_returns(scores, kl_penalty, mask), valid_rows(mask), s.group_size)
    # R_i - mean of the m - 1 others = m / (m - 1) * (R_i - group mean), m the group's valid
    # rows: exactly 0 for equal rewards
    leave_one_out = count / (count - 1).clamp(min=1) * centred
    return broadcast(leave_one_out.flatten(), mask), None


def reinforce_pp(scores, kl_penalty, mask, values, s: Settings):
    returns = discounted_returns(token_rewards(kl_penalty, scores, mask), mask, s.gamma)
    _, mean, var = masked_moments(returns, mask, s.reduce)
    return whiten(returns, mask, mean, var), None


def reinforce_pp_baseline(scores, kl_penalty, mask, values, s: Settings):
    baselined = group_moments(scores.float(), valid_rows(mask), s.group_size)[0].flatten()
    return reinforce_pp(baselined, kl_penalty, mask, values, s)


def batch_mean(scores, kl_penalty, mask, values, s: Settings):
    returns = sequence_returns(scores, kl_penalty, mask)
    has_tokens = valid_rows(mask)[:, None].to(mask.dtype)
    _, mean, _ = masked_moments(returns[:, None], has_tokens, s.reduce)
    return broadcast((returns - mean).float(), mask), None


ESTIMATORS = {"ppo": ppo, "grpo": grpo, "rloo": rloo, "reinforce_pp": reinforce_pp,
              "reinforce_pp_baseline": reinforce_pp_baseline, "batch_mean": batch_mean}
