"""Where the vLLM engine runs and how its weights arrive (rollout.placement, rollout.engine_devices,
rollout.refit_transport; docs/rollout_placement.md).

The engine is a process started by its replica's engine rank (rollout/vllm_engine.py); on GPU it
sees the devices named here in CUDA_VISIBLE_DEVICES:
- colocated: its replica's devices, from the engine rank's own on (LOCAL_RANK + i), shared with
  the trainer (it sleeps while the trainer works);
- separate: devices of its own, rollout.engine_devices or, when empty, the devices after the
  trainer's local ones, one block of rollout.tensor_parallel per engine on the node.
Device ids are this node's as the trainer numbers them (torch.cuda device indices); when the
trainer itself runs under CUDA_VISIBLE_DEVICES they are translated through it, so the engine
gets the same physical devices.

The functions below are pure (arguments in, answer out) so that they are tested on CPU;
`engine_cuda_devices` gathers their arguments from the running trainer.
"""

from __future__ import annotations

import os

from megatron_rlhf.config import ConfigError, RolloutConfig


def refit_transport(rollout: RolloutConfig) -> str:
    """shm or broadcast: rollout.refit_transport, with auto resolved (broadcast when separate)."""
    if rollout.refit_transport != "auto":
        return rollout.refit_transport
    return "broadcast" if rollout.placement == "separate" else "shm"


def engine_device_ids(rollout: RolloutConfig, *, local_rank: int, local_world_size: int, engine_slot: int,
                      device_count: int) -> list[int]:
    """The device indices (as the trainer numbers them) of the engine started by local rank
    `local_rank`, the `engine_slot`-th engine of this node (0 for the first), on a node whose
    trainer runs `local_world_size` ranks and sees `device_count` devices. ConfigError naming the
    field when the devices do not exist or are the trainer's."""
    tp = rollout.tensor_parallel
    if rollout.placement == "colocated":
        return [local_rank + i for i in range(tp)]
    trainer = set(range(local_world_size))
    if rollout.engine_devices:
        if engine_slot:
            raise ConfigError(f"rollout.engine_devices={list(rollout.engine_devices)} names one engine's devices, and "
                              f"this node starts {engine_slot + 1} or more engines (one per data-parallel replica); "
                              "leave rollout.engine_devices empty (each engine then takes its own block after the "
                              "trainer's devices)")
        ids = list(rollout.engine_devices)
    else:
        start = local_world_size + engine_slot * tp
        ids = list(range(start, start + tp))
    taken = sorted(trainer & set(ids))
    if taken:
        raise ConfigError(f"rollout.placement=separate: the engine's devices {ids} include {taken}, which the trainer's "
                          f"{local_world_size} local ranks use (devices 0..{local_world_size - 1}); set "
                          "rollout.engine_devices to others")
    missing = [i for i in ids if i >= device_count]
    if missing:
        field = "rollout.engine_devices" if rollout.engine_devices else "rollout.engine_devices (empty: the devices " \
                                                                       "after the trainer's)"
        raise ConfigError(f"rollout.placement=separate: the engine of local rank {local_rank} needs devices {ids}, "
                          f"this node has {device_count} ({missing} do not exist); run fewer trainer ranks per node, "
                          f"set {field}, or rollout.placement=colocated")
    return ids


def cuda_visible_devices(ids: list[int], trainer_visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for a process that should see the trainer's devices `ids`, when the
    trainer itself sees `trainer_visible` (its CUDA_VISIBLE_DEVICES; None or empty: every device)."""
    if not trainer_visible:
        return ",".join(str(i) for i in ids)
    visible = [v.strip() for v in trainer_visible.split(",") if v.strip()]
    beyond = [i for i in ids if i >= len(visible)]
    if beyond:
        raise ConfigError(f"the vLLM engine needs devices {ids}, and the trainer sees only {len(visible)} "
                          f"(CUDA_VISIBLE_DEVICES={trainer_visible}); widen CUDA_VISIBLE_DEVICES or set "
                          "rollout.engine_devices / rollout.placement")
    return ",".join(visible[i] for i in ids)


def engine_slot(local_rank: int, engine_group_stride: int) -> int:
    """The engine rank `local_rank`'s place among this node's engines: engines are TP rank 0 (and
    context-parallel rank 0) of the first pipeline stage, and megatron's rank order puts tensor,
    then context, parallelism fastest, so they are every `engine_group_stride` (TP x CP)-th rank."""
    return local_rank // engine_group_stride


def engine_cuda_devices(rollout: RolloutConfig) -> str:
    """CUDA_VISIBLE_DEVICES of the engine this (engine) rank starts (on GPU)."""
    import torch
    from megatron.core import parallel_state as ps

    local = int(os.environ.get("LOCAL_RANK", "0"))
    stride = ps.get_tensor_model_parallel_world_size() * ps.get_context_parallel_world_size()
    ids = engine_device_ids(rollout, local_rank=local, local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                            engine_slot=engine_slot(local, stride), device_count=torch.cuda.device_count())
    return cuda_visible_devices(ids, os.environ.get("CUDA_VISIBLE_DEVICES"))
