"""megatron-core's torch_dist save with host tensors copied one at a time while they are
written, instead of all at once while the save is planned.

megatron's FileSystemWriterAsync (dist_checkpointing/strategies/filesystem_async.py, 0.19.2)
clones, in `prepare_write_data`, every host tensor that is a view into a larger storage, so
that torch.save writes only the view's bytes. On CPU that is most of what a role saves: the
weights (and, at DP=1, the DistributedOptimizer's fp32 main params) are views into megatron
DDP's contiguous parameter buffer, and megatron's gathered optimizer state is slices of its
copies. The clones all live until the save ends, so a save held a second copy of what it writes
on top of the state (measured at the 135M shape, 621 MiB of fp32 weights: +2.4 GiB). torch's
own FileSystemWriter makes the same copy lazily, one tensor at a time, while writing; this
writer does that inside megatron's: the files are the bytes megatron writes (same items, same
buckets, same order), and a save holds at most one tensor's copy.

Async saves go through it too. Their copy of the state is the writer process that megatron's
TemporalAsyncCaller forks: it writes what memory held at the fork, and training's in-place
updates after it touch the trainer's pages, not the writer's (copy-on-write). So the trainer's
resident memory does not grow for an async save; the machine's does, by the pages training
rewrites while the writer runs (up to the state's size for a long write), and the writer
process makes its one-tensor copies in its own memory. Device tensors are still staged to the
host before the fork (megatron's preload), as before.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.filesystem_async import (
    FileSystemWriterAsync, _split_by_separation_hint, _split_by_size_and_type, get_write_results_queue,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.planner import WriteItemType


def is_view_of_larger_storage(tensor: torch.Tensor) -> bool:
    """megatron's test for a host tensor it must copy before torch.save (which writes a
    tensor's whole storage)."""
    return tensor.untyped_storage().size() != tensor.numel() * tensor.itemsize


class CompactedWhenWritten:
    """A write bucket's (write item, tensor) pairs whose iteration yields each host tensor that
    is a view into a larger storage as a compact copy, made as the writer reaches it and freed
    when it moves on to the next."""

    def __init__(self, pairs: list):
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def __iter__(self):
        for item, tensor in self.pairs:
            yield item, tensor.clone() if tensor.is_cpu and is_view_of_larger_storage(tensor) else tensor


class StreamingFileSystemWriter(FileSystemWriterAsync):
    """FileSystemWriterAsync whose host views are copied while written (module docstring)."""

    def prepare_write_data(self, plan, planner) -> None:
        """megatron's prepare_write_data (0.19.2) with its up-front clone of host views left to
        CompactedWhenWritten. Device tensors are staged by preload_tensors, as in megatron."""
        storage_plan = plan.storage_data
        if self.separation_hint:
            assert self.thread_count > 1, "thread_count must be at least 2 if separation_hint is provided"
        bins = self.thread_count // 2 if self.separation_hint is not None else self.thread_count
        item_buckets = _split_by_size_and_type(bins, plan.items)
        self.write_buckets = []
        for group_name, group_buckets in _split_by_separation_hint(item_buckets, self.separation_hint).items():
            for bucket in group_buckets:
                bytes_data = [(item, planner.resolve_data(item)) for item in bucket
                              if item.type == WriteItemType.BYTE_IO]
                tensor_data = [(item, _detached(planner.resolve_data(item))) for item in bucket
                               if item.type != WriteItemType.BYTE_IO]
                if bytes_data or tensor_data:
                    file_name = f"{group_name}{storage_plan.prefix}{len(self.write_buckets)}{DEFAULT_SUFFIX}"
                    self.write_buckets.append((os.path.join(self.checkpoint_dir, file_name), file_name,
                                               (bytes_data, CompactedWhenWritten(tensor_data))))
        assert len(self.write_buckets) <= self.thread_count, (len(self.write_buckets), self.thread_count)
        self.results_queue = get_write_results_queue() if self.write_buckets else None

    @staticmethod
    def preload_tensors(write_buckets: list, non_blocking: bool = True) -> list:
        """Device tensors to host now (megatron's preload); host tensors stay as they are, to be
        compacted while written."""
        staged = []
        for file_name, storage_key, (bytes_data, tensor_data) in write_buckets:
            pairs = [(item, tensor.to("cpu", non_blocking=non_blocking)) for item, tensor in tensor_data.pairs]
            staged.append((file_name, storage_key, (bytes_data, CompactedWhenWritten(pairs))))
        if non_blocking and torch.cuda.is_available():
            torch.cuda.synchronize()
        return staged


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    # as megatron's writer: quantized (FP8) device tensors are written dequantized
    if tensor.device.type == "cuda" and "dequantize" in type(tensor).__dict__:
        return tensor.dequantize()
    return tensor


@contextmanager
def _megatron_writer(writer_class):
    # TorchDistSaveShardedStrategy.async_save takes its writer class from this module attribute
    # (torch.py _import_mcore_async) and has no parameter for it.
    original = filesystem_async.FileSystemWriterAsync
    filesystem_async.FileSystemWriterAsync = writer_class
    try:
        yield
    finally:
        filesystem_async.FileSystemWriterAsync = original


class StreamingSaveStrategy(TorchDistSaveShardedStrategy):
    """megatron's torch_dist save strategy (same backend and version, so the same checkpoint
    format) writing through StreamingFileSystemWriter; sync saves (`save`) run through
    `async_save` too."""

    def async_save(self, sharded_state_dict, checkpoint_dir, async_strategy: str = "mcore"):
        if async_strategy != "mcore":
            raise ValueError(f"StreamingSaveStrategy wraps megatron's own ('mcore') writer, not {async_strategy!r}")
        with _megatron_writer(StreamingFileSystemWriter):
            return super().async_save(sharded_state_dict, checkpoint_dir, async_strategy)
