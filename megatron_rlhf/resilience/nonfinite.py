"""NaN/Inf guard: a step whose loss or gradients are non-finite on any rank is skipped (no
optimizer or LR-schedule update) and counted; too many in a row stop the run with an error.
A checkpoint is never written from non-finite weights."""

from __future__ import annotations

import torch

from megatron_rlhf.parallel import any_rank


class NonFiniteError(RuntimeError):
    pass


def all_finite(tensors) -> bool:
    """Local check (no communication)."""
    return all(bool(torch.isfinite(t).all()) for t in tensors)


class NonFiniteGuard:
    """Counts skipped steps of one trained role; its state is part of the trainer state."""

    def __init__(self, role_name: str, max_consecutive: int):
        self.role_name = role_name
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.skipped = 0

    def should_skip(self, losses, grads) -> bool:
        """Collective. True (and counted) when any rank's loss or gradients are non-finite;
        raises NonFiniteError once more than `max_consecutive` steps in a row were."""
        if not any_rank(not (all_finite(losses) and all_finite(grads))):
            self.consecutive = 0
            return False
        self.consecutive += 1
        self.skipped += 1
        if self.consecutive > self.max_consecutive:
            raise NonFiniteError(
                f"{self.role_name}: loss or gradients were NaN/Inf in {self.consecutive} optimizer steps in a row "
                f"(resilience.max_consecutive_nonfinite={self.max_consecutive}); stopping without saving. The last "
                f"complete checkpoint is intact: lower the learning rate, check the data, or resume from it.")
        return True

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive, self.skipped = state["consecutive"], state["skipped"]


def ensure_finite_weights(roles: dict) -> None:
    """Collective. Raises NonFiniteError (on every rank) if any rank holds a NaN/Inf weight."""
    bad = [name for name, role in roles.items() if not all_finite(p.detach() for p in role.module.parameters())]
    if any_rank(bool(bad)):
        raise NonFiniteError(f"refusing to save a checkpoint: non-finite weights in {bad or 'another rank'}")
