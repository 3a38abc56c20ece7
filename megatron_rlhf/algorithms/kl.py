"""The KL penalty to the reference policy: per-token estimators and the coefficient's
controllers (torch only).

References: J. Schulman, "Approximating KL divergence" (k1/k2/k3); Ziegler et al. 2019
(adaptive controller).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from torch import Tensor
import torch

from megatron_rlhf.algorithms.stats import masked
from megatron_rlhf.config import KL_CONTROLLERS, KL_ESTIMATORS


def estimator_of(log_ratio: Tensor, estimator: str) -> Tensor:
    """The estimator named by rl.kl_estimator as a function of log_ratio = log pi(a) - log pi_ref(a):
      k1 = log_ratio                          unbiased, can be negative per token
      k2 = 0.5 * log_ratio**2                 biased, non-negative, low variance
      k3 = exp(-log_ratio) - 1 + log_ratio    unbiased and non-negative ((r - 1) - log r, r = pi_ref/pi)
    """
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"rl.kl_estimator must be one of {', '.join(KL_ESTIMATORS)}; got {estimator!r}")


def masked_log_ratio(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor | None) -> Tensor:
    # Zero off the response before any exp: the actor's log-probs are not masked there while the
    # reference's are 0, so k3 at a prompt token with log p < -88.7 is exp(88.7+) = inf in fp32;
    # its forward value is masked away later, but backward computes 0 * inf = NaN.
    log_ratio = logprobs - ref_logprobs
    return log_ratio if mask is None else masked(log_ratio, mask)


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str, clip: float | None = None,
                mask: Tensor | None = None) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (`estimator_of`), clamped to
    [-clip, clip] so that one tail token cannot dominate the reward, the whitening or the KL
    controller; 0 where `mask` is 0. [B, T]. The clamp has no gradient beyond the bound: for the
    reward and metrics (no gradient through them); the loss uses `kl_loss_estimate`.

    In the reward (no gradient through the estimate) only k1 gives an unbiased policy
    gradient of KL(pi || pi_ref): k2 and k3 depend on pi themselves, which a reward ignores.
    In the loss (gradient through log pi, samples from pi_old = pi) the expected gradients are
      k1: E_pi[grad log pi] = 0            no regularisation at all (config refuses it),
      k2: grad KL(pi || pi_ref)             the KL we mean,
      k3: grad KL(pi_ref || pi)             the reverse KL: GRPO's convention.
    """
    kl = estimator_of(masked_log_ratio(logprobs, ref_logprobs, mask), estimator)
    return kl if clip is None else kl.clamp(-clip, clip)


def kl_loss_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str, clip: float | None = None,
                     mask: Tensor | None = None) -> Tensor:
    """`kl_estimate` for the loss: the same values, but `clip` bounds the gradient instead of
    removing it. Clamping the estimate would zero the KL gradient of exactly the tokens that
    drifted furthest from the reference; instead the log ratio is clamped to the interval where
    |estimate| <= clip (`log_ratio_bounds`) with its gradient passed straight through, so beyond
    the bounds the estimate stays at clip and its gradient is the estimator's slope at the bound
    (k2: ±sqrt(2 clip); k3: 1 - exp(-bound), -12.6 below and 1.0 above for clip 10). [B, T]."""
    log_ratio = masked_log_ratio(logprobs, ref_logprobs, mask)
    if clip is not None:
        low, high = log_ratio_bounds(estimator, float(clip))
        # value: the clamp exactly (x + (clamp - x).detach() would round off at |x| ~ 1e3); gradient: 1
        log_ratio = log_ratio.clamp(low, high).detach() + (log_ratio - log_ratio.detach())
    return estimator_of(log_ratio, estimator)


@lru_cache(maxsize=None)
def log_ratio_bounds(estimator: str, clip: float) -> tuple[float, float]:
    """(low, high): the log ratios below and above 0 where the estimator reaches clip in absolute
    value. k1: ±clip; k2: ±sqrt(2 clip); k3: the roots of exp(-x) - 1 + x = clip, found by
    bisection (-2.611 and 11.00 for clip 10: pi < pi_ref / 13.6 and pi > 6e4 pi_ref)."""
    def beyond(x: float) -> bool:
        return abs(float(estimator_of(torch.tensor(x, dtype=torch.float64), estimator))) >= clip

    bounds = []
    for side in (-1.0, 1.0):  # every estimator grows monotonically in |x| on each side of 0
        inside, outside = 0.0, side
        while not beyond(outside):
            inside, outside = outside, 2 * outside
        for _ in range(100):
            middle = (inside + outside) / 2
            inside, outside = (inside, middle) if beyond(middle) else (middle, outside)
        bounds.append(inside)
    return bounds[0], bounds[1]


# ----------------------------------------------------------------------------- controllers


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
    """Build the KL controller named by ``rl.kl_controller`` ("fixed" | "adaptive")."""
    if kind == "fixed":
        return FixedKLController(init_kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(init_kl_coef, target, horizon)
    raise ValueError(f"rl.kl_controller must be one of {', '.join(KL_CONTROLLERS)}; got {kind!r}")
