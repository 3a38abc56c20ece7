"""Context parallelism (parallel.context_parallel): what megatron-core's CP leaves to its caller.

megatron-core splits attention over the CP ranks (Transformer Engine's attention, GPU only),
applies RoPE to each rank's share of the positions, and reduces gradients over the data x
context ranks. Its caller feeds each rank its share of every sequence and gets per-token
results back whole. That part is here:

- **The share** is megatron's load-balanced split: a sequence cut into 2 x CP equal chunks,
  rank r holding chunks r and 2 x CP - 1 - r (causal attention's work is then equal on every
  rank). Unpacked rows are split as one sequence per row (megatron.core.utils:
  get_batch_on_this_cp_rank); packed rows (THD) sequence by sequence, each padded to a multiple
  of 2 x CP (megatron calls TE's thd_get_partitioned_indices, a CUDA kernel; `partitioned_index`
  is the same split in torch, for CPU and for checking TE's on a GPU run).
- **Targets before the split**: a token's next token may sit on another rank, so the per-token
  targets and their validity are computed on the whole sequence and split with the tokens.
- **Results gathered whole** (`gather_sequence`): each rank's per-token outputs (log-probs,
  entropy, values) are all-gathered over the CP group and put back in sequence order; no rank
  ever holds logits beyond its own tokens. Every CP rank then computes the same loss from the
  whole sequence. The gather's backward keeps this rank's columns only, so megatron's sum of
  gradients over the CP ranks counts each token once; and the loss units reach megatron from
  CP rank 0 only (`units_share`), so its per-token divisor, summed over data x context ranks,
  counts them once too. The objective is the CP=1 objective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

Batch = dict[str, torch.Tensor]

# The microbatch keys the model reads (on each rank, its share) and the whole-sequence keys the
# share is split from. Everything else in a microbatch stays whole: loss functions read it.
SHARE_KEY = "cp_share"


def size() -> int:
    """CP ranks in this run (1 before megatron's parallel state exists)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_context_parallel_world_size()


def column_multiple(cp: int, tp: int, sequence_parallel: bool) -> int:
    """What every sequence's length is padded to a multiple of: 2 x CP chunks per sequence, each
    rank's share split again over the TP ranks under sequence parallelism."""
    return (2 * cp if cp > 1 else 1) * (tp if sequence_parallel else 1)


def partitioned_index(cu_seqlens: torch.Tensor, total: int, cp: int, rank: int) -> torch.Tensor:
    """The columns CP rank `rank` of `cp` holds, in order, of a row of `total` tokens made of the
    sequences with boundaries `cu_seqlens` [n + 1] (0 first, `total` last; each length a
    multiple of 2 x cp): from each sequence in turn its chunk `rank` then its chunk
    2 x cp - 1 - rank, of 2 x cp equal chunks. One sequence (cu_seqlens = [0, total]) is
    megatron's split of an unpacked row; several are TE's thd_get_partitioned_indices.
    Computed on cu_seqlens' device without a host read: the share's size is total / cp."""
    position = torch.arange(total, device=cu_seqlens.device)
    bounds = cu_seqlens.to(position.dtype)
    sequence = torch.searchsorted(bounds, position, right=True) - 1
    start, length = bounds[sequence], bounds[sequence + 1] - bounds[sequence]
    chunk = (position - start) * (2 * cp) // length.clamp(min=1)  # which of the sequence's 2 x cp chunks
    mine = (chunk == rank) | (chunk == 2 * cp - 1 - rank)
    # the positions of `mine`, ascending (a stable sort keeps the order): the chunks in sequence order
    return torch.argsort((~mine).to(torch.int8), stable=True)[: total // cp]


@dataclass(frozen=True)
class Share:
    """Which columns of a microbatch's model row this CP rank holds (`index`), and every rank's
    columns in rank order (`order`, a permutation of the row's columns) to put gathered results
    back in place."""

    index: torch.Tensor
    order: torch.Tensor
    cp: int


def share_of(cu_seqlens: torch.Tensor, total: int, cp: int, rank: int) -> Share:
    """This rank's Share of a row (see partitioned_index)."""
    indices = [partitioned_index(cu_seqlens, total, cp, r) for r in range(cp)]
    return Share(index=indices[rank], order=torch.cat(indices), cp=cp)


class _GatherSequence(torch.autograd.Function):
    """All-gather each CP rank's columns of `local` along `dim` and put them in place; backward:
    this rank's columns of the gradient (every rank computes the same loss from the gather)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, dim: int, share: Share, group) -> torch.Tensor:
        ctx.dim, ctx.index = dim, share.index
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(share.cp)]
        dist.all_gather(parts, local, group=group)
        gathered = torch.cat(parts, dim=dim)
        return torch.empty_like(gathered).index_copy_(dim, share.order, gathered)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.index_select(ctx.dim, ctx.index), None, None, None


def gather_sequence(local: torch.Tensor, dim: int, share: Share, group=None) -> torch.Tensor:
    """Per-token `local` (this rank's columns along `dim`) -> the whole row's, in column order,
    on every CP rank (`group`: default megatron's CP group). Differentiable (see _GatherSequence)."""
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
    return _GatherSequence.apply(local, dim, share, group)


def units_share(units: torch.Tensor, rank: int) -> torch.Tensor:
    """The loss units this CP rank reports to megatron: all on rank 0, none elsewhere (megatron
    sums them over data x context ranks; every CP rank counted the same whole-sequence units)."""
    return units if rank == 0 else torch.zeros_like(units)


def split_microbatch(mb: Batch, model_keys: dict[str, str], cu_seqlens: torch.Tensor, cp: int, rank: int,
                     use_megatron: bool = True) -> Batch:
    """`mb` plus, for each `model_keys` entry whole-row key -> share key, this rank's columns of
    that [b, T] tensor, and its Share (SHARE_KEY). Unpacked rows (one sequence per row,
    cu_seqlens = [0, T]) are split by megatron's get_batch_on_this_cp_rank where its process
    groups exist (`use_megatron`); packed rows by partitioned_index (TE's kernel computes the
    same on GPU: `make gpu-check` compares them)."""
    total = next(iter(mb[k] for k in model_keys)).size(1)
    if total % (2 * cp):
        raise ValueError(f"a row of {total} tokens cannot be split into 2 x context_parallel={2 * cp} equal chunks; "
                         "pad it to a multiple first (models/microbatches.py)")
    share = share_of(cu_seqlens, total, cp, rank)
    if use_megatron and cu_seqlens.numel() == 2:
        from megatron.core import parallel_state
        from megatron.core.utils import get_batch_on_this_cp_rank

        split = get_batch_on_this_cp_rank({k: mb[k] for k in model_keys}, is_hybrid_cp=False,
                                          cp_group=parallel_state.get_context_parallel_group())
        parts = {model_keys[k]: v for k, v in split.items()}
    else:
        parts = {new: mb[old].index_select(1, share.index) for old, new in model_keys.items()}
    return {**mb, **parts, SHARE_KEY: share}
