"""Which keys an attention query may see: the one mask rule, in torch alone, so that both the
SDPA core attention (models/attention.py) and the CPU stand-ins for megatron-core's mask
builders (parallel/cpu.py) use it without one of those rooms importing the other."""

from __future__ import annotations

import torch


def visible_keys(sq: int, skv: int, window: tuple[int, int] | None = None,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """[sq, skv] bool, True where query i may attend to key j (SDPA's convention; megatron's
    masks are its negation). The queries are the LAST sq of the skv positions (bottom-right
    alignment: a chunk of queries after cached keys), so query i sits at position
    skv - sq + i. Causal: keys at or before the query. `window` = (left, right), megatron's
    convention: keys from left before the query to right after it; a negative side is
    unbounded. (left, 0) is causal sliding-window attention.

    The one place masks are built (the SDPA core attention, models/attention.py, and the CPU
    adaptations' stand-ins for megatron's mask builders, parallel/cpu.py, both call it). Packed
    sequences (THD) add their same-sequence condition on top, from cu_seqlens
    (models/attention.py: packed_visible_keys)."""
    query_positions = torch.arange(skv - sq, skv, device=device).unsqueeze(1)
    key_positions = torch.arange(skv, device=device).unsqueeze(0)
    offset = key_positions - query_positions  # < 0: a key in the query's past
    left, right = window if window is not None else (-1, 0)
    visible = offset <= right if right >= 0 else torch.ones(sq, skv, dtype=torch.bool, device=device)
    if left >= 0:
        visible = visible & (offset >= -left)
    return visible
