"""Hugging Face safetensors weights on disk: slice-wise reading and sharded writing.

Reading: a directory holds `model.safetensors`, or shards named by
`model.safetensors.index.json` ("weight_map": tensor -> file). Tensors are read lazily,
one slice at a time (safetensors `safe_open` + `get_slice`), so a rank only ever holds the
rows/columns of its own shard. Writing: tensors go to `model-0000X-of-0000N.safetensors`
files of at most `max_shard_bytes` each (a group of tensors is never split) plus
`model.safetensors.index.json`, or to one `model.safetensors` when everything fits in one.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path

import torch

from megatron_rlhf.convert.hf_config import ConvertError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HFWeights:
    """The tensors of an HF model directory, read by slices."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        index, single = self.dir / INDEX, self.dir / SINGLE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise ConvertError(f"{index}: unreadable ({type(e).__name__}: {e})") from None
            self.files = {name: self.dir / file for name, file in weight_map.items()}
        elif single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as f:
                self.files = {name: single for name in f.keys()}
        else:
            found = sorted(p.name for p in self.dir.glob("*.bin")) + sorted(p.name for p in self.dir.glob("*.pt*"))
            hint = (f" (found {found[:3]}: PyTorch pickles are not read; re-save the model with "
                    "save_pretrained(..., safe_serialization=True))") if found else ""
            raise ConvertError(f"{self.dir}: no {SINGLE} or {INDEX}{hint}")

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _file(self, name: str) -> Path:
        if name not in self.files:
            raise ConvertError(f"{self.dir}: tensor {name!r} is missing from the safetensors files "
                               "(not a Llama checkpoint, or a truncated download)")
        path = self.files[name]
        if not path.is_file():
            raise ConvertError(f"{path}: missing (named for {name!r} in {INDEX})")
        return path

    def shape(self, name: str) -> tuple[int, ...]:
        from safetensors import safe_open

        with safe_open(str(self._file(name)), framework="pt") as f:
            return tuple(f.get_slice(name).get_shape())

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows [a, b) and/or columns [c, d) of tensor `name` (whole tensor by default).
        The file is mapped only for this read: the pages it touched do not stay in this
        process's resident memory (a whole shard would otherwise count there)."""
        from safetensors import safe_open

        with safe_open(str(self._file(name)), framework="pt") as f:
            s = f.get_slice(name)
            r = slice(*rows) if rows is not None else slice(None)
            return s[r, slice(*cols)] if cols is not None else s[r]


def plan_shards(groups: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Greedy: consecutive groups (name, bytes) into shards of at most max_shard_bytes
    (a group larger than that gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in groups:
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return [s for s in shards if s]


def write_shards(out_dir: Path, groups: list[tuple[str, int]], make_group: Callable[[str], dict[str, torch.Tensor]],
                 max_shard_bytes: int) -> list[str]:
    """Write the tensors of `groups` (built one group at a time by make_group(name)) into
    safetensors shards + index under out_dir. Returns the file names written."""
    from safetensors.torch import save_file

    shards = plan_shards(groups, max_shard_bytes)
    names = [SINGLE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    total = 0
    for file, shard in zip(names, shards):
        tensors: dict[str, torch.Tensor] = {}
        for group in shard:
            tensors.update({k: v.contiguous() for k, v in make_group(group).items()})
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        names.append(INDEX)
    return names


def group_bytes(shapes: Iterable[tuple[int, ...]], element_size: int) -> int:
    total = 0
    for shape in shapes:
        n = 1
        for s in shape:
            n *= s
        total += n * element_size
    return total


def check_export_dir(out_dir: Path) -> None:
    """Refuse an `out_dir` that exists and is not an empty directory (before any work)."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConvertError(f"{out_dir}: exists and is not empty; export into a new directory")


@contextmanager
def written_atomically(out_dir: Path):
    """A new temporary directory beside `out_dir` (which must be absent or empty: check_export_dir)
    for the block to fill; it becomes `out_dir` when the block completes and is removed if it raises."""
    tmp = out_dir.with_name(out_dir.name + ".tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
