"""Read tensors of one megatron-core torch_dist checkpoint in a single process.

No torch.distributed process group and no model: the checkpoint's `.metadata` lists each
tensor's global shape and the chunks that every saving rank wrote; `read(key, start, stop)`
fetches the part [start, stop) along dim 0 (e.g. one layer of a layer-stacked tensor) by
asking torch.distributed.checkpoint's FileSystemReader for exactly the chunk pieces that
overlap it, so exporting a large model never holds more than the requested tensors. Works
for any TP x PP x DP layout the checkpoint was saved at (those only change the chunks).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_rlhf.convert.hf_config import ConvertError


class _Targets:
    """The minimal LoadPlanner side FileSystemReader.read_data calls back into."""

    def __init__(self, targets: dict[str, torch.Tensor]):
        self.targets = targets

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        t = self.targets[item.dest_index.fqn]
        for dim, (offset, length) in enumerate(zip(item.dest_offsets, item.lengths)):
            t = t.narrow(dim, offset, length)
        return t

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, item: ReadItem, value) -> None:
        raise ConvertError(f"{item.dest_index.fqn}: expected a tensor, found a bytes object")


class TorchDistCheckpoint:
    """One role directory of a megatron torch_dist checkpoint (holds `.metadata`)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / ".metadata").is_file():
            raise ConvertError(f"{self.path}: not a megatron torch_dist checkpoint (no .metadata)")
        self._reader = FileSystemReader(str(self.path))
        self.metadata = self._reader.read_metadata()
        self._reader.set_up_storage_reader(self.metadata, is_coordinator=True)
        self.tensors = {k: v for k, v in self.metadata.state_dict_metadata.items()
                        if isinstance(v, TensorStorageMetadata)}

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    def read_many(self, requests: dict[str, tuple[int, int] | None]) -> dict[str, torch.Tensor]:
        """{key: (start, stop) along dim 0, or None for the whole tensor} -> tensors."""
        items, targets = [], {}
        for key, span in requests.items():
            if key not in self.tensors:
                raise ConvertError(f"{self.path}: tensor {key!r} is not in the checkpoint")
            md = self.tensors[key]
            shape = list(md.size)
            offsets = [0] * len(shape)
            if span is not None:
                offsets[0], shape[0] = span[0], span[1] - span[0]
            targets[key] = torch.empty(shape, dtype=md.properties.dtype)
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(shape))
            items += create_read_items_for_chunk_list(key, md, [chunk])
        covered = {}
        for item in items:  # every element must come from some saved chunk
            n = 1
            for length in item.lengths:
                n *= length
            covered[item.dest_index.fqn] = covered.get(item.dest_index.fqn, 0) + n
        for key, t in targets.items():
            if covered.get(key, 0) < t.numel():
                raise ConvertError(f"{self.path}: tensor {key!r} is incomplete in the checkpoint "
                                   f"({covered.get(key, 0)} of {t.numel()} elements saved)")
        self._reader.read_data(LoadPlan(items), _Targets(targets)).wait()
        return targets

    def read(self, key: str, span: tuple[int, int] | None = None) -> torch.Tensor:
        return self.read_many({key: span})[key]

    def common_state(self) -> dict:
        """The checkpoint's non-tensor state (our roles' `extra` dict lives there)."""
        from megatron.core.dist_checkpointing import load_common_state_dict

        return load_common_state_dict(str(self.path))
