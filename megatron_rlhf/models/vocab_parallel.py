"""Per-token log-probs and entropy from vocab-parallel logits, without gathering them.

Each TP rank holds logits for a slice of the vocabulary ([s, b, V/TP]). Log-probs use
megatron-core's fused vocab-parallel cross-entropy; entropy needs two sums over the whole
vocabulary, reduced with megatron's forward-all-reduce/backward-identity mapping (the loss
downstream is replicated on every TP rank, so the incoming gradient already is too).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

_PADDED_LOGIT = -1e9  # finite, so exp() gives exactly 0 and 0 * logit stays 0


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Padding rows of the embedding are not tokens: give them zero probability."""
    shard = logits.size(-1)
    start = parallel_state.get_tensor_model_parallel_rank() * shard
    if start + shard <= vocab_size:
        return logits
    ids = torch.arange(start, start + shard, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, _PADDED_LOGIT)


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H = logZ - sum_v p_v z_v over the full vocabulary; logits [..., V/TP] -> [...]."""
    local_max = logits.detach().max(dim=-1, keepdim=True).values
    torch.distributed.all_reduce(
        local_max, op=torch.distributed.ReduceOp.MAX,
        group=parallel_state.get_tensor_model_parallel_group(),
    )
    shifted = logits - local_max
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    sum_exp_z = reduce_from_tensor_model_parallel_region((exp * shifted).sum(dim=-1))
    return sum_exp.log() - sum_exp_z / sum_exp


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target); logits [s, b, V/TP], targets [s, b] -> [s, b].

    megatron's cross-entropy subtracts the max in place, so it gets its own copy.
    """
    return -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), targets)
