"""Masked statistics over response tokens (torch only): means, two-pass moments, whitening,
and the diagnostics the RL stage logs.

Per-token tensors are [B, T] over response positions with a float `mask` (1 real token, 0
padding). Every statistic that must cover the global batch takes a `reduce` hook that sums a
tensor over the parts of the batch held elsewhere (the trainer passes the data-parallel sum,
parallel/collectives.py); None means this batch alone.
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked(x: Tensor, mask: Tensor) -> Tensor:
    # where() rather than x * mask alone: a NaN/inf in a padded slot must not poison a sum.
    return torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over tokens with mask 1. x, mask: [B, T] -> 0-dim tensor."""
    return masked(x * mask, mask).sum() / mask.sum().clamp(min=1.0)


def masked_moments(x: Tensor, mask: Tensor, reduce=None) -> tuple[Tensor, Tensor, Tensor]:
    """(count, mean, unbiased variance) of x over tokens with mask 1, 0-dim float64 tensors.

    Two passes, mean first, then squared deviations from it: E[x^2] - mean^2 (in float32 above
    all) turns constant x into a negative variance or a huge spurious one."""
    reduce = reduce or (lambda t: t)
    x64 = masked(x.to(torch.float64), mask)
    first = reduce(torch.stack([(mask != 0).sum().to(torch.float64), x64.sum()]))
    count, mean = first[0], first[1] / first[0].clamp(min=1.0)
    deviation = masked(x64 - mean, mask)
    # Bessel's correction is undefined for a single token; its biased variance (0) is kept.
    return count, mean, reduce((deviation * deviation).sum()) / (count - 1).clamp(min=1.0)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of x over tokens with mask 1 (masked_moments). [B, T] -> 0-dim float64."""
    count, _, var = masked_moments(x, mask)
    return var if unbiased else var * (count - 1).clamp(min=0.0) / count.clamp(min=1.0)


def whiten(x: Tensor, mask: Tensor, mean: Tensor, var: Tensor, shift_mean: bool = True) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) given the moments; padded positions are 0. [B, T] -> [B, T]
    in x's dtype. shift_mean=False adds the mean back (TRL's choice for rewards)."""
    x64 = x.to(torch.float64)
    whitened = (x64 - mean) * torch.rsqrt(var.clamp(min=0.0) + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return masked(whitened, mask).to(x.dtype)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, reduce=None) -> Tensor:
    """`whiten` with the moments of the (global, given `reduce`) batch."""
    _, mean, var = masked_moments(x, mask, reduce)
    return whiten(x, mask, mean, var, shift_mean)


@torch.no_grad()
def token_sums(mask: Tensor, **per_token: Tensor) -> dict[str, Tensor]:
    """Diagnostics of one microbatch as sums over its tokens, and their count under "tokens":
    the trainer reports each as a token mean over the global batch (models/roles.py: LossFn),
    whatever unit rl.loss_aggregation gives the loss. [B, T] each -> 0-dim tensors."""
    sums = {name: masked(x * mask, mask).sum() for name, x in per_token.items()}
    return {**sums, "tokens": (mask != 0).sum().to(torch.int32)}


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
