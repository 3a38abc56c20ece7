"""megatron-core DDP + DistributedOptimizer wiring, and the checkpoint fixes it needs.

Without Transformer Engine or apex, megatron-core 0.19.2 falls back to torch AdamW, whose
per-parameter `step` state its DistributedOptimizer checkpoint code mishandles. The fixes
below are not CPU-specific: any run without TE/apex fused Adam needs them.

megatron builds that torch AdamW with neither `fused` nor `foreach`, which on CPU means torch's
single-tensor loop (a handful of kernels per parameter); `use_fused_adam` switches CPU groups to
torch's fused CPU kernel (as megatron's own CPU-offload optimizer builds its CPU AdamW), at build
and again after every checkpoint load.

At data-parallel size 1 the DistributedOptimizer shards nothing; megatron's non-distributed
optimizer (`optimizer.use_distributed_optimizer=false`) skips its one-rank param all-gather and
bookkeeping, though with the fused kernel benchmarks/train_step.py finds their steps within
noise of each other at the vs-TRL shape. The default stays the DistributedOptimizer at DP=1
too, because megatron-core 0.19.2 cannot load one's checkpoint into the other.
A non-distributed checkpoint has no `optimizer.state.param.*` tensors (the DistributedOptimizer's
fp32 main params), so a DistributedOptimizer's load plan fails (KeyError "optimizer.state.param.
<weight> from model not in state dict"); the other way the Adam moments are there (the same
`optimizer.state.exp_avg(_sq).*` keys) but the common state is the DistributedOptimizer's (param
groups under `optimizer`, `step` in them) and FP32Optimizer.load_state_dict raises ValueError
"Could not find parameter group with key (...) in loaded checkpoint". Bridging them would take a
checkpoint converter of our own; without one a run that changed DP between 1 and more would lose
its optimizer state.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import replace
from functools import cache, partial

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_rlhf.config import OptimizerConfig

# Reshardable across TP, PP and DP. ("fully_sharded_model_space" raises on flattened ranges;
# "dp_reshardable" only allows DP changes.)
OPTIMIZER_CKPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def wrap_ddp(model: torch.nn.Module, o: OptimizerConfig) -> DistributedDataParallel:
    """DDP for the optimizer `build_optimizer` makes from the same `o`: a DistributedOptimizer
    needs DDP's sharded (reduce-scatter) gradient buffers, a plain one all-reduced ones."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=o.use_distributed_optimizer,
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def build_optimizer(ddp_model: DistributedDataParallel, o: OptimizerConfig, params_dtype: str):
    dtype = getattr(torch, params_dtype)
    config = MegatronOptimizerConfig(
        optimizer="adam",
        lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        use_distributed_optimizer=o.use_distributed_optimizer,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
    )
    optimizer = get_megatron_optimizer(config, [ddp_model])
    use_fused_adam(optimizer)
    return optimizer


def build_scheduler(optimizer, o: OptimizerConfig, total_steps: int) -> OptimizerParamScheduler:
    """Linear warmup over `warmup_steps`, then `lr_decay_style` down to min_lr at `total_steps`."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if o.warmup_steps else o.lr,
        max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=o.warmup_steps,
        lr_decay_steps=max(total_steps, o.warmup_steps + 1),
        lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay, end_wd=o.weight_decay,
        wd_incr_steps=max(total_steps, 1), wd_incr_style="constant",
    )


def _inner_optimizers(optimizer):
    return getattr(optimizer, "chained_optimizers", [optimizer])


def _torch_adam(opt) -> torch.optim.Optimizer | None:
    inner = getattr(opt, "optimizer", None)
    return inner if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) else None


@cache
def _torch_has_fused_cpu_adam() -> bool:
    try:
        torch.optim.AdamW([torch.zeros(1)], fused=True)
    except (RuntimeError, TypeError, ValueError):
        return False
    return True


def use_fused_adam(optimizer) -> None:
    """Run every torch Adam/AdamW param group whose parameters are all on CPU on torch's fused
    kernel (foreach off), and leave the others on torch's default, as megatron builds them.
    TE/apex FusedAdam is left alone.

    On CPU the fused kernel is the same AdamW (equal within float32 rounding) and cheaper than
    the single-tensor loop. On CUDA torch's default is already its multi-tensor (foreach) path,
    GPU runs normally get TE's FusedAdam from megatron, and torch's fused kernel keeps `step` on
    the parameters' device where the DistributedOptimizer fixes below create and load it on the
    host: untried on GPU, so a CUDA group keeps torch's default, also when a checkpoint written
    on CPU says fused. Called at build and after every checkpoint load: torch's
    `Optimizer.load_state_dict` replaces each param group by the saved one, flags included, so a
    checkpoint written without the flag (or before it existed) would bring the slow path back.
    """
    for opt in _inner_optimizers(optimizer):
        adam = _torch_adam(opt)
        if adam is None or not _torch_has_fused_cpu_adam():
            continue
        for group in adam.param_groups:
            on_cpu = all(p.device.type == "cpu" and p.is_floating_point() for p in group["params"])
            group["fused"], group["foreach"] = (True, False) if on_cpu else (None, None)


def materialize_state(optimizer) -> None:
    """Bug (a): saving or loading a never-stepped optimizer asserts `len(steps) == 1` over its
    empty state. Create the state torch AdamW would create lazily (zeros, step 0): the first
    step is unchanged, and a load overwrites it."""
    for opt in _inner_optimizers(optimizer):
        adam = _torch_adam(opt)
        if adam is None or adam.state:
            continue
        for group in adam.param_groups:
            for p in group["params"]:
                adam.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }


def optimizer_sharded_state_dict(optimizer, model_sharded_state_dict, is_loading: bool):
    materialize_state(optimizer)
    with nullcontext() if is_loading else live_param_state_at_dp1(optimizer):
        return optimizer.sharded_state_dict(
            model_sharded_state_dict, is_loading=is_loading, metadata=OPTIMIZER_CKPT_METADATA
        )


@contextmanager
def live_param_state_at_dp1(optimizer):
    """While saving: every DistributedOptimizer of `optimizer` that shards over a single rank
    builds its `fully_reshardable` parameter state from its own tensors (`_live_param_state`)
    instead of megatron's `sharded_param_state_fully_reshardable`, which first gathers them into
    fp32 copies of the whole buffer (param, exp_avg, exp_avg_sq: 3x the weights, kept until the
    save ends, and ~9x while gathering; measured at the 135M shape, 621 MiB of fp32 weights:
    +5.5 GiB at its peak, +1.8 GiB kept). The checkpoint is the same: the same keys, shapes,
    dtypes and replicas, and bitwise the same values (tests/test_checkpoint_safety.py). At
    DP > 1 the gather is the format's resharding and stays; so do optimizers whose state is
    not the full fp32 tensors."""
    patched = [opt for opt in _inner_optimizers(optimizer) if _holds_whole_fp32_state(opt)]
    for opt in patched:
        opt.sharded_param_state_fully_reshardable = partial(_live_param_state, opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt.sharded_param_state_fully_reshardable  # megatron's method again


def _holds_whole_fp32_state(opt) -> bool:
    """A DistributedOptimizer at data-parallel size 1 whose main params and Adam moments are,
    per model parameter, fp32 tensors of its full size: what megatron's gathered copies hold."""
    if not isinstance(opt, DistributedOptimizer) or opt.data_parallel_group.size() != 1:
        return False
    for buffer in opt.buffers:
        for model_param in buffer.param_index_map:
            tensors = opt._get_main_param_and_optimizer_states(model_param)
            for key in ("param", *opt.optimizer_state_keys):
                t = tensors.get(key)
                if t is None or t.dtype != torch.float32 or t.numel() != model_param.numel():
                    return False
    return True


def _live_param_state(opt, model_sharded_state_dict, is_loading: bool = False, metadata: dict | None = None) -> dict:
    """megatron's `DistributedOptimizer.sharded_param_state_fully_reshardable` (0.19.2) at
    data-parallel size 1, saving: the same sharded tensors, over the live main params and Adam
    moments (reshaped views) instead of slices of gathered copies."""
    assert not is_loading
    model_sharded_state_dict, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    sharded_by_param = {sh.data: sh for sh in nested_values(model_sharded_state_dict)}
    state, param_idx = {}, 0
    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        assert len(gbuf_range_maps) == 1, "single dtype supported, for now."  # as megatron's
        for model_param in opt.buffers[gbuf_idx].param_index_map:
            sharded = sharded_by_param[model_param]
            assert sharded.flattened_range is None, f"Flattened model tensor not supported ({sharded})"
            live = opt._get_main_param_and_optimizer_states(model_param)
            tensors = {}
            for key in ("param", *opt.optimizer_state_keys):
                data = live[key].detach().view(sharded.data.shape)
                fields = dict(key=f"optimizer.state.{key}.{sharded.key}", data=data, dtype=data.dtype,
                              replica_id=sharded.replica_id)
                if isinstance(sharded, ShardedTensorFactory):
                    fields.pop("dtype")
                tensors[key] = replace(sharded, **fields)
                tensors[key].validate_metadata_integrity()
            state[param_idx] = tensors
            param_idx += 1
    return state


_PARAM_STATE_LOADERS = {
    "fully_reshardable": "load_parameter_state_from_fully_reshardable",
    "dp_reshardable": "load_parameter_state_from_dp_reshardable",
}


def load_optimizer_state(optimizer, loaded_state) -> None:
    """Load a DistributedOptimizer state dict, working around bugs (b) and (c).

    (b) megatron copies every tensor of the live Adam state from the checkpoint's parameter
    state, but that carries no per-parameter `step` (it is kept in the param groups), so the
    load raises KeyError: 'step'. We load the param groups first, set `step` aside while the
    parameter state is copied in, then give each parameter its own `step` back (c).
    """
    parts = _inner_optimizers(optimizer)
    states = [loaded_state] if len(parts) == 1 else [v for _, v in sorted(loaded_state.items())]
    for opt, state in zip(parts, states):
        adam = _torch_adam(opt)
        if adam is None or "param_state" not in state:
            opt.load_state_dict(state)  # TE/apex fused Adam keeps no per-parameter step
            continue
        state = dict(state)
        param_state = state.pop("param_state")
        sharding = state.pop("param_state_sharding_type")
        if sharding not in _PARAM_STATE_LOADERS:
            raise ValueError(f"optimizer checkpoint sharding type {sharding!r} is not supported; "
                             f"save with {OPTIMIZER_CKPT_METADATA}")
        opt.load_state_dict(state)  # param groups + grad scaler; sets one shared `step`
        steps = {p: s.pop("step") for p, s in adam.state.items() if "step" in s}
        getattr(opt, _PARAM_STATE_LOADERS[sharding])(param_state)
        for p, step in steps.items():
            adam.state[p]["step"] = step.detach().clone()
    if len(parts) > 1:
        optimizer._synchronize_steps()
    use_fused_adam(optimizer)  # the loaded param groups replaced the live ones, flags included
