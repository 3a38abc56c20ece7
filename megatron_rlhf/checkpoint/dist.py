"""Save and load one role (model + optimizer) as a megatron-core dist checkpoint (torch_dist).

The format is megatron-core's own: a checkpoint written at one TP x PP (x DP) layout loads at
any other. Commit markers, retention and trainer state build on this in `checkpoint/`. Loading
unpickles only what such checkpoints hold (safe_load.restricted_dcp_unpickling).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing.managers import SyncManager
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async

from megatron_rlhf.checkpoint.safe_load import restricted_dcp_unpickling
from megatron_rlhf.checkpoint.streaming_writer import StreamingSaveStrategy
from megatron_rlhf.models.optimizer import load_optimizer_state, optimizer_sharded_state_dict

_writer_queue_manager = None  # keeps the queue's server process alive


def _exit_with_parent(parent_pid: int) -> None:
    # Runs first in the queue's server process. It is no daemon, nothing ever stops it, and
    # it inherits the trainer's stdout/stderr: when a rank is SIGKILLed (a real crash, or a
    # fault-injection test) it would outlive the job, and a launcher that reads the job's
    # output until EOF would hang. Linux: die with the process that started it.
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def _start_writer_queue() -> None:
    """Create megatron's process-wide write-results queue (a multiprocessing Manager queue
    that every torch_dist save reports through) ourselves, before megatron does:
    - with 'fork' while CUDA is not initialised: 'spawn' re-imports __main__ and costs 7-10 s
      per process on 2 cores;
    - with a server that exits when this process dies (_exit_with_parent)."""
    global _writer_queue_manager
    if filesystem_async._results_queue is not None:
        return
    ctx = mp.get_context("spawn" if torch.cuda.is_initialized() else "fork")
    _writer_queue_manager = SyncManager(ctx=ctx)
    _writer_queue_manager.start(_exit_with_parent, (os.getpid(),))
    filesystem_async._results_queue = _writer_queue_manager.Queue()


def model_sharded_state_dict(role) -> dict:
    """The role's weights to save: all of them, or with LoRA only the trained ones (adapters,
    a critic's value head); the frozen base stays in the checkpoint it was loaded from
    (Role.extra_state records which)."""
    sharded = role.module.sharded_state_dict()
    if getattr(role, "lora", None) is None:
        return sharded
    return {k: v for k, v in sharded.items() if trained_by_lora(role, k)}


def trained_by_lora(role, key: str) -> bool:
    """Whether `key` (a checkpoint key or parameter name) is a weight a LoRA role trains: an
    adapter, or under its `trained_prefixes` (a value head)."""
    from megatron_rlhf.models.lora import is_adapter

    return is_adapter(key) or key.startswith(role.trained_prefixes)


def role_sharded_state_dict(role, with_optimizer: bool, is_loading: bool) -> dict:
    state = {"model": model_sharded_state_dict(role), "extra": role.extra_state()}
    if with_optimizer and role.optimizer is not None:
        state["optimizer"] = optimizer_sharded_state_dict(role.optimizer, state["model"], is_loading)
        state["scheduler"] = role.scheduler.state_dict()  # common (rank 0) state
    return state


def save_role(role, path: str | Path, with_optimizer: bool = True, async_save: bool = False):
    """Collective: every rank calls it. `path` must not exist yet (commit markers are the
    caller's job: write under a temporary name, then rename).

    async_save: plan the save now and return megatron's AsyncRequest, whose `async_fn`
    writes this rank's files and whose `finalize_fns` (collective) complete the checkpoint
    (`.metadata`, metadata.json); the caller schedules it (checkpoint/manager.py). Without
    it, the checkpoint is complete when this returns (None)."""
    path = Path(path)
    if torch.distributed.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=False)
    torch.distributed.barrier()
    _start_writer_queue()
    state = role_sharded_state_dict(role, with_optimizer, is_loading=False)
    # megatron's torch_dist format, its host copies made one tensor at a time (streaming_writer.py)
    strategy = StreamingSaveStrategy()
    if not async_save:
        dist_checkpointing.save(state, str(path), sharded_strategy=strategy)
        return None
    # async_strategy="mcore": the default "nvrx" needs nvidia-resiliency-ext >= 0.6, whose
    # async modules megatron_rlhf/__init__.py hides next to the installed 0.4.1
    # (dist_checkpointing/strategies/torch.py get_async_strategy raises ModuleNotFoundError).
    return dist_checkpointing.save(state, str(path), sharded_strategy=strategy, async_sharded_save=True,
                                   async_strategy="mcore")


def check_architecture(role, path: Path) -> None:
    """The model config the checkpoint recorded (trainer_state next to the role directory)
    against the role's: a CheckpointError naming every architecture field that differs,
    instead of megatron's shape error deep in loading. Older checkpoints record none."""
    from megatron_rlhf.checkpoint.validate import CheckpointError, recorded_model_config
    from megatron_rlhf.config import ARCHITECTURE_FIELDS

    model = getattr(role, "model_config", None)  # the section the role was built from (models/roles.py)
    saved = recorded_model_config(path.parent) if model is not None else None
    if saved is None:
        return
    # the lengths are the run's choice; family only names the export format
    lines = [f"model.{f}: checkpoint {getattr(saved, f)!r}, this run {getattr(model, f)!r}"
             for f in ARCHITECTURE_FIELDS if f not in ("max_seq_length", "max_position_embeddings", "family")
             and getattr(saved, f) != getattr(model, f)]
    if lines:
        raise CheckpointError(f"{path}: written for another model architecture:\n  " + "\n  ".join(lines)
                              + "\nset those model.* fields as the run that wrote it did (or model.from_hf_config)")


def load_role(role, path: str | Path, with_optimizer: bool = True) -> None:
    """Collective. Loads at this process's layout whatever layout the checkpoint was saved at.
    A frozen role given a LoRA checkpoint gets the model it trained: its base with the adapters
    merged (load_model_weights)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    check_architecture(role, path)
    extra = load_extra_state(path)
    if loads_merged(role, path, extra, with_optimizer):
        load_model_weights(role, path)
        role.load_extra_state(extra)
        return
    with restricted_dcp_unpickling(path):
        state = dist_checkpointing.load(role_sharded_state_dict(role, with_optimizer, is_loading=True), str(path))
    if getattr(role, "lora", None) is None:
        role.module.load_state_dict(state["model"])
    else:  # the adapters (and a value head): the base comes from its own checkpoint (load_model_weights)
        _, unexpected = role.module.load_state_dict(state["model"], strict=False)
        if unexpected:
            raise RuntimeError(f"{path}: unexpected weights {unexpected}")
        role.resumed_lora_base = state["extra"].get("lora_base")  # what they trained on (roles.lora_base_warnings)
    role.load_extra_state(state["extra"])
    if role.optimizer is None:
        return
    if with_optimizer:
        load_optimizer_state(role.optimizer, state["optimizer"])
        role.scheduler.load_state_dict(state["scheduler"])
    else:  # the optimizer's main (fp32) params must follow the freshly loaded weights
        role.optimizer.reload_model_params()


def loads_merged(role, path: Path, extra: dict, with_optimizer: bool) -> bool:
    """Whether a role without adapters is loading a LoRA checkpoint (common state `extra`) as a
    frozen model, its base with the adapters merged (True); a CheckpointError when the checkpoint
    cannot be resumed by this role: adapters of another shape, or adapters on one side only."""
    from megatron_rlhf.checkpoint.validate import CheckpointError

    saved = extra.get("lora")
    lora = getattr(role, "lora", None)
    fix = "set the lora.* settings of the run that wrote it, or start the stage afresh (checkpoint.resume=false)"
    if saved and lora is None and not with_optimizer:
        return True
    if bool(saved) != (lora is not None):
        raise CheckpointError(f"{path}: written {'with' if saved else 'without'} LoRA adapters, loaded by a role "
                              f"{'without' if saved else 'with'} them: {fix}")
    if saved and (saved["rank"], list(saved["targets"])) != (lora.rank, list(role.lora_targets)):
        raise CheckpointError(f"{path}: LoRA adapters of rank {saved['rank']} on {saved['targets']}, this run has "
                              f"lora.rank={lora.rank} on {role.lora_targets}: {fix}")
    return False


def load_extra_state(path: str | Path) -> dict:
    """A role checkpoint's non-tensor state (Role.extra_state, e.g. a reward model's
    normalisation), without building the role."""
    with restricted_dcp_unpickling(path):
        return dist_checkpointing.load_common_state_dict(str(path)).get("extra", {})


def load_model_weights(role, path: str | Path, skip_prefixes: tuple[str, ...] = (), base_only: bool = False) -> list[str]:
    """Collective. Only the model weights of the checkpoint at `path`, at this process's
    layout; parameters whose names start with `skip_prefixes` keep their current values
    (e.g. a reward model initialised from an SFT checkpoint keeps its fresh value head).
    A LoRA checkpoint gives the model it trained: the weights of its base checkpoint (itself
    possibly a LoRA checkpoint) with its adapters merged in, W + (alpha/rank) B A, and the other
    weights it trained (a value head). A LoRA role's own adapters are never read (they start
    fresh, or come from its own checkpoint); with `base_only` its other trained weights (a value
    head) are not either: a resumed run has them already. Returns the skipped parameter names."""
    path = Path(path)
    skipped, trained_changed = _load_weights(role, path, skip_prefixes, base_only)
    # The optimizer's main (fp32) copies follow the loaded trained weights; a LoRA base alone
    # leaves them as they are (after a resume they are the checkpoint's, not bf16-rounded ones).
    if role.optimizer is not None and trained_changed:
        role.optimizer.reload_model_params()
    if getattr(role, "lora", None) is not None:
        role.lora_base = str(path.resolve())  # absolute: export may run from elsewhere
    return skipped


def _load_weights(role, path: Path, skip_prefixes: tuple[str, ...], base_only: bool) -> tuple[list[str], bool]:
    """load_model_weights' work: (skipped names, whether a weight the role trains changed)."""
    from megatron_rlhf.checkpoint.validate import CheckpointError
    from megatron_rlhf.models.lora import is_adapter

    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    check_architecture(role, path)
    sharded = role.module.sharded_state_dict()
    lora_role = getattr(role, "lora", None) is not None

    def own(key: str) -> bool:  # a weight only the role's own checkpoint holds
        return is_adapter(key) or (base_only and key.startswith(role.trained_prefixes))

    skipped = [k for k in sharded if k.startswith(skip_prefixes) or own(k)]
    wanted = {k: v for k, v in sharded.items() if k not in skipped}
    def trains(loaded: dict) -> bool:  # whether `loaded` changed a weight the role trains
        return any(not lora_role or trained_by_lora(role, k) for k in loaded)

    extra = load_extra_state(path)
    if not extra.get("lora"):
        loaded = _read(path, wanted)
        missing, unexpected = role.module.load_state_dict(loaded, strict=False)
        missing = [k for k in missing if not k.startswith(skip_prefixes) and not k.endswith("_extra_state") and not own(k)]
        if missing or unexpected:
            raise RuntimeError(f"{path}: weights do not match the model: missing {missing}, unexpected {unexpected}")
        return skipped, trains(loaded)
    base = extra.get("lora_base")
    if not base or not Path(base).is_dir():
        raise CheckpointError(f"{path}: a LoRA adapter checkpoint whose base checkpoint ({base}) is missing; restore "
                              "it there: the adapters only apply to the weights they were trained on")
    _, changed = _load_weights(role, Path(base), skip_prefixes, base_only)
    with restricted_dcp_unpickling(path):
        held = set(dist_checkpointing.load_tensors_metadata(str(path)))
    heads = {k: v for k, v in wanted.items() if getattr(v, "key", None) in held}  # (wanted has no adapters)
    loaded = _read(path, heads)  # what the LoRA run trained in full (a value head); collective, maybe empty here
    role.module.load_state_dict(loaded, strict=False)
    changed = changed or trains(loaded)
    merged = merge_adapters(role, path, extra["lora"], skip_prefixes)
    return skipped, changed or (merged and not lora_role)  # a LoRA role's base is not trained


def _read(path: Path, sharded: dict) -> dict:
    with restricted_dcp_unpickling(path):
        loaded = dist_checkpointing.load(sharded, str(path))
    return {k: v for k, v in loaded.items() if k in sharded}  # without the checkpoint's common state


@torch.no_grad()
def merge_adapters(role, path: Path, lora: dict, skip_prefixes: tuple[str, ...] = ()) -> bool:
    """Collective. Add the LoRA checkpoint's (alpha/rank) B A to the weights they adapt, read at
    this layout through adapters of its shape borrowed for the purpose (models.lora). Layers
    under `skip_prefixes` are left alone; a value model never takes a policy's LM-head adapter.
    Returns whether a weight changed."""
    from megatron_rlhf.models.lora import OUTPUT, borrowed_adapters, is_adapter

    module = role.module
    targets = [t for t in lora["targets"] if not (t == OUTPUT and role.value_head)]
    names = {id(m): n for n, m in module.named_modules()}
    with borrowed_adapters(module, int(lora["rank"]), float(lora["alpha"]), targets) as layers:
        sharded = {k: v for k, v in module.sharded_state_dict().items() if is_adapter(k) and not k.startswith(skip_prefixes)}
        loaded = _read(path, sharded)  # collective: also where this stage has nothing to read
        _, unexpected = module.load_state_dict(loaded, strict=False)
        if unexpected:
            raise RuntimeError(f"{path}: unexpected adapter weights {unexpected}")
        merged = [layer for layer in layers if f"{names[id(layer)]}.lora_A" in loaded]
        for layer in merged:
            layer.weight.add_(layer.lora_delta())
    return bool(merged)
