"""The RL stage's per-token losses and how they average over the global batch (torch only).

Per-token tensors are [B, T] in any one layout (the trainer uses the sequence layout);
`aggregate` turns a per-token loss into (sum, units) for one microbatch and the trainer divides
by the units of the whole global batch (all microbatches, all data-parallel ranks), so no split
of the batch changes the objective.

References: Schulman et al. 2017 (PPO clipping); Ye et al. 2020 (dual-clip); Yu et al. 2025
(DAPO: clip-higher, token-level mean); Zheng et al. 2025 (GSPO: sequence-level ratio).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from megatron_rlhf.algorithms.stats import masked
from megatron_rlhf.config import LOSS_AGGREGATIONS


def log_importance_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, level: str = "token") -> Tensor:
    """log(pi / pi_old) per token. "sequence" (GSPO): every token of a row carries the row's
    length-normalised ratio s = exp(mean_t log(pi_t / pi_old_t)) as its value, with the gradient
    of its own log pi_t scaled by s; with seq_mean_token_mean aggregation this is GSPO's
    sequence objective and gradient exactly."""
    log_ratio = logprobs - old_logprobs
    if level == "token":
        return log_ratio
    if level != "sequence":
        raise ValueError(f"rl.importance_ratio must be token or sequence; got {level!r}")
    per_row = masked(log_ratio, mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    return per_row.detach() + logprobs - logprobs.detach()


def policy_loss(log_ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float | None = None,
                dual_clip: float | None = None) -> tuple[Tensor, Tensor]:
    """Clipped surrogate -min(rho A, clip(rho, 1 - low, 1 + high) A) per token, and where a
    clipped term was the active one (its gradient is zero). clip_high None: = clip_low.
    dual_clip c > 1 bounds the loss of a negative advantage at -c A (a huge ratio on a bad
    token cannot dominate the step). [B, T] -> ([B, T], [B, T] bool)."""
    ratio = torch.exp(log_ratio)
    high = clip_low if clip_high is None else clip_high
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + high)
    # max of the negated terms = the pessimistic (lower) bound of the objective.
    loss, active = torch.maximum(unclipped, clipped), clipped > unclipped
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual = (advantages < 0) & (loss > bound)
        loss, active = torch.where(dual, bound, loss), active | dual
    return loss, active.detach()


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip_range: float) -> tuple[Tensor, Tensor]:
    """Clipped value loss 0.5 * max((V - R)^2, (V_clip - R)^2) per token, V_clip = V_old +
    clamp(V - V_old, -c, c), and where the clipped error was the larger. [B, T] -> ([B, T], bool)."""
    clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    err_unclipped = (values - returns) ** 2
    err_clipped = (clipped - returns) ** 2
    # The larger error is taken so that moving V far from V_old can never lower the loss.
    return 0.5 * torch.maximum(err_unclipped, err_clipped), (err_clipped > err_unclipped).detach()


def aggregate(x: Tensor, mask: Tensor, mode: str) -> tuple[Tensor, Tensor]:
    """A per-token loss as (sum over this microbatch's units, number of units, int32). The loss
    is the sum of the whole global batch over its unit count, whatever the split:
      token_mean            every token weighs the same (unit: token; DAPO);
      seq_mean_token_mean   every sequence weighs the same, its tokens averaged (unit: sequence);
      seq_mean_token_sum    every sequence weighs the same, its tokens summed (unit: sequence;
                            Dr.GRPO up to a constant factor).
    Rows without a valid token are not units."""
    values = masked(x * mask, mask)
    if mode == "token_mean":
        return values.sum(), (mask != 0).sum().to(torch.int32)
    tokens = (mask != 0).sum(dim=1)
    per_sequence = values.sum(dim=1)
    if mode == "seq_mean_token_mean":
        per_sequence = per_sequence / tokens.clamp(min=1)
    elif mode != "seq_mean_token_sum":
        raise ValueError(f"rl.loss_aggregation must be one of {', '.join(LOSS_AGGREGATIONS)}; got {mode!r}")
    return per_sequence.sum(), (tokens > 0).sum().to(torch.int32)


def rollout_correction(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, tis_cap: float | None,
                       mask_threshold: float | None) -> Tensor:
    """Per-token weights [B, T] (no gradient) for the policy loss when the rollout engine's
    distribution pi_rollout differs from the trainer's pi_old (Yao et al. 2025, "Your efficient
    RL framework secretly brings you off-policy RL training"; as verl and slime ship it):
      tis_cap c:          w_t = min(pi_old_t / pi_rollout_t, c)  (truncated importance sampling);
      mask_threshold t:   a row whose geometric-mean ratio exp(mean_t log(pi_old_t / pi_rollout_t))
                          lies outside [1/t, t] gets weight 0 on every token.
    Both None: ones. A masked row stays a unit of the loss's denominator, so the weights never
    change how the loss averages over the global batch.

    Asynchronous RL (rl.max_staleness = N >= 1) is decoupled PPO (Hilton et al. 2022, "Batch
    size-invariance for policy optimization"; AReaL's and NeMo-RL's async objective): batch k was
    sampled by the behaviour policy pi_behav = the engine at version k - 1 - N (rollout_logprobs),
    the proximal policy pi_prox = the actor at version k - 1 recomputed in the score phase
    (old_logprobs), and per token
        loss_t = -w_t * min(r_t A_t, clip(r_t, 1 - eps, 1 + eps_high) A_t),
        r_t = pi_t / pi_prox_t (gradient),  w_t = min(pi_prox_t / pi_behav_t, c)  (no gradient),
    so the trust region is around the recent policy and the staleness is corrected by w; with
    rl.tis_cap unset w = 1 (the staleness uncorrected: a warning says so). At N = 0 with the same
    settings this is today's objective exactly (pi_behav is the same version as pi_prox, its
    log-probs the engine's). tests/test_async_schedule.py checks it by hand."""
    log_ratio = (old_logprobs - rollout_logprobs).detach() * mask
    weights = torch.ones_like(log_ratio)
    if tis_cap is not None:
        weights = torch.exp(log_ratio).clamp(max=tis_cap)
    if mask_threshold is not None:
        row = log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
        weights = weights * (row.abs() <= math.log(mask_threshold)).to(weights.dtype)
    return weights * mask
