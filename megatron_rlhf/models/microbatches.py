"""How a role's batch becomes megatron's microbatches: rows per microbatch (fixed size or a
token budget; at least as many as an expert group agrees on), each cut to its longest row and
padded to a multiple of the TP size under sequence parallelism; and the per-batch counts the
MoE routers' load-balancing scale needs (models/roles.py)."""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate

import torch

from megatron.core.packed_seq_params import PackedSeqParams

from megatron_rlhf.parallel.context import SHARE_KEY, gather_sequence, split_microbatch

Batch = dict[str, torch.Tensor]


def microbatch_rows(lengths: list[int], micro_batch_size: int, token_budget: int = 0, packed: bool = False) -> list[int]:
    """Rows per microbatch, in order: `micro_batch_size` each, or with a `token_budget` as many
    consecutive rows as fit in it (rows x their longest length; `packed`: the sum of their
    lengths, rows back to back in one; at least one row). Rows sorted longest first
    (models.batching.by_length) waste the least."""
    if not token_budget:
        return [micro_batch_size] * (len(lengths) // micro_batch_size)
    rows, count, longest, total = [], 0, 0, 0
    for n in lengths:
        cost = total + n if packed else (count + 1) * max(longest, n)
        if count and cost > token_budget:
            rows.append(count)
            count, longest, total = 0, 0, 0
        count, longest, total = count + 1, max(longest, n), total + n
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


def split_microbatches(batch: Batch, micro_batch_size: int, token_budget: int = 0, count: int = 0,
                       packed: bool = False) -> list[Batch]:
    """Consecutive microbatches; by `token_budget` when given and the batch has `lengths`
    (`packed`: their rows will run packed, microbatch_rows); at least `count` of them (the largest halved)."""
    size = batch["tokens"].size(0)
    if token_budget and "lengths" in batch:
        rows = microbatch_rows(batch["lengths"].tolist(), micro_batch_size, token_budget, packed)
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
    `tp`: sequence parallelism splits the sequence evenly over the TP ranks (context parallelism
    into 2 x CP chunks: parallel.context.column_multiple is passed then). The padding
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
            raise ValueError(f"a batch with an explicit attention_mask of width {width} under sequence or context "
                             f"parallelism needs a width divisible by {tp} (TP, x 2 x CP with context parallelism)")
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


# --- packed sequences (THD): a microbatch's rows back to back in one row (rl.packing)
PACKED_KEYS = ("packed_tokens", "packed_positions", "packed_has_next", "cu_seqlens")


def pack_rows(mb: Batch, multiple: int = 1, sequence_multiple: int = 1) -> Batch:
    """The microbatch `mb` (rows with `lengths`, already cut to its longest row) plus its rows
    packed into one: `packed_tokens` [1, T] (each row's real tokens back to back, each row's
    room padded with zeros to a multiple of `sequence_multiple`: 2 x CP under context
    parallelism, which splits every sequence into 2 x CP chunks; then zeros to a multiple of
    `multiple`: the split's columns, parallel.context.column_multiple), `packed_positions` [1, T]
    (restarting at 0 per row), `packed_has_next` [1, T] bool (the token has a next token of its
    own row: a next-token target never crosses into the next row) and `cu_seqlens` int32 (the n
    rows' rooms' boundaries [n + 1], then the padding, if any, as a sequence of its own, so that
    cu_seqlens[-1] == T as THD RoPE and attention expect; never an empty sequence, which TE's
    kernels need not accept). With rooms larger than rows, `cu_seqlens_real` holds the real
    lengths' boundaries (TE's cu_seqlens_q beside cu_seqlens_q_padded). The row tensors stay:
    the outputs are unpacked to them (unpack_rows), so loss functions see the same microbatch
    as without packing."""
    tokens, lengths = mb["tokens"], mb["lengths"]
    rooms = lengths + (-lengths % sequence_multiple)
    ends = rooms.cumsum(0)
    used = int(ends[-1])  # one host read per microbatch: the packed row's size
    total = used + (-used % multiple)
    column = torch.arange(total, device=tokens.device)
    row = torch.searchsorted(ends, column, right=True).clamp(max=lengths.numel() - 1)
    offset = column - (ends[row] - rooms[row])
    in_rows = column < used
    real = in_rows & (offset < lengths[row])
    packed = torch.where(real, tokens[row, offset.clamp(max=tokens.size(1) - 1)], tokens.new_zeros(()))
    positions = torch.where(in_rows, offset, column - used)
    has_next = in_rows & (offset < lengths[row] - 1)
    boundaries = [lengths.new_zeros(1), ends] + ([lengths.new_full((1,), total)] if total > used else [])
    out = {**mb, "packed_tokens": packed[None], "packed_positions": positions[None], "packed_has_next": has_next[None],
           "cu_seqlens": torch.cat(boundaries).to(torch.int32)}
    if sequence_multiple > 1:
        real_ends = lengths.cumsum(0)
        extra = [real_ends[-1:] + (total - used)] if total > used else []
        out["cu_seqlens_real"] = torch.cat([lengths.new_zeros(1), real_ends, *extra]).to(torch.int32)
    return out


def pack_microbatches(microbatches: list[Batch], multiple: int = 1, sequence_multiple: int = 1) -> list[Batch]:
    """pack_rows on each microbatch."""
    return [pack_rows(mb, multiple, sequence_multiple) for mb in microbatches]


def max_sequence_length(mb: Batch) -> int:
    """The longest sequence of a packed microbatch, its padding included (one host read):
    megatron sizes the RoPE table by it and TE's kernels take it."""
    return int((mb["cu_seqlens"][1:] - mb["cu_seqlens"][:-1]).max())


def unpack_rows(packed: torch.Tensor, mb: Batch) -> torch.Tensor:
    """Per-token `packed` [T] or [1, T] of a packed microbatch -> [rows, width] in its rows'
    places (width: the microbatch's), 0 past each row's length."""
    lengths, width = mb["lengths"], mb["tokens"].size(1)
    flat = packed.reshape(-1)
    index = (mb["cu_seqlens"][:lengths.numel(), None].long() + torch.arange(width, device=flat.device)).clamp(max=flat.numel() - 1)
    real = real_positions(lengths, width).bool()
    return torch.where(real, flat[index], flat.new_zeros(()))


def last_tokens(packed: torch.Tensor, mb: Batch) -> torch.Tensor:
    """Per-token `packed` [T] or [1, T] -> [rows]: each row's value at its last token."""
    lengths = mb["lengths"]
    return packed.reshape(-1)[(mb["cu_seqlens"][:lengths.numel()].long() + lengths - 1).clamp(min=0)]


def next_token_targets(context: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets, valid) [s, b] for the model's input rows (the packed row when packed): each
    token's next token, and 1.0 where it has one (0 at the last column, from `lengths - 1` on,
    and at each packed row's last token, so a target never crosses into the next sequence).
    Under context parallelism, this rank's share of them (computed whole before the split:
    parallel/context.py)."""
    if "cp_targets" in context:
        return context["cp_targets"].t(), context["cp_valid"].t()
    if "packed_tokens" in context:
        tokens, valid = context["packed_tokens"].t(), context["packed_has_next"].t().float()
    else:
        tokens = context["tokens"].t()
        valid = torch.ones(tokens.shape, device=tokens.device)
        valid[-1] = 0
        if "lengths" in context:  # no next token from the last real one on: 0 there too, so a trimmed batch agrees
            valid = valid * real_positions(context["lengths"], tokens.size(0), offset=1).t()
    return torch.cat([tokens[1:], torch.zeros_like(tokens[:1])]), valid


def whole_sequence(x: torch.Tensor, context: Batch, dim: int) -> torch.Tensor:
    """Per-token `x` of the model's input rows along `dim`: under context parallelism this rank's
    share, gathered whole over the CP ranks (parallel/context.py); else `x` itself."""
    share = context.get(SHARE_KEY)
    return x if share is None else gather_sequence(x, dim, share)


def per_row(context: Batch, outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-token outputs [s, b] of the model's input rows -> [b, s] of the microbatch's rows
    (gathered whole under context parallelism, unpacked when the microbatch was packed)."""
    outputs = {k: whole_sequence(v, context, 0) for k, v in outputs.items()}
    if "packed_tokens" in context:
        return {k: unpack_rows(v, context) for k, v in outputs.items()}
    return {k: v.t() for k, v in outputs.items()}


def packed_options(mb: Batch) -> dict:
    """The model's keyword arguments for a packed microbatch (pack_rows): megatron's THD
    PackedSeqParams; the SDPA core attention (CPU) and TE's attention (GPU) read the same. Rows
    packed in rooms larger than themselves (context parallelism) give TE both boundaries."""
    longest = max_sequence_length(mb)
    real, padded = mb.get("cu_seqlens_real"), mb["cu_seqlens"]
    rooms = {} if real is None else {"cu_seqlens_q_padded": padded, "cu_seqlens_kv_padded": padded}
    boundaries = padded if real is None else real
    return {"packed_seq_params": PackedSeqParams(qkv_format="thd", cu_seqlens_q=boundaries, cu_seqlens_kv=boundaries,
                                                 max_seqlen_q=longest, max_seqlen_kv=longest, **rooms)}


def context_share(mb: Batch, cp: int, rank: int) -> Batch:
    """The microbatch `mb` (padded or packed for CP: models/microbatches.py) plus this CP rank's
    share of what the model reads (`cp_tokens`, `cp_positions`) and of the next-token targets,
    computed whole first (`cp_targets`, `cp_valid`): parallel/context.py."""
    if "attention_mask" in mb:
        raise ValueError("context parallelism splits each sequence over the CP ranks; a batch with an explicit "
                         "attention_mask cannot be split that way (set parallel.context_parallel=1)")
    targets, valid = next_token_targets(mb)
    if "packed_tokens" in mb:
        tokens, positions, cu_seqlens = mb["packed_tokens"], mb["packed_positions"], mb["cu_seqlens"]
    else:
        tokens = mb["tokens"]
        positions = torch.arange(tokens.size(1), device=tokens.device).expand_as(tokens)
        cu_seqlens = torch.tensor([0, tokens.size(1)], dtype=torch.int32, device=tokens.device)
    whole = {"cp_tokens": tokens, "cp_positions": positions, "cp_targets": targets.t(), "cp_valid": valid.t()}
    return split_microbatch({**mb, **whole}, {k: k for k in whole}, cu_seqlens, cp, rank)
