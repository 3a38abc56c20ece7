"""How a role's batch becomes megatron's microbatches: rows per microbatch (fixed size or a
token budget; at least as many as an expert group agrees on), each cut to its longest row and
padded to a multiple of the TP size under sequence parallelism; and the per-batch counts the
MoE routers' load-balancing scale needs (models/roles.py)."""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate

import torch

Batch = dict[str, torch.Tensor]


def microbatch_rows(lengths: list[int], micro_batch_size: int, token_budget: int = 0) -> list[int]:
    """Rows per microbatch, in order: `micro_batch_size` each, or with a `token_budget` as many
    consecutive rows as fit in it (rows x their longest length, at least one row). Rows sorted
    longest first (models.batching.by_length) waste the least."""
    if not token_budget:
        return [micro_batch_size] * (len(lengths) // micro_batch_size)
    rows, count, longest = [], 0, 0
    for n in lengths:
        if count and (count + 1) * max(longest, n) > token_budget:
            rows.append(count)
            count, longest = 0, 0
        count, longest = count + 1, max(longest, n)
    return rows + [count] if count else rows


def split_rows(rows: list[int], count: int) -> list[int]:
    """`rows` (rows per microbatch) with the largest microbatches halved until there are `count`."""
    rows = list(rows)
    while len(rows) < count:
        i = max(range(len(rows)), key=rows.__getitem__)
        if rows[i] < 2:
            raise ValueError(f"{sum(rows)} rows cannot make {count} microbatches: with expert parallelism every rank "
                             "of an expert group runs as many microbatches as the one with the most; give the "
                             "data-parallel ranks equal shares")
        rows[i:i + 1] = [rows[i] - rows[i] // 2, rows[i] // 2]
    return rows


def split_microbatches(batch: Batch, micro_batch_size: int, token_budget: int = 0, count: int = 0) -> list[Batch]:
    """Consecutive microbatches; by `token_budget` when given and the batch has `lengths`;
    at least `count` of them (the largest halved)."""
    size = batch["tokens"].size(0)
    if token_budget and "lengths" in batch:
        rows = microbatch_rows(batch["lengths"].tolist(), micro_batch_size, token_budget)
    elif size % micro_batch_size:
        raise ValueError(f"batch of {size} is not a multiple of micro_batch_size={micro_batch_size}")
    else:
        rows = microbatch_rows([0] * size, micro_batch_size)
    rows = split_rows(rows, count)
    starts = [0, *accumulate(rows)]
    return [{k: v[i : i + n] for k, v in batch.items()} for i, n in zip(starts, rows)]


def trim_padding(microbatches: list[Batch]) -> list[Batch]:
    """Each microbatch cut to its longest row (`lengths`): a causal model computes the same at
    every real position without the right padding past it, and every consumer masks the
    positions from `lengths - 1` on. Sequence-shaped tensors ([b, S, ...]) are cut; one host
    read for the whole batch."""
    width = microbatches[0]["tokens"].size(1)
    longest = torch.stack([mb["lengths"].max() for mb in microbatches]).clamp(min=1).tolist()
    return [{k: v[:, :w] if v.dim() >= 2 and v.size(1) == width else v for k, v in mb.items()}
            for mb, w in zip(microbatches, longest)]


def real_positions(lengths: torch.Tensor, width: int, offset: int = 0) -> torch.Tensor:
    """[b, width] float: 1 at positions < lengths - offset."""
    return (torch.arange(width, device=lengths.device) < (lengths - offset)[:, None]).float()


def padding_positions(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[b, width] bool: True past each row's length (megatron's MoE padding_mask)."""
    return ~real_positions(lengths, width).bool()


def to_width(x: torch.Tensor, width: int) -> torch.Tensor:
    """[b, s, ...] -> [b, width, ...]: zeros after s (a trimmed microbatch's outputs), or cut to
    width (the columns sequence parallelism padded on)."""
    if x.dim() < 2 or x.size(1) == width:
        return x
    if x.size(1) > width:
        return x[:, :width]
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, width - x.size(1)))


def pad_for_sequence_parallel(microbatches: list[Batch], tp: int) -> list[Batch]:
    """Each microbatch's sequence-shaped tensors ([b, S, ...]) padded with zeros to a multiple of
    the TP size: sequence parallelism splits the sequence evenly over the TP ranks. The padding
    sits after every row's end, where a causal model's real positions do not look and every
    loss and output mask is 0 (a batch without `lengths` gets them: its rows end at the old width)."""
    out = []
    for mb in microbatches:
        width = mb["tokens"].size(1)
        extra = -width % tp
        if not extra:
            out.append(mb)
            continue
        if "attention_mask" in mb:
            raise ValueError(f"a batch with an explicit attention_mask of width {width} under sequence parallelism "
                             f"needs a width divisible by the tensor-parallel size {tp}")
        padded = {k: torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, extra))
                  if v.dim() >= 2 and v.size(1) == width else v for k, v in mb.items()}
        if "lengths" not in mb:
            padded["lengths"] = torch.full((mb["tokens"].size(0),), width, device=mb["tokens"].device)
        out.append(padded)
    return out


def routed_tokens(batch: Batch) -> torch.Tensor:
    """How many real tokens the batch sends through the routers (on the batch's device)."""
    if "lengths" in batch:
        return batch["lengths"].sum()
    return torch.tensor(batch["tokens"].numel(), device=batch["tokens"].device)


def loss_units(loss_fn: Callable, batch: Batch, output_shapes: dict[str, torch.Size]) -> torch.Tensor:
    """The units `loss_fn` divides by over the whole batch, from zero outputs: a LossFn's units
    depend on the batch alone (its masks), never on the outputs."""
    with torch.no_grad():
        zeros = {k: torch.zeros(shape, device=batch["tokens"].device) for k, shape in output_shapes.items()}
        return loss_fn(zeros, batch)[1]
