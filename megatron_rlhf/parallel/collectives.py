"""Data-parallel collectives that keep tensors on their device.

NCCL reduces CUDA tensors only and gloo CPU ones, so nothing here builds a tensor on the host
for a collective: values arrive as tensors on the role's device and leave on it, and a caller
reads them (one `.tolist()` per logged step) when it decides to. Without an initialised
data-parallel group (one process, unit tests, FakeTensorMode checks) every function is the
identity on its inputs, so the same code runs under all three.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor


def dp_group():
    """megatron's data-parallel group, or None outside a distributed run."""
    from megatron.core import parallel_state

    if not dist.is_initialized() or not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_data_parallel_group()


def _group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def check_backend_device(t: Tensor, backend: str) -> None:
    """NCCL fails (or hangs) on host tensors: say which tensor instead."""
    if backend == "nccl" and t.device.type != "cuda":
        raise ValueError(f"NCCL collective on a {t.device.type} tensor {tuple(t.shape)}: build it on the "
                         "device of the values it reduces (megatron_rlhf.parallel.device())")


def all_reduce(t: Tensor, op=dist.ReduceOp.SUM, group=None) -> Tensor:
    """The reduction of `t` over `group` (default: the world) as a new tensor on t's device."""
    if not dist.is_initialized() or _group_size(group) == 1:
        return t
    check_backend_device(t, dist.get_backend(group))
    out = t.clone()
    dist.all_reduce(out, op=op, group=group)
    return out


def dp_sum(values: Tensor) -> Tensor:
    """Sum over data-parallel ranks (each rank holds sums over its own shard of the batch)."""
    group = dp_group()
    return values if group is None else all_reduce(values, group=group)


def dp_max(values: Tensor) -> Tensor:
    """Elementwise maximum over data-parallel ranks."""
    group = dp_group()
    return values if group is None else all_reduce(values, op=dist.ReduceOp.MAX, group=group)


def dp_mean(values: Tensor) -> Tensor:
    """Mean over data-parallel ranks of per-rank values."""
    group = dp_group()
    return values if group is None else all_reduce(values, group=group) / _group_size(group)


def stack_values(values: dict[str, Tensor | float], device: torch.device) -> Tensor:
    """This rank's values as one float64 vector on `device`: 0-dim tensors (which must already
    be there) and host numbers (e.g. gold scores computed from text)."""
    for name, v in values.items():
        # Checked by hand: stack() and most ops let a 0-dim host tensor pass next to device ones.
        if torch.is_tensor(v) and v.device != device:
            raise ValueError(f"{name}: a {v.device} tensor among values for a collective on {device}; "
                             "compute it from the role outputs' device")
    return torch.stack([v.detach().to(torch.float64) if torch.is_tensor(v)
                        else torch.tensor(float(v), dtype=torch.float64, device=device) for v in values.values()])


def dp_sums(values: dict[str, Tensor | float], device: torch.device) -> dict[str, float]:
    """Each value summed over data-parallel ranks: one collective and one host read for a
    whole step's statistics."""
    return dict(zip(values, dp_sum(stack_values(values, device)).tolist()))


def masked_moments(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(count, mean, unbiased variance) of x where mask is 1, over every data-parallel rank:
    algorithms.stats.masked_moments (two passes, float64) with its sums reduced over DP."""
    from megatron_rlhf.algorithms.stats import masked_moments as moments

    return moments(x, mask, reduce=dp_sum)


def any_rank(flag: bool) -> bool:
    """Collective over the whole world: True on every rank if `flag` is True on any."""
    from megatron_rlhf.parallel import device

    t = torch.tensor([1.0 if flag else 0.0], device=device())
    return bool(all_reduce(t, op=dist.ReduceOp.MAX).item())


@contextmanager
def errors_agreed(elsewhere: Callable[[], BaseException], catch: type[BaseException] | tuple = Exception,
                  raise_as: Callable[[BaseException], BaseException] | None = None) -> Iterator[None]:
    """Collective over the whole world, entered by every rank: an error of type `catch` raised in
    the block on any rank is raised on every rank once the block has ended everywhere, instead of
    the other ranks going on to a later collective and waiting for the failed one forever.

    The failed rank raises its own error (or `raise_as(error)`, chained to it); the others raise
    `elsewhere()`, which should say to look for the error in the failed rank's log. Errors of
    other types leave the block at once, unagreed."""
    error: BaseException | None = None
    try:
        yield
    except catch as e:  # re-raised below, after every rank knows
        error = e
    raise_on_every_rank(error, elsewhere, raise_as)


def raise_on_every_rank(error: BaseException | None, elsewhere: Callable[[], BaseException],
                        raise_as: Callable[[BaseException], BaseException] | None = None) -> None:
    """Collective over the whole world: `errors_agreed` for an error this rank has already
    caught (e.g. one kept while it went on taking part in the collectives of a weight stream)."""
    if any_rank(error is not None):
        if error is None:
            raise elsewhere()
        if raise_as is None:
            raise error
        raise raise_as(error) from error
