"""Splitting a global batch over data-parallel ranks and running a role on a batch of any size."""

from __future__ import annotations

import torch


def data_parallel() -> tuple[int, int]:
    """(this rank's data-parallel index, the data-parallel size)."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def dp_slice(items: list, rank: int, size: int) -> list:
    """This data-parallel rank's contiguous share of a global batch."""
    per_rank = len(items) // size
    return items[rank * per_rank : (rank + 1) * per_rank]


def padded_forward(role, batch: dict[str, torch.Tensor], micro_batch_size: int) -> dict[str, torch.Tensor]:
    """role.forward on a batch whose size need not be a multiple of the microbatch size."""
    rows = batch["tokens"].size(0)
    extra = -rows % micro_batch_size
    if extra:
        batch = {k: torch.cat([v, v[-1:].expand(extra, *v.shape[1:])]) for k, v in batch.items()}
    return {k: v[:rows] for k, v in role.forward(batch, micro_batch_size).items()}
