"""The KL penalty to the reference policy: per-token estimators and the coefficient's
controllers (torch only).

References: J. Schulman, "Approximating KL divergence" (k1/k2/k3); Ziegler et al. 2019
(adaptive controller).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
import torch

from megatron_rlhf.config import KL_CONTROLLERS, KL_ESTIMATORS


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
        raise ValueError(f"rl.kl_estimator must be one of {', '.join(KL_ESTIMATORS)}; got {estimator!r}")
    return kl if clip is None else kl.clamp(-clip, clip)


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
