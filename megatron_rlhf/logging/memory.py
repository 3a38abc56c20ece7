"""Where a stage's memory goes: per role, the bytes of weights, gradient buffers, optimizer
state (Adam moments and fp32 main copies) and activations kept for backward, against the
stage's peak.

On GPU the peak is the device's allocated peak and the baseline what was allocated when the
stage started; on CPU the peak is the process's peak RSS and the baseline its RSS when the
stage started (Python, torch and megatron-core already imported). `other` is what the account
does not explain: activations, logits, the allocator's caches, communication buffers.
A checkpoint save's own bytes are measured while it runs (MemoryGrowth, in
CheckpointManager.save) and named `checkpoint_save_bytes`.
"""

from __future__ import annotations

import threading

import torch

from megatron_rlhf.colocation import current_memory_bytes


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class SavedActivations:
    """Bytes autograd keeps for backward from the forwards run inside this context (each storage
    counted once; the given parameters' storages, which layers also save, not at all): the
    activations and logits a microbatch holds until its backward. A `saved_tensors_hooks` pair
    that only looks, so it costs one Python call per saved tensor while active."""

    def __init__(self, parameters):
        self.exclude = {p.untyped_storage().data_ptr() for p in parameters}
        self.storages: dict[int, int] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.exclude:
            self.storages[ptr] = t.untyped_storage().nbytes()
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


class MemoryGrowth:
    """The largest rise of this process's memory (colocation.current_memory_bytes: RSS on CPU,
    allocated device memory on GPU) above its value on entry, while the context is active:
    `bytes` after it. Neither peak can be read for a span of time without resetting the
    process's own (which stage summaries report), so a thread samples every `interval_s`; a
    spike shorter than that can be missed, allocations that live through a save's write cannot."""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s
        self.start = self.peak = 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, current_memory_bytes())

    def __enter__(self):
        self.start = self.peak = current_memory_bytes()
        self._thread = threading.Thread(target=self._sample, name="memory-growth", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()  # stopped before anything forks (an async save's writer)
        self.peak = max(self.peak, current_memory_bytes())

    @property
    def bytes(self) -> int:
        return max(self.peak - self.start, 0)


def role_memory(role) -> dict[str, int]:
    """Bytes of one role's weights, gradient buffers and optimizer state on this rank, and the
    activations its largest measured microbatch kept for backward (Role.activation_bytes)."""
    # a role running another's module (the LoRA reference) holds no weights of its own
    weights = 0 if getattr(role, "shares_weights_of", None) else sum(_nbytes(p) for p in role.module.parameters())
    trainable = sum(p.numel() for p in role.module.parameters() if p.requires_grad) if role.trainable else 0
    grads = optimizer = 0
    if role.trainable:
        buffers = role.grad_buffers
        grads = sum(_nbytes(b.grad_data) for b in buffers if b.grad_data is not None)
        # fp32 main parameters that are views into the model's own buffers are no extra memory
        shared = {b.param_data.untyped_storage().data_ptr() for b in buffers if b.param_data is not None}
        shared |= {p.untyped_storage().data_ptr() for p in role.module.parameters()}
        for inner in getattr(role.optimizer, "chained_optimizers", [role.optimizer]):
            torch_opt = getattr(inner, "optimizer", None)
            if torch_opt is None:
                continue
            for group in torch_opt.param_groups:
                optimizer += sum(_nbytes(p) for p in group["params"] if p.untyped_storage().data_ptr() not in shared)
            for state in torch_opt.state.values():
                optimizer += sum(_nbytes(v) for v in state.values() if torch.is_tensor(v))
    return {"weights": weights, "gradient_buffers": grads, "optimizer_state": optimizer,
            "activations": role.activation_bytes or 0, "trainable_parameters": trainable}


def memory_account(roles: dict, peak_bytes: int, baseline_bytes: int, checkpoint_save_bytes: int = 0) -> dict:
    """The stage summary's `memory_account`: per role and in total, with the peak above the
    baseline and what the account leaves unexplained (`other_bytes`). The account is the roles'
    state plus the larger of two transients that never coexist: the activations of the one role
    that trains at a time (the largest), and `checkpoint_save_bytes`, the memory the last
    checkpoint save added while it ran (MemoryGrowth; saves run between steps; 0: none)."""
    per_role = {name: role_memory(role) for name, role in roles.items()}
    state = sum(r["weights"] + r["gradient_buffers"] + r["optimizer_state"] for r in per_role.values())
    activations = max((r["activations"] for r in per_role.values()), default=0)
    account = state + max(activations, checkpoint_save_bytes)
    above = max(peak_bytes - baseline_bytes, 0)
    return {"roles": per_role, "model_state_bytes": state, "activation_bytes": activations,
            "checkpoint_save_bytes": checkpoint_save_bytes, "account_bytes": account, "baseline_bytes": baseline_bytes,
            "peak_above_baseline_bytes": above, "other_bytes": above - account,
            "peak_over_account": above / account if account else None}
