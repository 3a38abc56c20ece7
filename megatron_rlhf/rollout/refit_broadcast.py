"""Refit by collective broadcast (rollout.refit_transport=broadcast; docs/rollout_placement.md):
each bucket of full HF tensors (rollout/refit.py: stream_hf_weights) goes from the trainer's
engine rank straight to the engine's workers by torch.distributed broadcasts: NCCL device to
device on GPU (the engine on devices of its own, rollout.placement=separate), gloo on CPU. The
tensors stay where the trainer holds them: nothing is copied to the host on this side.

The group is private: a TCPStore the engine rank hosts (a free port on 127.0.0.1: the engine is
its child on the same node) and a process group built on it directly, rank 0 the engine rank,
ranks 1..rollout.tensor_parallel the engine's workers (vllm_worker.RefitWorker, each receives
every tensor and loads its own shard). Neither the trainer's default group nor megatron's
groups take part, and the engine's own torch.distributed world is untouched.

One bucket: the header (names, shapes, dtypes) goes by `collective_rpc("refit_broadcast_bucket")`,
which returns only once the workers have received, verified and loaded the bucket, so the rpc
runs on a thread (vllm_process.PendingGeneration) while this (main) thread broadcasts the
tensors and then their checksums (vllm_worker.checksum_tensor, computed on the device). The
workers receive everything announced before checking anything, so a bad bucket leaves the two
sides in step, and the error comes back through the rpc. Every wait is bounded by
rollout.engine_timeout_seconds (the group's timeout, the rpc's); errors name the transport.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_rlhf.rollout.vllm_process import EngineError, PendingGeneration
from megatron_rlhf.rollout.vllm_worker import broadcast, checksum_tensor, refit_group

HOST = "127.0.0.1"
TRANSPORT = "rollout.refit_transport=broadcast"
# Joining takes seconds; a group that has not formed by then will not (an engine that failed to join)
JOIN_TIMEOUT_SECONDS = 300.0


def wire_tensors(bucket: dict[str, torch.Tensor]) -> tuple[dict, list[torch.Tensor]]:
    """What a bucket is sent as: its header (names, shapes, dtypes; host metadata only, no device
    sync) and the tensors to broadcast, in order: each tensor (contiguous, on its own device),
    then their checksums (int64 [n] on the same device)."""
    tensors = {name: t.detach().contiguous() for name, t in bucket.items()}
    header = {"names": list(tensors), "shapes": [list(t.shape) for t in tensors.values()],
              "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()]}
    return header, [*tensors.values(), checksum_tensor(tensors)]


def rpc_in_background(llm, method: str, *args) -> PendingGeneration:
    """The engine workers' `method(*args)` running on a thread (vLLM's collective_rpc blocks until
    every worker returns, and they return only after the broadcasts this thread makes)."""
    return PendingGeneration(lambda: llm.collective_rpc(method, args=args), f"refit ({method}, broadcast transport)")


class BroadcastRefit:
    """The trainer's end of the broadcast transport to the engine `llm` with `workers` workers
    (rollout.tensor_parallel); `timeout` seconds bound every wait. Joins the group on creation
    (collective with the workers); EngineError naming the transport when it cannot."""

    def __init__(self, llm, workers: int, timeout: float):
        self.llm, self.timeout = llm, timeout
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        join = min(timeout, JOIN_TIMEOUT_SECONDS)
        store = dist.TCPStore(HOST, 0, None, is_master=True, timeout=timedelta(seconds=join), wait_for_workers=False)
        pending = rpc_in_background(llm, "refit_broadcast_join", HOST, store.port, workers + 1, backend, timeout)
        try:
            self.group = refit_group(store, HOST, 0, workers + 1, backend, timedelta(seconds=timeout), self.device)
        except Exception as e:  # noqa: BLE001  (the engine's own error, when it has one, says more)
            raise EngineError(f"{TRANSPORT}: the engine's workers did not join the refit group ({backend}, "
                              f"{HOST}:{store.port}) within {join:g} s: {_engine_side(pending, e)}") from e
        self._store = store  # kept alive: the workers' store clients connect to it
        ranks = _wait(pending, timeout, "joining the refit group")
        if sorted(ranks) != list(range(1, workers + 1)):
            raise EngineError(f"{TRANSPORT}: the engine's workers joined as ranks {ranks}, expected 1..{workers} "
                              "(one per rollout.tensor_parallel rank)")
        self.broken = None

    def send(self, bucket: dict[str, torch.Tensor]) -> int:
        """Broadcast one bucket and wait until the workers loaded it; returns its bytes."""
        if not bucket:
            return 0
        if self.broken:
            raise EngineError(f"{TRANSPORT}: the refit group broke in an earlier refit ({self.broken}); restart the "
                              "stage (it resumes from its last checkpoint)")
        header, tensors = wire_tensors(bucket)
        pending = rpc_in_background(self.llm, "refit_broadcast_bucket", header["names"], header["shapes"],
                                    header["dtypes"])
        try:
            for t in tensors:
                broadcast(self.group, t, timedelta(seconds=self.timeout))
        except Exception as e:  # noqa: BLE001
            self.broken = f"{type(e).__name__}: {e}"[:300]
            raise EngineError(f"{TRANSPORT}: broadcasting a bucket of {len(bucket)} tensors failed: "
                              f"{_engine_side(pending, e)}") from e
        _wait(pending, self.timeout, "receiving a bucket")
        return sum(t.numel() * t.element_size() for t in tensors[:-1])


def _wait(pending: PendingGeneration, timeout: float, what: str):
    try:
        return pending.wait(timeout)
    except Exception as e:  # noqa: BLE001
        raise EngineError(f"{TRANSPORT}: the engine failed {what}: {e}") from e


def _engine_side(pending: PendingGeneration, error: Exception) -> str:
    """The engine's error when its rpc has failed by now (it says more than a broken socket),
    else `error`'s."""
    for _ in range(20):  # the engine's rpc fails moments after its side of the group
        if pending.done():
            break
        time.sleep(0.05)
    if pending.done() and pending.error is not None:
        return f"{pending.error} (on this side: {type(error).__name__}: {str(error)[:200]})"
    return f"{type(error).__name__}: {error}"
