"""PPO-RLHF math as pure tensor functions (torch only), one formula per function.

Conventions shared by every function below:
  * per-token tensors are [B, T] float32 over the *response* positions, already sliced and
    aligned by the caller: position t holds the log-prob / value / reward of response token t;
  * ``mask`` is [B, T] float, 1 for a real response token and 0 for padding (right padding);
  * losses are returned per token; `aggregate` turns them into (sum, units) for one
    microbatch, and the trainer divides by the units of the whole global batch (all
    microbatches, all data-parallel ranks), so no split of the batch changes the objective;
  * ``logprobs``, ``old_logprobs``, ``ref_logprobs`` are log-probs of the *sampled* tokens.

References: Ziegler et al. 2019 (adaptive KL, per-token KL reward), Schulman et al. 2017 (PPO
clipping), Schulman et al. 2016 (GAE), J. Schulman "Approximating KL divergence" (k1/k2/k3).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from megatron_rlhf.config import KL_CONTROLLERS, KL_ESTIMATORS, LOSS_AGGREGATIONS  # noqa: F401  (choices: one list)


# ----------------------------------------------------------------------------- masked statistics


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    # where() rather than x * mask alone: a NaN/inf in a padded slot must not poison a sum.
    return torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over tokens with mask 1. x, mask: [B, T] -> 0-dim tensor."""
    return _masked(x * mask, mask).sum() / mask.sum().clamp(min=1.0)


def masked_moments(x: Tensor, mask: Tensor, reduce=None) -> tuple[Tensor, Tensor, Tensor]:
    """(count, mean, unbiased variance) of x over tokens with mask 1, 0-dim float64 tensors.

    Two passes, mean first, then squared deviations from it: E[x^2] - mean^2 (in float32 above
    all) turns constant x into a negative variance or a huge spurious one. `reduce` sums a
    tensor over every part of a batch that is spread out (the trainer passes the data-parallel
    sum: parallel/collectives.masked_moments); None: this batch alone."""
    reduce = reduce or (lambda t: t)
    x64 = _masked(x.to(torch.float64), mask)
    first = reduce(torch.stack([(mask != 0).sum().to(torch.float64), x64.sum()]))
    count, mean = first[0], first[1] / first[0].clamp(min=1.0)
    deviation = _masked(x64 - mean, mask)
    # Bessel's correction is undefined for a single token; its biased variance (0) is kept.
    return count, mean, reduce((deviation * deviation).sum()) / (count - 1).clamp(min=1.0)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of x over tokens with mask 1 (masked_moments). [B, T] -> 0-dim float64."""
    count, _, var = masked_moments(x, mask)
    return var if unbiased else var * (count - 1).clamp(min=0.0) / count.clamp(min=1.0)


def whiten(x: Tensor, mask: Tensor, mean: Tensor, var: Tensor, shift_mean: bool = True) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) given the moments (of the global batch, when the caller
    reduced them over data-parallel ranks); padded positions are 0. [B, T] -> [B, T] in x's dtype.

    shift_mean=False adds the mean back (TRL's choice for rewards: rescale, keep the sign)."""
    x64 = x.to(torch.float64)
    whitened = (x64 - mean) * torch.rsqrt(var.clamp(min=0.0) + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return _masked(whitened, mask).to(x.dtype)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """`whiten` with the moments of this batch alone."""
    _, mean, var = masked_moments(x, mask)
    return whiten(x, mask, mean, var, shift_mean)


# ----------------------------------------------------------------------------- KL and rewards


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str, clip: float | None = None) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi, clamped to [-clip, clip] so
    that one tail token cannot dominate the reward, the whitening or the KL controller. [B, T].

    With log_ratio = log pi(a) - log pi_ref(a):
      k1 = log_ratio                          unbiased, can be negative per token
      k2 = 0.5 * log_ratio**2                 biased, non-negative, low variance
      k3 = exp(-log_ratio) - 1 + log_ratio    unbiased and non-negative ((r - 1) - log r, r = pi_ref/pi)

    In the reward (no gradient through the estimate) only k1 gives an unbiased policy
    gradient of KL(pi || pi_ref): k2 and k3 depend on pi themselves, which a reward ignores.
    In the loss (gradient through log pi, samples from pi_old = pi) the expected gradients are
      k1: E_pi[grad log pi] = 0            no regularisation at all (config refuses it),
      k2: grad KL(pi || pi_ref)             the KL we mean,
      k3: grad KL(pi_ref || pi)             the reverse KL: GRPO's convention.
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio**2
    elif estimator == "k3":
        kl = torch.exp(-log_ratio) - 1.0 + log_ratio
    else:
        raise ValueError(f"ppo.kl_estimator must be one of {', '.join(KL_ESTIMATORS)}; got {estimator!r}")
    return kl if clip is None else kl.clamp(-clip, clip)


def token_rewards(kl: Tensor, scores: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """Per-token rewards r_t = -kl_coef * kl_t, plus the sequence score on the last valid token.

    kl, mask: [B, T]; scores: [B] -> [B, T], zero where mask is 0. Assumes right padding, so the
    last valid token of row b is at index mask[b].sum() - 1. Pass kl = zeros for KL-in-loss mode.
    """
    rewards = _masked(-kl_coef * kl, mask)
    lengths = mask.sum(dim=1).long()
    last = (lengths - 1).clamp(min=0).unsqueeze(1)
    # An all-padding row has no token to carry its score, so it gets none.
    score = torch.where(lengths > 0, scores.to(rewards.dtype), torch.zeros_like(rewards[:, 0]))
    return rewards.scatter_add(1, last, score.unsqueeze(1))


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over response tokens. All [B, T] -> (advantages, returns).

    delta_t = r_t + gamma * V_{t+1} - V_t,  A_t = delta_t + gamma * lam * A_{t+1},
    with V and A after the last valid token = 0 (the episode ends with the response).
    returns = A + V on valid tokens. Both outputs are 0 where mask is 0. No gradient flows.
    """
    T = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_adv = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        valid = mask[:, t] != 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(valid, adv, torch.zeros_like(adv))
        # A padded slot is skipped, not bootstrapped: the carry passes through it unchanged, so
        # behind right padding the last real token still sees V = 0 and A = 0 after it.
        next_value = torch.where(valid, values[:, t], next_value)
        next_adv = torch.where(valid, adv, next_adv)
    returns = torch.where(mask != 0, advantages + values, torch.zeros_like(values))
    return advantages, returns


# ----------------------------------------------------------------------------- losses (per token)


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, clip_eps: float) -> tuple[Tensor, Tensor]:
    """Clipped surrogate -min(rho * A, clip(rho, 1-eps, 1+eps) * A) per token, and where the
    clipped term was the active one (its gradient is cut to zero). [B, T] -> ([B, T], [B, T] bool)."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    # max of the negated terms = the pessimistic (lower) bound of the objective.
    return torch.maximum(unclipped, clipped), (clipped > unclipped).detach()


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
      token_mean            every token weighs the same (unit: token);
      seq_mean_token_mean   every sequence weighs the same, its tokens averaged (unit: sequence);
      seq_mean_token_sum    every sequence weighs the same, its tokens summed (unit: sequence).
    Rows without a valid token are not units."""
    masked = _masked(x * mask, mask)
    if mode == "token_mean":
        return masked.sum(), (mask != 0).sum().to(torch.int32)
    tokens = (mask != 0).sum(dim=1)
    per_sequence = masked.sum(dim=1)
    if mode == "seq_mean_token_mean":
        per_sequence = per_sequence / tokens.clamp(min=1)
    elif mode != "seq_mean_token_sum":
        raise ValueError(f"ppo.loss_aggregation must be one of {', '.join(LOSS_AGGREGATIONS)}; got {mode!r}")
    return per_sequence.sum(), (tokens > 0).sum().to(torch.int32)


# ----------------------------------------------------------------------------- diagnostics


@torch.no_grad()
def explained_variance(var_residual: Tensor, var_returns: Tensor) -> Tensor:
    """1 - Var[returns - values] / Var[returns] (variances of the same tokens); NaN when
    Var[returns] is 0. 0-dim tensors in, 0-dim tensor out (no host sync)."""
    return torch.where(var_returns > 0, 1.0 - var_residual / var_returns.clamp(min=1e-30),
                       torch.full_like(var_returns, float("nan")))


def response_repetition_rate(tokens: list[list[int]]) -> float:
    """Mean over responses of 1 - distinct_bigrams / total_bigrams (a degeneration signal).

    Responses with fewer than 2 tokens count 0; an empty list gives 0.0."""
    if not tokens:
        return 0.0
    rates = []
    for seq in tokens:
        bigrams = list(zip(seq, seq[1:]))
        rates.append(1.0 - len(set(bigrams)) / len(bigrams) if bigrams else 0.0)
    return sum(rates) / len(rates)


# ----------------------------------------------------------------------------- KL controllers


class FixedKLController:
    """Constant KL coefficient (the controller interface with a no-op update)."""

    def __init__(self, value: float) -> None:
        self.value = float(value)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. 2019 proportional controller steering the observed KL towards ``target``.

    e = clip(KL / target - 1, -0.2, 0.2);  value *= 1 + e * n_steps / horizon,
    where n_steps is the number of samples (episodes) the KL was measured on.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL controller needs target > 0 and horizon > 0; got {target}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale the coefficient up when KL is above target, down when below (bounded step)."""
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        # Only the evolving coefficient is state; target and horizon come from the config.
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


def make_kl_controller(
    kind: str, init_kl_coef: float, target: float, horizon: float
) -> FixedKLController | AdaptiveKLController:
    """Build the KL controller named by ``ppo.kl_controller`` ("fixed" | "adaptive")."""
    if kind == "fixed":
        return FixedKLController(init_kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(init_kl_coef, target, horizon)
    raise ValueError(f"ppo.kl_controller must be one of {', '.join(KL_CONTROLLERS)}; got {kind!r}")
