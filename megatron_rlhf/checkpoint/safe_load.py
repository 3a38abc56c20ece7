"""Reading checkpoint files without letting them run code.

Unpickling calls whatever the file names, so opening a checkpoint directory someone else
made could run arbitrary code. Everything we read from a checkpoint is unpickled with an
allowlist instead:

- our own .pt files (trainer state): `load_pt`, torch.load(weights_only=True), which builds
  only tensors, numbers, strings and containers (plus the numpy arrays older trainer states
  held their RNG state in);
- megatron-core dist checkpoints (torch.distributed.checkpoint underneath), while
  `restricted_dcp_unpickling(role_dir)` is active: each `.metadata` with an unpickler that
  knows only DCP's own metadata classes (torch unpickles it with plain pickle.load,
  filesystem.py FileSystemReader.read_metadata), and the pickled objects in the .distcp
  files (megatron's common state, extra states) with torch.load(weights_only=True) (torch
  uses weights_only=False, default_planner.py DefaultLoadPlanner.load_bytes).

A file that needs anything else is refused with a CheckpointError naming it.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import pickle
import re
from contextlib import contextmanager
from pathlib import Path, PosixPath, PurePosixPath
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import filesystem, metadata, planner
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, set_element

from megatron_rlhf.checkpoint.errors import CheckpointError

try:
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy < 2
    from numpy.core.multiarray import _reconstruct

PLAIN_VALUES = "tensors, numbers and strings"
DCP_METADATA = "torch.distributed.checkpoint metadata"

# Trainer states written before RNG states were stored as plain values hold numpy's as an
# ndarray; rebuilding a numeric array runs no code.
_LEGACY_NUMPY = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), _reconstruct]


def refused(path: str | Path, error: Exception, allowed: str = PLAIN_VALUES) -> CheckpointError:
    return CheckpointError(
        f"{path}: holds objects other than {allowed} ({_reason(error)}); it was not loaded, because "
        "unpickling it could run arbitrary code. megatron_rlhf never writes such objects, so the file "
        "was made or changed elsewhere: load checkpoints only from sources you trust")


def _reason(error: Exception) -> str:
    """What was refused, from torch's weights_only message or ours (the rest of torch's
    message suggests weights_only=False, which is exactly what must not happen here)."""
    text = str(error)
    if m := re.search(r"GLOBAL ([\w.]+)", text):
        return f"it refers to {m.group(1)}"
    if m := re.search(r"WeightsUnpickler error: ([^\n]*)", text):
        return m.group(1).split(". ")[0]
    return text.splitlines()[0] if text else type(error).__name__


def load_pt(path: str | Path) -> Any:
    """torch.load of one of our own .pt files, refusing anything but plain values."""
    try:
        with torch.serialization.safe_globals(_LEGACY_NUMPY):
            return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise refused(path, e) from None


# ----------------------------------------------------------------------------- dist checkpoints


def _dcp_classes() -> dict[tuple[str, str], type]:
    # Creating a dataclass or an enum member only stores the values it is given; these three
    # modules define every class a `.metadata` holds (its Metadata, and the save plans in it).
    found = {}
    for module in (metadata, planner, filesystem):
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and obj.__module__ == module.__name__
                    and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))):
                found[(module.__name__, name)] = obj
    return found


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a protocol-5 pickle, which torch's weights_only unpickler cannot
    read (it stops at the FRAME opcode). A find_class allowlist restricts it just as well:
    a pickle can only call (REDUCE, NEWOBJ) what find_class handed it."""

    # DCP also records the checkpoint_id it was saved under: a str, or a Path when given one.
    allowed = {**_dcp_classes(), ("torch", "Size"): torch.Size,
               ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
               ("pathlib", "PosixPath"): PosixPath, ("pathlib", "PurePosixPath"): PurePosixPath}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not allowed")


def read_dcp_metadata(path: str | Path) -> metadata.Metadata:
    with open(path, "rb") as f:
        return _read_metadata_stream(f, path)


def _read_metadata_stream(stream, path) -> metadata.Metadata:
    try:
        return _MetadataUnpickler(stream).load()
    except pickle.UnpicklingError as e:
        raise refused(path, e, DCP_METADATA) from None


def _safe_read_metadata(self, *args, **kwargs) -> metadata.Metadata:
    """FileSystemReader.read_metadata (torch 2.13, filesystem.py:926) with the restricted
    unpickler; the signature stays (*args, **kwargs): torch's loader inspects it."""
    path = self._get_metadata_path(kwargs.get("rank"))
    with self.fs.create_stream(path, "rb") as f:
        md = _read_metadata_stream(f, path)
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = metadata.StorageMeta()
    md.storage_meta.load_id = self.load_id
    return md


@contextmanager
def restricted_dcp_unpickling(directory: str | Path):
    """While active, torch.distributed.checkpoint (and megatron-core's dist_checkpointing on
    top of it) unpickles only allowlisted objects; `directory` is the role checkpoint being
    read. The two torch methods that unpickle are swapped for the duration because neither
    torch nor megatron-core 0.19.2 lets a caller choose them: megatron creates its reader
    itself (strategies/torch.py _get_filesystem_reader) and reads the common state with DCP's
    default planner (serialization.py load_common_state_dict).
    The `.metadata` is checked first, so its refusal is a clean CheckpointError (inside
    torch it would set off fallback warnings); a refusal inside torch comes out as that
    CheckpointError, whatever torch or megatron wrapped it in."""
    directory = Path(directory)
    if (directory / ".metadata").is_file():
        read_dcp_metadata(directory / ".metadata")
    refusals: list[CheckpointError] = []

    def load_bytes(self, read_item, value) -> None:
        # DefaultLoadPlanner.load_bytes (default_planner.py:382) with weights_only=True
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            info = self.metadata.storage_data.get(read_item.storage_index) if self.metadata else None
            where = directory / info.relative_path if info is not None else directory
            refusals.append(refused(f"{where} (object {read_item.dest_index.fqn})", e))
            raise refusals[-1] from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

    saved = filesystem.FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes
    filesystem.FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes = _safe_read_metadata, load_bytes
    try:
        yield
    except BaseException:  # torch's CheckpointException is a BaseException
        if refusals:
            raise refusals[0] from None
        raise
    finally:
        filesystem.FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes = saved
