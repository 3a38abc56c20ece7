"""Direct preference optimisation: the losses of one batch of preference pairs, in one place.

For a pair (chosen c, rejected r) with policy and reference log-probabilities of the response
tokens, the implicit reward of a response is beta x its log-ratio log pi(y|x) - log ref(y|x):

    sigmoid (DPO, Rafailov et al. 2023), log-ratios summed over the response tokens:
        h = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r))
        loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
        (eps = label_smoothing: conservative DPO, the label is flipped with probability eps)
    ipo (Azar et al. 2023; TRL's IPO), log-ratios averaged over the response tokens:
        h = mean_t (log pi(c_t) - log ref(c_t)) - mean_t (log pi(r_t) - log ref(r_t))
        loss = (h - 1 / (2 beta))^2
    plus, optionally, sft_weight x the chosen response's mean token NLL (RPO-style).

Every loss is per pair; the trainer sums it over its microbatch and megatron divides by the
pairs of the global batch (models/roles.py: LossFn), so no split changes the objective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_rlhf.config import DPO_LOSSES


@dataclass(frozen=True)
class PairLogps:
    """Per pair ([P] each): summed response log-probs of chosen and rejected under a model,
    and each side's response token count (the same for policy and reference)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    def log_ratios(self, reference: "PairLogps", average: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) log pi - log ref, summed over the response tokens or (average)
        divided by their count."""
        chosen, rejected = self.chosen - reference.chosen, self.rejected - reference.rejected
        if average:
            chosen, rejected = chosen / self.chosen_tokens.clamp(min=1), rejected / self.rejected_tokens.clamp(min=1)
        return chosen, rejected


def sequence_logps(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, S] per-token log-probs (position t scores token t+1) and the response mask ->
    ([N] summed response log-probs, [N] response token counts), on the log-probs' device."""
    mask = loss_mask.to(logprobs.device, logprobs.dtype)
    return (logprobs * mask).sum(-1), mask.sum(-1)


def pair_logps(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> PairLogps:
    """Rows alternate chosen, rejected (data/encode.py: collate_preferences)."""
    sums, counts = sequence_logps(logprobs, loss_mask)
    return PairLogps(sums[0::2], sums[1::2], counts[0::2], counts[1::2])


def dpo_loss(policy: PairLogps, reference: PairLogps, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, sft_weight: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """([P] loss per pair, {statistic: [P] per pair}): the implicit rewards beta x log-ratio
    (summed for sigmoid, averaged for ipo, as the loss uses them), their margin, whether the
    chosen one is higher (a tie counts half, as in the RL stage's win rates: at the start the
    policy is the reference, every pair ties, and the accuracy is 0.5, not 0), and the
    policy's summed log-probs."""
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"dpo.loss={loss_type!r}: choose one of {DPO_LOSSES}")
    chosen_ratio, rejected_ratio = policy.log_ratios(reference, average=loss_type == "ipo")
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    else:
        losses = (h - 1 / (2 * beta)) ** 2
    stats = {"preference_loss": losses.detach()}
    if sft_weight:
        nll = -policy.chosen / policy.chosen_tokens.clamp(min=1)
        losses = losses + sft_weight * nll
        stats["sft_nll"] = nll.detach()
    chosen_reward, rejected_reward = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    stats.update(chosen_reward=chosen_reward, rejected_reward=rejected_reward, margin=chosen_reward - rejected_reward,
                 reward_accuracy=(chosen_reward > rejected_reward).to(losses.dtype)
                 + 0.5 * (chosen_reward == rejected_reward).to(losses.dtype),
                 logp_chosen=policy.chosen.detach(), logp_rejected=policy.rejected.detach())
    return losses, stats
