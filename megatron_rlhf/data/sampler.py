"""A deterministic, resumable stream of dataset indices, epoch after epoch.

The whole state is (seed, epoch, position): each epoch's order is recomputed from the
seed and the epoch number, so a checkpoint stores four integers and a resumed run sees
exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

from typing import Any

import torch

_STATE_KEYS = ("epoch", "position", "seed", "n")


class EpochSampler:
    """Indices 0..n-1 in a fresh seeded permutation per epoch (or in order with shuffle=False)."""

    def __init__(self, n: int, seed: int, shuffle: bool = True) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"EpochSampler: n must be a positive int (dataset size), got {n!r}")
        self.n = n
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def next_indices(self, k: int) -> list[int]:
        """The next `k` indices, continuing into the next epoch when this one runs out."""
        if k < 0:
            raise ValueError(f"EpochSampler.next_indices: k must be >= 0, got {k}")
        indices: list[int] = []
        while len(indices) < k:
            take = min(k - len(indices), self.n - self.position)
            indices.extend(self._order[self.position : self.position + take])
            self.position += take
            if self.position == self.n:
                # Advance eagerly so a state saved at an epoch boundary reads (epoch+1, 0).
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
        return indices

    def state_dict(self) -> dict[str, int]:
        """Everything needed to continue the stream: epoch, position, seed and n."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; refuses a state saved for different data or another seed."""
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"EpochSampler state: missing {missing}")
        if state["n"] != self.n:
            raise ValueError(
                f"EpochSampler state: saved for {state['n']} items, the dataset now has "
                f"{self.n}; the data changed, so the saved position is meaningless"
            )
        if state["seed"] != self.seed:
            # Resuming a stream under another seed would silently replay a different order.
            raise ValueError(
                f"EpochSampler state: saved with seed {state['seed']}, this sampler uses "
                f"{self.seed}; resume with the original seed"
            )
        epoch, position = state["epoch"], state["position"]
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(position, int)
                and 0 <= position < self.n):
            raise ValueError(
                f"EpochSampler state: epoch {epoch!r} / position {position!r} out of range "
                f"for {self.n} items"
            )
        self.epoch, self.position = epoch, position
        self._order = self._epoch_order(epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        # A multiplicative mix, not seed + epoch: with a plain sum, seed 1 epoch 1 would
        # repeat seed 2 epoch 0, correlating runs that differ only in their seed.
        mixed = (self.seed * 0x9E3779B97F4A7C15 + epoch) % 2**64
        generator = torch.Generator().manual_seed(mixed)
        return torch.randperm(self.n, generator=generator).tolist()
