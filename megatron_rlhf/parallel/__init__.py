"""Distributed start-up: process group, megatron `parallel_state`, seeds.

Reads the launcher's environment (torchrun, or Slurm's srun with one task per device),
picks NCCL on GPU and gloo on CPU, and initialises megatron-core's model-parallel groups
(TP x PP, data-parallel size inferred). On CPU the adaptations in `cpu.py` are applied first.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron_rlhf.config import ConfigError, ParallelConfig
from megatron_rlhf.parallel import cpu
from megatron_rlhf.parallel.collectives import any_rank  # noqa: F401  (re-exported: one 'any rank' for all)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_dist_env(environ: dict[str, str] | None = None) -> DistEnv:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; srun sets SLURM_PROCID/NTASKS/LOCALID.

    A bare `python` process is rank 0 of 1 on a free local port.
    """
    env = os.environ if environ is None else environ

    def first(*names: str, default: str) -> str:
        for name in names:
            if env.get(name):
                return env[name]
        return default

    world_size = int(first("WORLD_SIZE", "SLURM_NTASKS", default="1"))
    rank = int(first("RANK", "SLURM_PROCID", default="0"))
    local_rank = int(first("LOCAL_RANK", "SLURM_LOCALID", default="0"))
    addr = env.get("MASTER_ADDR")
    if addr is None and env.get("SLURM_JOB_NODELIST"):  # srun without a wrapper script
        addr = first_slurm_host(env["SLURM_JOB_NODELIST"])
    addr = addr or "127.0.0.1"
    port = env.get("MASTER_PORT")
    if port is None and env.get("SLURM_JOB_ID"):  # the same rule as slurm/stage.sh
        port = str(20000 + int(env["SLURM_JOB_ID"]) % 20000)
    if port is None:
        if world_size > 1:
            raise ConfigError("MASTER_PORT is not set: launch with torchrun, or export it in the sbatch script")
        port = str(_free_port())
    return DistEnv(rank, world_size, local_rank, addr, int(port))


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm hostlist ("gpu[017-018,020],cpu1" -> "gpu017"), like
    `scontrol show hostnames | head -1` without needing Slurm's config."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first top-level comma ends the first group
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            end = i
            break
    group = nodelist[:end]
    while "[" in group:  # expand each bracket to its first value, keeping zero padding
        head, rest = group.split("[", 1)
        inside, tail = rest.split("]", 1)
        group = head + inside.split(",")[0].split("-")[0] + tail
    return group


def device_index(local_rank: int, visible_devices: int) -> int:
    """The CUDA device of the rank with this node-local index, among the `visible_devices` this
    process sees. Where every task sees the node's GPUs that is local_rank; a site that binds one
    GPU per task (srun --gpus-per-task=1, or a gres/cgroup setup exposing one device) shows each
    task only device 0, so local_rank itself would not exist past rank 0."""
    if visible_devices < 1:
        raise ConfigError("parallel.backend=nccl: this process sees no GPU (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); run on GPU nodes or set parallel.backend=gloo")
    return local_rank % visible_devices


def choose_backend(requested: str) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


# The parallel section this process started with (initialize): what models are built for.
_started: ParallelConfig | None = None
# MASTER_ADDR/MASTER_PORT initialize() set (a bare process's rendezvous): destroy() removes them, so
# that a process started later from this one (a test's subprocess, an in-process CLI call's) picks
# a free port of its own instead of this group's, whose store may still hold it.
_set_here: list[str] = []


def sequence_parallel() -> bool:
    """Whether models built now use sequence parallelism (parallel.sequence_parallel, resolved
    for the TP size initialize started)."""
    return _started is not None and _started.sequence_parallel_on


def initialize(p: ParallelConfig, seed: int) -> DistEnv:
    """Start torch.distributed and megatron's parallel_state for the parallel section `p`; seed
    all RNGs with `seed`. The config is the caller's to validate first, for this launch's world
    size (config.validate(cfg, world_size=read_dist_env().world_size)): a config error must
    come before any process group is made."""
    from megatron.core import parallel_state

    global _started
    env = read_dist_env()
    backend = choose_backend(p.backend)
    if backend == "nccl":
        torch.cuda.set_device(device_index(env.local_rank, torch.cuda.device_count()))
    else:
        cpu.apply()
    if not dist.is_initialized():
        for name, value in (("MASTER_ADDR", env.master_addr), ("MASTER_PORT", str(env.master_port))):
            if name not in os.environ:  # a bare process's own (a free port): taken back by destroy()
                os.environ[name] = value
                _set_here.append(name)
        dist.init_process_group(
            backend=backend, rank=env.rank, world_size=env.world_size,
            timeout=timedelta(minutes=int(os.environ.get("MEGATRON_RLHF_DIST_TIMEOUT_MIN", "30"))),
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=p.tensor_parallel,
            pipeline_model_parallel_size=p.pipeline_parallel,
            context_parallel_size=p.context_parallel,
            expert_model_parallel_size=p.expert_parallel,
            expert_tensor_parallel_size=p.expert_tensor_parallel_size,
        )
    _started = p
    seed_everything(seed)
    return env


def seed_everything(seed: int) -> None:
    """Same seed on every rank for python/numpy/torch; megatron's tracker adds TP/PP offsets."""
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    global _started
    _started = None
    while _set_here:
        os.environ.pop(_set_here.pop(), None)
    if not dist.is_initialized():
        return
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
