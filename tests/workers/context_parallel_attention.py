"""A reference core attention with context parallelism, for the CPU tests only.

Context parallelism is Transformer Engine's (GPU); megatron's local attention has none, so a CPU
run with parallel.context_parallel > 1 is refused (models/gpt.py). To check everything around
the attention on CPU (the load-balanced split of rows and of packed sequences, RoPE on each
rank's positions, the targets computed before the split, the gathered outputs, the loss units,
the gradient reduction over data x context ranks, checkpoints), the tests set this module as
models.gpt.cpu_context_parallel_attention: each rank all-gathers the keys and values of the
whole row over the CP group and attends its own queries to them under the mask their global
positions give (causal; within the same packed sequence). The simplest correct CP (TE's
`all_gather` flavour without its overlap), exact to float rounding: not a production path.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_rlhf.models.attention import SDPADotProductAttention
from megatron_rlhf.parallel.context import share_of


class _AllGatherSummingGrads(torch.autograd.Function):
    """All-gather over `group` along dim 0; every rank's loss reads every rank's part, so the
    backward sums the gradient over the ranks and keeps this rank's part (gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.rows = group, dist.get_rank(group), local.size(0)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows], None


class ContextParallelSDPA(SDPADotProductAttention):
    """SDPADotProductAttention over the whole row's keys (see the module docstring)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
        self.cp = config.context_parallel_size
        one_rank = copy.copy(config)  # megatron's local attention asserts context_parallel_size == 1
        one_rank.context_parallel_size = 1
        super().__init__(one_rank, layer_number, attn_mask_type, attention_type, **kwargs)
        assert self.window_size is None, "the reference CP attention has no sliding window"

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        assert attention_mask is None and attention_bias is None and self.causal
        group = parallel_state.get_context_parallel_group()
        rank = parallel_state.get_context_parallel_rank()
        total = query.size(0) * self.cp
        if packed_seq_params is not None:  # THD: [t, heads, d]; sequences' rooms in cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = cu if cu is not None else packed_seq_params.cu_seqlens_q
        else:  # [s, b, heads, d]: each row is one sequence
            cu = torch.tensor([0, total], device=query.device)
        share = share_of(cu, total, self.cp, rank)
        key, value = (_AllGatherSummingGrads.apply(t, group) for t in (key, value))
        mine, keys = share.index, share.order  # the global columns of the queries and of the keys
        sequence = torch.searchsorted(cu[1:].to(mine.dtype), torch.cat([mine, keys]), right=True)
        visible = (keys[None, :] <= mine[:, None]) & (sequence[:mine.numel(), None] == sequence[None, mine.numel():])
        if packed_seq_params is not None:
            q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
            context = self._attend(q, k, v, visible, False)
            return context.squeeze(0).transpose(0, 1).reshape(query.size(0), 1, self.hidden_size_per_partition)
        context = self._attend(*(t.permute(1, 2, 0, 3) for t in (query, key, value)), visible, False)
        return context.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), self.hidden_size_per_partition)
