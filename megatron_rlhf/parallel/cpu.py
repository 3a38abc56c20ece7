"""The only place that adapts megatron-core to run on CPU with gloo.

megatron-core assumes a CUDA device in a handful of places (verified against 0.19.2; see
shared/design/MEGATRON_ON_CPU.md). Each adaptation below maps one of them to its CPU
equivalent. `apply()` does nothing when CUDA is available, so GPU runs use megatron-core
untouched. Nothing here changes numerics: the same kernels run, only device plumbing moves.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from megatron_rlhf.attention_masks import visible_keys

_applied = False
_mode: TorchFunctionMode | None = None
_CPU = torch.device("cpu")


def needed() -> bool:
    return not torch.cuda.is_available()


def is_applied() -> bool:
    return _applied


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # cuda ordinal


class _CudaToCpu(TorchFunctionMode):
    """Rewrites tensor calls that name the CUDA device so they run on CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Hot path: every torch call of the process comes through here; keep it short.
        if func in _TENSOR_METHODS:
            return _TENSOR_METHODS[func](func, args, kwargs or {})
        if kwargs:
            device = kwargs.get("device")
            # Literal device="cuda" (schedules.py:749/1121/2292, transformer/utils.py:39,
            # optimizer.py:315/690, clip_grads.py:96) and pinned host buffers: plain CPU memory.
            if (device is not None and _is_cuda(device)) or kwargs.get("pin_memory"):
                kwargs = dict(kwargs)
                if device is not None and _is_cuda(device):
                    kwargs["device"] = _CPU
                kwargs.pop("pin_memory", None)
            return func(*args, **kwargs)
        return func(*args)


def _stay_on_cpu(func, args, kwargs):
    # `.cuda()` / `.pin_memory()` (optimizer.py reload, distrib_optimizer.py:1374): no-op.
    return args[0]


def _cuda_type_name(func, args, kwargs):
    # Type strings: distrib_optimizer.py:466, optimizer.py:1028, clip_grads.py:174 accept only
    # 'torch.cuda.*Tensor'; report CPU tensors under their CUDA names.
    name = func(*args, **kwargs)
    if len(args) == 1 and not kwargs and ".cuda." not in name:
        return name.replace("torch.", "torch.cuda.", 1)
    return name


def _to_cpu(func, args, kwargs):
    # `.to("cuda")` / `.to(device="cuda")`: stay on CPU.
    if len(args) > 1 and _is_cuda(args[1]):
        args = (args[0], _CPU, *args[2:])
    if _is_cuda(kwargs.get("device")):
        kwargs = {**kwargs, "device": _CPU}
    return func(*args, **kwargs)


_TENSOR_METHODS = {
    torch.Tensor.cuda: _stay_on_cpu,
    torch.Tensor.pin_memory: _stay_on_cpu,
    torch.Tensor.type: _cuda_type_name,
    torch.Tensor.to: _to_cpu,
}


class _Stream:
    """Stand-in for torch.cuda.Stream: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event or _Event()


class _Event:
    """Stand-in for torch.cuda.Event (inference/text_generation_controller.py)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _assert_not_none(tensor) -> None:
    assert tensor is not None


@contextlib.contextmanager
def hot_path():
    """Model compute without the device-rewriting mode: a Python __torch_function__ on every
    op of a forward and backward costs ~10% of a decode step of a small model. Inside model
    compute megatron names the device only through torch.cuda.current_device() (patched) and
    the two mask builders replaced in apply(), so the mode has nothing to rewrite there. A
    no-op on GPU, when the adaptations are not applied, or when another mode is on top."""
    stack = torch.overrides._get_current_function_mode_stack()
    if not (_applied and stack and stack[-1] is _mode):
        yield
        return
    with torch.overrides._pop_mode_temporarily():
        yield


def _without_mode(fn):
    def run(*args, **kwargs):
        with hot_path():
            return fn(*args, **kwargs)

    run.__wrapped__ = fn
    return run


# Stand-ins for megatron's mask builders (transformer/utils.py), on CPU and True = masked as
# theirs; the mask itself comes from the one builder the SDPA core attention uses.
def _causal_mask(sq: int) -> torch.Tensor:
    return ~visible_keys(sq, sq)


def _sliding_window_causal_mask(sq: int, skv: int, window_size) -> torch.Tensor:
    return ~visible_keys(sq, skv, tuple(window_size))


def _pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """megatron's get_pos_emb_on_this_cp_rank (rope_utils.py:48) with its chunk index on the
    embedding's device: megatron pins it in host memory and moves it with .cuda(). The same
    load-balanced pick of chunks r and 2 x CP - 1 - r."""
    cp, rank = cp_group.size(), cp_group.rank()
    chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp, -1, *pos_emb.shape[seq_dim + 1:])
    mine = chunks.index_select(seq_dim, torch.tensor([rank, 2 * cp - rank - 1], device=pos_emb.device))
    return mine.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 1:])


def _one_rank_is_identity(collective):
    """megatron's DistributedOptimizer reduce-scatters the whole gradient buffer and all-gathers
    the whole parameter buffer every step, also over a one-rank data-parallel group (DP=1), where
    each is an identity: its output is a view of its input (param_and_grad_buffer.py
    start_grad_sync / start_param_sync). gloo still runs it through its own buffers, at ~1 ns per
    element, a full copy's cost or more (measured, 0.6M and 6M fp32 elements); so a one-rank call
    whose output already holds the input returns at once (a plain copy otherwise). Exact; groups
    of two or more ranks go to gloo as before."""

    def call(output, input, group=None, async_op=False, **kwargs):
        if dist.get_world_size(group) != 1:
            return collective(output, input, group=group, async_op=async_op, **kwargs)
        if not (output.data_ptr() == input.data_ptr() and output.numel() == input.numel()):
            output.copy_(input)
        return _DoneWork() if async_op else None

    call.__wrapped__ = collective
    return call


def _split_sizes_as_lists(all_to_all_single):
    """megatron's MoE all-to-all (tensor_parallel/mappings.py: _AllToAll) passes its split sizes
    as CPU tensors or numpy arrays; NCCL's binding takes them, gloo's accepts only lists."""

    def call(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        as_list = lambda sizes: sizes.tolist() if hasattr(sizes, "tolist") else sizes  # noqa: E731
        return all_to_all_single(output, input, as_list(output_split_sizes), as_list(input_split_sizes),
                                 group=group, async_op=async_op)

    call.__wrapped__ = all_to_all_single
    return call


def _uneven_all_gather(all_gather):
    """Expert tensor parallelism (ETP > 1) gathers each rank's routed tokens, a different number
    per rank (tensor_parallel/mappings.py: _gather_along_first_dim with output_split_sizes, a list
    all_gather); NCCL takes unequal first dimensions, gloo refuses them ("invalid tensor size").
    Unequal ones are padded to the largest, gathered and trimmed: the same values arrive."""

    def call(tensor_list, tensor, group=None, async_op=False):
        sizes = [t.shape[0] if t.dim() else 0 for t in tensor_list]
        if len(set(sizes)) <= 1 or tensor.dim() == 0:
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)
        padded = [tensor.new_zeros((max(sizes), *tensor.shape[1:])) for _ in sizes]
        own = tensor.new_zeros((max(sizes), *tensor.shape[1:]))
        own[: tensor.shape[0]] = tensor
        all_gather(padded, own, group=group)
        for out, got, n in zip(tensor_list, padded, sizes):
            out.copy_(got[:n])
        return _DoneWork() if async_op else None

    call.__wrapped__ = all_gather
    return call


class _DoneWork:
    """The handle of a collective that had nothing to do."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def apply() -> bool:
    """Install the CPU adaptations once. Returns True when they are active."""
    global _applied, _mode
    if not needed():
        return False
    if _applied:
        return True
    from megatron.core.tensor_parallel import random as mpu_random

    # RNG tracker (tensor_parallel/random.py:104/135/303): reads/writes the CUDA generator;
    # on CPU the model-parallel RNG states live in the CPU generator instead.
    mpu_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mpu_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.manual_seed = torch.manual_seed  # lazily queued (never run) without a driver
    # torch.cuda.synchronize (p2p_communication.py:263/419, checkpointing): nothing to wait for.
    torch.cuda.synchronize = lambda *a, **k: None
    # torch.cuda.current_device() as a tensor device (p2p buffers, DDP/optimizer buffers).
    torch.cuda.current_device = lambda: _CPU
    # Streams (param_and_grad_buffer.py:632/686, distributed_data_parallel.py:297).
    torch.cuda.Stream = _Stream
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    # Events (inference/text_generation_controller.py): "dummy base class Event" otherwise.
    torch.cuda.Event = _Event
    # Empty-cache and memory queries (DDP offload, optimizer offload): no device cache.
    torch.cuda.empty_cache = lambda: None
    # PP inference p2p (inference/communication_utils.py:28) asserts `tensor.is_cuda`.
    from megatron.core.inference import communication_utils

    communication_utils._is_cuda = _assert_not_none
    # Model compute runs outside the mode (hot_path): the schedules' per-microbatch forward and
    # backward steps, and the default masks that the unfused softmax builds with device="cuda"
    # (transformer/utils.py:39/44) built on CPU instead.
    from megatron.core.fusions import fused_softmax
    from megatron.core.pipeline_parallel import schedules

    fused_softmax.get_default_causal_mask = _causal_mask
    fused_softmax.get_sliding_window_causal_mask = _sliding_window_causal_mask
    schedules.forward_step = _without_mode(schedules.forward_step)
    schedules.backward_step = _without_mode(schedules.backward_step)

    # RoPE's share of a context-parallel rank (runs inside model compute, outside the mode).
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    rope_utils.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank

    # One-rank reduce-scatter / all-gather of the DP=1 DistributedOptimizer: nothing to move.
    from megatron.core.distributed import param_and_grad_buffer as buffers

    buffers.dist_reduce_scatter_func = _one_rank_is_identity(buffers.dist_reduce_scatter_func)
    buffers.dist_all_gather_func = _one_rank_is_identity(buffers.dist_all_gather_func)

    # Expert parallelism's token all-to-all with split sizes gloo accepts.
    dist.all_to_all_single = _split_sizes_as_lists(dist.all_to_all_single)
    dist.all_gather = _uneven_all_gather(dist.all_gather)

    _mode = _CudaToCpu()
    _mode.__enter__()  # stays active for the life of the process
    _applied = True
    return True
