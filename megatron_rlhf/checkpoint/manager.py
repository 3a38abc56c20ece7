"""Stage checkpoints: iter_* directories, an atomic `latest` marker, retention, trainer state.

    <stage_dir>/
      iter_0000040/            one complete checkpoint
        actor/ critic/ ...     megatron dist checkpoint per trained role (model + optimizer + LR)
        trainer_state/         rank_00000.pt ... (step, data position, RNG states, ...)
      latest                   name of the newest COMPLETE checkpoint, written last

A checkpoint is written under `iter_*.tmp`, renamed once every rank has finished, and only
then named in `latest`; a loader trusts nothing `latest` does not name, so a crash mid-save
never exposes a partial checkpoint.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_rlhf.checkpoint.dist import load_role, save_role

_ITER = re.compile(r"^iter_(\d{7})$")


def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


def rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    return {
        "python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def resolve_checkpoint(path: str | Path) -> Path:
    """A stage directory (follow its `latest`) or an iter_* directory -> the iter_* directory."""
    path = Path(path)
    if _ITER.match(path.name):
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint not found: {path}")
        return path
    marker = path / "latest"
    if not marker.is_file():
        raise FileNotFoundError(f"no complete checkpoint in {path} (no 'latest' marker)")
    target = path / marker.read_text().strip()
    if not target.is_dir():
        raise FileNotFoundError(f"{marker} names {target.name}, which does not exist")
    return target


class CheckpointManager:
    """Saves and loads the complete state of one stage under `stage_dir`."""

    def __init__(self, stage_dir: str | Path, keep_last: int = 2, async_save: bool = False):
        self.stage_dir = Path(stage_dir)
        self.keep_last = keep_last
        self.async_save = async_save

    def latest(self) -> Path | None:
        try:
            return resolve_checkpoint(self.stage_dir)
        except FileNotFoundError:
            return None

    def save(self, step: int, roles: dict, trainer_state: dict[str, Any]) -> Path:
        """Collective. `trainer_state` is this rank's (it may differ per rank, e.g. RNG)."""
        rank = dist.get_rank()
        final = self.stage_dir / iter_name(step)
        tmp = final.with_name(final.name + ".tmp")
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # debris of an earlier crashed save
            (tmp / "trainer_state").mkdir(parents=True)
        dist.barrier()
        for name, role in roles.items():
            save_role(role, tmp / name)
        state = {**trainer_state, "rng": rng_state(), "world_size": dist.get_world_size()}
        torch.save(state, tmp / "trainer_state" / f"rank_{rank:05d}.pt")
        dist.barrier()
        if rank == 0:
            if final.exists():  # same step saved again (e.g. final save after an interval save)
                shutil.rmtree(final)
            os.replace(tmp, final)
            marker_tmp = self.stage_dir / "latest.tmp"
            marker_tmp.write_text(final.name + "\n")
            os.replace(marker_tmp, self.stage_dir / "latest")
            self._apply_retention(keep=final.name)
        dist.barrier()
        return final

    def poll(self) -> None:
        """Collective. Commit the async saves every rank has finished writing (no-op when sync)."""

    def wait(self) -> None:
        """Collective. Block until every pending async save is committed (no-op when sync)."""

    def _apply_retention(self, keep: str) -> None:
        complete = sorted(p for p in self.stage_dir.iterdir() if _ITER.match(p.name))
        for old in complete[: -self.keep_last]:
            if old.name != keep:
                shutil.rmtree(old, ignore_errors=True)

    def load(self, roles: dict, checkpoint: str | Path | None = None) -> dict[str, Any]:
        """Collective. Loads every role (at this process's layout) and returns this rank's
        trainer state; RNG states are restored only when the world size is unchanged."""
        path = resolve_checkpoint(checkpoint or self.stage_dir)
        for name, role in roles.items():
            load_role(role, path / name)
        rank_file = path / "trainer_state" / f"rank_{dist.get_rank():05d}.pt"
        state = torch.load(rank_file if rank_file.exists() else path / "trainer_state" / "rank_00000.pt",
                           weights_only=False)
        if state.pop("world_size") == dist.get_world_size():
            set_rng_state(state.pop("rng"))
        else:
            state.pop("rng")
        state["checkpoint"] = str(path)
        return state
