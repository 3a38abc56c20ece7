"""Splitting a global batch over data-parallel ranks and running a role on a batch of any size."""

from __future__ import annotations

import torch

from megatron_rlhf.models.microbatches import microbatch_rows


def data_parallel() -> tuple[int, int]:
    """(this rank's data-parallel index, the data-parallel size)."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def dp_slice(items: list, rank: int, size: int) -> list:
    """This data-parallel rank's contiguous share of a global batch."""
    per_rank = len(items) // size
    return items[rank * per_rank : (rank + 1) * per_rank]


def by_length(lengths: torch.Tensor) -> torch.Tensor:
    """Row order, longest first (stable): consecutive rows, hence each microbatch, have similar
    lengths, so the padding that Role._run trims away is most of the padding there is."""
    return torch.argsort(lengths, descending=True, stable=True)


def padded_forward(role, batch: dict[str, torch.Tensor], micro_batch_size: int,
                   token_budget: int = 0, **options) -> dict[str, torch.Tensor]:
    """role.forward on a batch whose size need not be a multiple of the microbatch size; rows
    with `lengths` run sorted by length (microbatches of `token_budget` tokens if given) and
    come back in their own order. `options`: role.forward's own."""
    rows = batch["tokens"].size(0)
    order = by_length(batch["lengths"]) if "lengths" in batch else None
    if order is not None:
        batch = {k: v[order] for k, v in batch.items()}
    else:
        token_budget = 0
    extra = 0 if token_budget else -rows % micro_batch_size
    if extra:
        batch = {k: torch.cat([v, v[-1:].expand(extra, *v.shape[1:])]) for k, v in batch.items()}
    out = {k: v[:rows] for k, v in role.forward(batch, micro_batch_size, token_budget, **options).items()}
    if order is not None:
        inverse = torch.argsort(order)
        out = {k: v[inverse.to(v.device)] for k, v in out.items()}
    return out


def padding_sums(lengths: torch.Tensor, width: int, micro_batch_size: int, token_budget: int = 0,
                 packed: bool = False) -> dict[str, torch.Tensor]:
    """Token slots of a batch of `lengths` [B] (device): its real tokens, the slots at the
    batch's width, and the slots its microbatches compute (Role._run): sorted by length, split
    by `micro_batch_size` rows or `token_budget` tokens, each cut to its longest row; `packed`
    (rl.packing): rows back to back, so their real tokens alone (plus at most TP - 1 slots per
    microbatch under sequence parallelism, not counted here)."""
    ordered = lengths[by_length(lengths)]
    if packed:
        slots = lengths.sum()
    elif token_budget:  # the split itself reads the lengths on the host too (split_microbatches)
        host, slots, start = ordered.tolist(), 0, 0
        for rows in microbatch_rows(host, micro_batch_size, token_budget):
            slots, start = slots + rows * host[start], start + rows  # longest first: its first row
        slots = torch.tensor(slots, device=lengths.device)
    else:  # padded_forward's repeated last rows complete the last microbatch
        extra = -ordered.numel() % micro_batch_size
        micro = torch.cat([ordered, ordered.new_zeros(extra)]).view(-1, micro_batch_size)
        slots = (micro.max(dim=1).values * micro.size(1)).sum()
    return {"real_tokens": lengths.sum(), "batch_slots": torch.tensor(lengths.numel() * width, device=lengths.device),
            "microbatch_slots": slots}
