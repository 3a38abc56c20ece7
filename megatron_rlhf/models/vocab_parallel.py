"""Per-token log-probs and entropy from vocab-parallel logits, without gathering them.

Each TP rank holds logits for a slice of the vocabulary ([s, b, V/TP]). Both come from one
softmax in one autograd function that keeps a single logits-sized tensor for backward (the
shifted logits) and recomputes the softmax there: separate log-softmax and entropy graphs keep
three or four, and at a 49k vocabulary the logits are the largest activation there is. The
incoming gradients are replicated on every TP rank (the loss downstream is), so backward needs
no communication: each rank differentiates its own slice.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

_PADDED_LOGIT = -1e9  # finite, so exp() gives exactly 0 and 0 * logit stays 0


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Padding rows of the embedding are not tokens: give them zero probability."""
    shard = logits.size(-1)
    start = parallel_state.get_tensor_model_parallel_rank() * shard
    if start + shard <= vocab_size:
        return logits
    ids = torch.arange(start, start + shard, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, _PADDED_LOGIT)


def _tp_all_reduce(t: torch.Tensor, op=torch.distributed.ReduceOp.SUM) -> torch.Tensor:
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(t, op=op, group=parallel_state.get_tensor_model_parallel_group())
    return t


class _LogprobsAndEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets):
        shard = logits.size(-1)
        local = targets - parallel_state.get_tensor_model_parallel_rank() * shard
        owned = (local >= 0) & (local < shard)
        local = local.clamp(0, shard - 1).unsqueeze(-1)
        shifted = logits - _tp_all_reduce(logits.max(dim=-1, keepdim=True).values, torch.distributed.ReduceOp.MAX)
        log_z = _tp_all_reduce(shifted.exp().sum(dim=-1)).log()
        target = _tp_all_reduce(shifted.gather(-1, local).squeeze(-1) * owned)
        probs = (shifted - log_z.unsqueeze(-1)).exp_()
        entropy = log_z - _tp_all_reduce(probs.mul_(shifted).sum(dim=-1))  # H = log Z - sum_v p_v z_v
        ctx.save_for_backward(shifted, log_z, entropy, local, owned)
        return target - log_z, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        shifted, log_z, entropy, local, owned = ctx.saved_tensors
        log_p = shifted - log_z.unsqueeze(-1)
        p = log_p.exp()
        # d log p_t / dz = onehot_t - p;  dH / dz = -p (log p + H)
        grad = log_p.add_(entropy.unsqueeze(-1)).mul_(p).mul_(-grad_entropy.unsqueeze(-1))
        grad.sub_(p.mul_(grad_logprobs.unsqueeze(-1)))
        grad.scatter_add_(-1, local, (grad_logprobs * owned).unsqueeze(-1))
        return grad, None


def vocab_parallel_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) over the full vocabulary; logits [s, b, V/TP] (float), targets
    [s, b] (global ids) -> two [s, b]."""
    return _LogprobsAndEntropy.apply(logits, targets)
