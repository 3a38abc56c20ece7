"""PPO-RLHF math as pure tensor functions (torch only), one formula per function.

Conventions shared by every function below:
  * per-token tensors are [B, T] float32 over the *response* positions, already sliced and
    aligned by the caller: position t holds the log-prob / value / reward of response token t;
  * ``mask`` is [B, T] float, 1 for a real response token and 0 for padding (right padding);
  * "mean over tokens" is the masked mean sum(x * mask) / max(sum(mask), 1) over the whole
    batch (token-level averaging, not per-sequence);
  * ``logprobs``, ``old_logprobs``, ``ref_logprobs`` are log-probs of the *sampled* tokens.

References: Ziegler et al. 2019 (adaptive KL, per-token KL reward), Schulman et al. 2017 (PPO
clipping), Schulman et al. 2016 (GAE), J. Schulman "Approximating KL divergence" (k1/k2/k3).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")
KL_CONTROLLERS = ("fixed", "adaptive")


# ----------------------------------------------------------------------------- masked statistics


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over tokens with mask 1. x, mask: [B, T] -> 0-dim tensor."""
    # where() rather than x * mask alone: a NaN/inf in a padded slot must not poison the sum.
    total = torch.where(mask != 0, x * mask, torch.zeros_like(x)).sum()
    return total / mask.sum().clamp(min=1.0)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of x over tokens with mask 1. x, mask: [B, T] -> 0-dim tensor."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        # Bessel's correction is undefined for a single token; its biased variance (0) is kept.
        var = var * torch.where(n > 1, n / (n - 1).clamp(min=1.0), torch.ones_like(n))
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) over valid tokens; padded positions are 0. [B, T] -> [B, T].

    shift_mean=False adds the mean back (TRL's choice for rewards: rescale, keep the sign)."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask != 0, whitened, torch.zeros_like(whitened))


# ----------------------------------------------------------------------------- KL and rewards


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi. [B, T] -> [B, T].

    With log_ratio = log pi(a) - log pi_ref(a):
      k1 = log_ratio                          unbiased, can be negative per token
      k2 = 0.5 * log_ratio**2                 biased, non-negative, low variance
      k3 = exp(-log_ratio) - 1 + log_ratio    unbiased and non-negative ((r - 1) - log r, r = pi_ref/pi)
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"ppo.kl_estimator must be one of {', '.join(KL_ESTIMATORS)}; got {estimator!r}")


def token_rewards(kl: Tensor, scores: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """Per-token rewards r_t = -kl_coef * kl_t, plus the sequence score on the last valid token.

    kl, mask: [B, T]; scores: [B] -> [B, T], zero where mask is 0. Assumes right padding, so the
    last valid token of row b is at index mask[b].sum() - 1. Pass kl = zeros for KL-in-loss mode.
    """
    rewards = torch.where(mask != 0, -kl_coef * kl, torch.zeros_like(kl))
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


# ----------------------------------------------------------------------------- losses


def policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_eps: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate loss -min(rho * A, clip(rho, 1-eps, 1+eps) * A), masked mean. [B, T] inputs.

    Returns (0-dim loss, stats of detached 0-dim tensors: clip_fraction, approx_kl, ratio_mean).
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    # max of the negated terms = the pessimistic (lower) bound of the objective.
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        stats = {
            # Tokens where clipping was active, i.e. whose gradient is cut to zero.
            "clip_fraction": masked_mean((clipped > unclipped).float(), mask),
            "approx_kl": masked_mean(0.5 * log_ratio**2, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_range: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss 0.5 * masked_mean(max((V - R)^2, (V_clip - R)^2)). [B, T] inputs.

    V_clip = V_old + clamp(V - V_old, -c, c). Returns (0-dim loss, {"value_clip_fraction"}).
    """
    clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    err_unclipped = (values - returns) ** 2
    err_clipped = (clipped - returns) ** 2
    # The larger error is taken so that moving V far from V_old can never lower the loss.
    loss = 0.5 * masked_mean(torch.maximum(err_unclipped, err_clipped), mask)
    with torch.no_grad():
        stats = {"value_clip_fraction": masked_mean((err_clipped > err_unclipped).float(), mask)}
    return loss, stats


def entropy_bonus(entropy: Tensor, mask: Tensor) -> Tensor:
    """Masked mean of per-token policy entropy. [B, T] -> 0-dim. The caller subtracts c2 * it."""
    return masked_mean(entropy, mask)


def kl_penalty_loss(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str) -> Tensor:
    """Masked mean of kl_estimate, for KL-in-loss mode (differentiable in logprobs). [B, T] -> 0-dim."""
    return masked_mean(kl_estimate(logprobs, ref_logprobs, estimator), mask)


# ----------------------------------------------------------------------------- diagnostics


@torch.no_grad()
def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var[returns - values] / Var[returns] over valid tokens; nan if Var[returns] == 0. [B, T]."""
    var_returns = masked_var(returns, mask, unbiased=False)
    if var_returns.item() == 0.0:
        return float("nan")
    return 1.0 - (masked_var(returns - values, mask, unbiased=False) / var_returns).item()


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
