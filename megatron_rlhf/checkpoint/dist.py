"""Save and load one role (model + optimizer) as a megatron-core dist checkpoint (torch_dist).

The format is megatron-core's own: a checkpoint written at one TP x PP (x DP) layout loads at
any other. Commit markers, retention and trainer state build on this in `checkpoint/`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async

from megatron_rlhf.models.optimizer import load_optimizer_state, optimizer_sharded_state_dict


def _use_fork_for_writer_queue() -> None:
    # torch_dist save starts a multiprocessing Manager; with 'spawn' it re-imports __main__
    # and costs 7-10 s per save on 2 cores. Fork is safe while CUDA is not initialised.
    if filesystem_async._results_queue is None and not torch.cuda.is_initialized():
        filesystem_async.get_write_results_queue("fork")


def role_sharded_state_dict(role, with_optimizer: bool, is_loading: bool) -> dict:
    state = {"model": role.module.sharded_state_dict(), "extra": role.extra_state()}
    if with_optimizer and role.optimizer is not None:
        state["optimizer"] = optimizer_sharded_state_dict(role.optimizer, state["model"], is_loading)
        state["scheduler"] = role.scheduler.state_dict()  # common (rank 0) state
    return state


def save_role(role, path: str | Path, with_optimizer: bool = True) -> None:
    """Collective: every rank calls it. `path` must not exist yet (commit markers are the
    caller's job: write under a temporary name, then rename)."""
    path = Path(path)
    if torch.distributed.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=False)
    torch.distributed.barrier()
    _use_fork_for_writer_queue()
    dist_checkpointing.save(role_sharded_state_dict(role, with_optimizer, is_loading=False), str(path))


def load_role(role, path: str | Path, with_optimizer: bool = True) -> None:
    """Collective. Loads at this process's layout whatever layout the checkpoint was saved at."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    state = dist_checkpointing.load(role_sharded_state_dict(role, with_optimizer, is_loading=True), str(path))
    role.module.load_state_dict(state["model"])
    role.load_extra_state(state["extra"])
    if role.optimizer is None:
        return
    if with_optimizer:
        load_optimizer_state(role.optimizer, state["optimizer"])
        role.scheduler.load_state_dict(state["scheduler"])
    else:  # the optimizer's main (fp32) params must follow the freshly loaded weights
        role.optimizer.reload_model_params()


def load_model_weights(role, path: str | Path, skip_prefixes: tuple[str, ...] = ()) -> list[str]:
    """Collective. Only the model weights of the checkpoint at `path`, at this process's
    layout; parameters whose names start with `skip_prefixes` keep their current values
    (e.g. a reward model initialised from an SFT checkpoint keeps its fresh value head).
    Returns the skipped parameter names."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    sharded = role.module.sharded_state_dict()
    skipped = [k for k in sharded if k.startswith(skip_prefixes)]
    wanted = {k: v for k, v in sharded.items() if k not in skipped}
    loaded = dist_checkpointing.load(wanted, str(path))
    loaded = {k: v for k, v in loaded.items() if k in wanted}  # drop the checkpoint's common state
    missing, unexpected = role.module.load_state_dict(loaded, strict=False)
    missing = [k for k in missing if not k.startswith(skip_prefixes) and not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"{path}: weights do not match the model: missing {missing}, unexpected {unexpected}")
    if role.optimizer is not None:
        role.optimizer.reload_model_params()
    return skipped
