"""Low-rank adapters (LoRA, Hu et al. 2021) on megatron-core's tensor-parallel linear layers.

    y = base(x) + (alpha / rank) * B(A(dropout(x)))      A: [rank, in], B: [out, rank]

A is initialised as in the paper's reference code (kaiming-uniform, a = sqrt(5)), B = 0, so a
fresh adapter leaves the model unchanged. Each adapted layer's class is swapped for a subclass
that adds the two parameters (`<layer>.lora_A`, `<layer>.lora_B`) and the adapter term; the base
parameters keep their names, so checkpoints, refit and export see the usual keys.

Sharding follows the base layer, with megatron's TP region operators, so gradients do not
depend on TP:
- column-parallel (QKV, FC1; weight [out/TP, in]): A is replicated, B is split by output rows
  like the weight (its rows follow the fused QKV / SwiGLU layouts). The rank-r activation goes
  through `copy_to_tensor_model_parallel_region` (identity forward, all-reduce backward), so
  A's gradient is the full one on every TP rank.
- row-parallel (attention output, FC2; weight [out, in/TP], input split): A is split by input
  columns like the weight, B is replicated; the partial rank-r activations are summed with
  `reduce_from_tensor_model_parallel_region` before B.
So the merged weight W + (alpha/rank) B A of each shard is computed from the shard alone.
Under sequence parallelism the rank-r activations follow the base layer instead: gathered along
the sequence before a column-parallel B, reduce-scattered along it after a row-parallel A; the
replicated matrix then sees one slice of the sequence and its gradient is summed over TP.

Transformer Engine's spec fuses the RMSNorm into QKV and FC1 (TELayerNormColumnParallelLinear):
the adapter then normalises the input with the layer's own norm weight, so it sees what the
fused GEMM sees (`normalized_input`).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

# config name -> (attribute of the transformer layer's submodule, column-parallel?)
TARGETS = {
    "qkv": ("self_attention", "linear_qkv", True),
    "proj": ("self_attention", "linear_proj", False),
    "fc1": ("mlp", "linear_fc1", True),
    "fc2": ("mlp", "linear_fc2", False),
}
# The policy's LM head (vocab-parallel, column-parallel like QKV); untied embeddings only. A
# small model's policy moves mostly there (measured: PPO on the default task with the head and
# embedding frozen gains ~0.0 gold instead of 0.5).
OUTPUT = "output"


def normalized_input(layer, x: torch.Tensor) -> torch.Tensor:
    """The input a layernorm-fused linear layer (TE) multiplies: its norm applied to x. Plain
    linear layers see x itself."""
    weight = getattr(layer, "layer_norm_weight", None)
    if weight is None:
        return x
    cfg = layer.config
    if getattr(cfg, "layernorm_zero_centered_gamma", False):
        weight = weight + 1
    if cfg.normalization == "RMSNorm":
        return F.rms_norm(x, (x.size(-1),), weight, cfg.layernorm_epsilon)
    return F.layer_norm(x, (x.size(-1),), weight, getattr(layer, "layer_norm_bias", None), cfg.layernorm_epsilon)


class LoRAMixin:
    """Adds the adapter to a megatron (or TE) linear layer; see the module docstring."""

    lora_enabled = True

    def init_lora(self, rank: int, alpha: float, dropout: float, column: bool, swiglu: bool, seed: int) -> None:
        w = self.weight
        tp = parallel_state.get_tensor_model_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        out_local, in_local = w.shape
        full_in = in_local if column else in_local * tp
        # The full A from a seed of the layer's own, then this rank's columns: every layout
        # starts from the same adapter.
        gen = torch.Generator().manual_seed(seed)
        bound = 1.0 / math.sqrt(full_in)  # kaiming_uniform(a=sqrt(5)) as nn.Linear and the LoRA code
        a_full = torch.empty(rank, full_in).uniform_(-bound, bound, generator=gen)
        a = a_full if column else a_full[:, tp_rank * in_local:(tp_rank + 1) * in_local]
        self.lora_A = torch.nn.Parameter(a.to(device=w.device, dtype=w.dtype).contiguous())
        # out_local: this rank's rows (column-parallel) or the full output (row-parallel)
        self.lora_B = torch.nn.Parameter(torch.zeros(out_local, rank, device=w.device, dtype=w.dtype))
        split = self.lora_B if column else self.lora_A
        tensor_parallel.set_tensor_model_parallel_attributes(split, True, 0 if column else 1, 1)
        # Under sequence parallelism the replicated matrix sees one slice of the sequence per rank
        # (see _adapter): megatron's finalize_model_grads sums such gradients over TP.
        (self.lora_A if column else self.lora_B).sequence_parallel = getattr(self, "sequence_parallel", False)
        self.lora_scale, self.lora_dropout_p = alpha / rank, dropout
        self.lora_column, self.lora_swiglu = column, swiglu

    def lora_delta(self) -> torch.Tensor:
        """(alpha/rank) B A: this shard's weight update, shaped like its weight."""
        return (self.lora_B.float() @ self.lora_A.float() * self.lora_scale).to(self.weight.dtype)

    def _adapter(self, x: torch.Tensor) -> torch.Tensor:
        x = normalized_input(self, x)
        sequence_parallel = getattr(self, "sequence_parallel", False)  # read per call: decoding switches it off
        if self.lora_dropout_p and self.training:
            if self.lora_column and not sequence_parallel:  # replicated input: the same mask on every TP rank
                x = F.dropout(x, self.lora_dropout_p)
            else:  # split input (hidden or sequence): independent masks per shard
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    x = F.dropout(x, self.lora_dropout_p)
        h = F.linear(x, self.lora_A)
        if self.lora_column and sequence_parallel:
            # x is this rank's slice of the sequence: gather the rank-r activations (backward:
            # reduce-scatter, summing every rank's B-slice gradient); A saw only this slice, so
            # its gradient is summed over TP in finalize_model_grads (`sequence_parallel` below)
            h = tensor_parallel.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True)
        elif self.lora_column:
            h = tensor_parallel.copy_to_tensor_model_parallel_region(h)
        elif sequence_parallel:
            # the base layer's output is reduce-scattered along the sequence: the summed rank-r
            # activations likewise, so B sees only this rank's slice (its gradient summed over TP)
            h = tensor_parallel.reduce_scatter_to_sequence_parallel_region(h)
        else:
            h = tensor_parallel.reduce_from_tensor_model_parallel_region(h)
        return F.linear(h, self.lora_B) * self.lora_scale

    def forward(self, x, *args, **kwargs):
        out = super().forward(x, *args, **kwargs)
        if not self.lora_enabled:
            return out
        y, *rest = out if isinstance(out, tuple) else (out,)
        if isinstance(y, tuple):  # TE LayerNormLinear with return_layernorm_output
            raise NotImplementedError("LoRA on a layer that also returns its layernorm output")
        y = y + self._adapter(x).to(y.dtype)
        return (y, *rest) if isinstance(out, tuple) else y

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)  # lora_* as replicated
        axis = {"lora_B": 0} if self.lora_column else {"lora_A": 1}
        tp_group = getattr(self, "tp_group", None) or self._tp_group  # megatron's local layers / TE's
        lora = make_sharded_tensors_for_checkpoint(
            {"lora_A": self.lora_A, "lora_B": self.lora_B}, prefix, axis, sharded_offsets,
            tp_group=tp_group, dp_cp_group=metadata["dp_cp_group"],
        )
        if self.lora_swiglu:  # B's rows are [gate_r; up_r] per rank, as FC1's weight
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            key = f"{prefix}lora_B"
            lora[key] = apply_swiglu_sharded_factory(lora[key], sharded_offsets, tp_group=tp_group,
                                                     dp_group=metadata["dp_cp_group"])
        state.update(lora)
        return state


_subclasses: dict[type, type] = {}


def _lora_class(cls: type) -> type:
    if cls not in _subclasses:
        _subclasses[cls] = type(f"LoRA{cls.__name__}", (LoRAMixin, cls), {})
    return _subclasses[cls]


def _adapt(linear, rank: int, alpha: float, dropout: float, column: bool, swiglu: bool, seed: int) -> None:
    cls = type(linear)
    linear.__class__ = _lora_class(cls.__bases__[1] if issubclass(cls, LoRAMixin) else cls)
    linear.init_lora(rank, alpha, dropout, column, swiglu, seed)


def target_layers(model: torch.nn.Module, targets: list[str]):
    """(linear layer, column-parallel?, SwiGLU FC1?, seed offset) of every layer `targets` names
    on this pipeline stage (`output`: the LM head, on the last stage)."""
    for layer in model.decoder.layers:
        for target in targets:
            if target == OUTPUT:
                continue
            parent, attr, column = TARGETS[target]
            key = f"{layer.layer_number}.{target}"  # global layer number: the same at every PP
            gated = model.config.gated_linear_unit and target == "fc1"
            yield getattr(getattr(layer, parent), attr), column, gated, zlib.crc32(key.encode())
    if OUTPUT in targets and getattr(model, "post_process", False):
        yield model.output_layer, True, False, zlib.crc32(OUTPUT.encode())


def apply_lora(model: torch.nn.Module, rank: int, alpha: float, dropout: float, targets: list[str],
               seed: int, keep_trainable: tuple[str, ...] = ()) -> None:
    """Adapters on `targets` of every decoder layer of this stage (and `output`: the LM head, on
    the last stage); every other parameter frozen except those whose names start with
    `keep_trainable` (e.g. a value head). Call before DDP and the optimizer are built: they then
    hold only the trainable parameters."""
    for linear, column, gated, offset in target_layers(model, targets):
        _adapt(linear, rank, alpha, dropout, column, gated, seed + offset)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name) or name.startswith(keep_trainable))


_ADAPTER_STATE = ("lora_scale", "lora_dropout_p", "lora_column", "lora_swiglu", "lora_enabled")


@contextmanager
def borrowed_adapters(model: torch.nn.Module, rank: int, alpha: float, targets: list[str]):
    """Adapters of another checkpoint's shape on `model` for the duration (values for the caller
    to load), in place of any it has: how a LoRA checkpoint's adapters are read at this layout
    and merged into the weights (checkpoint.dist.merge_adapters). Its own adapters, classes and
    parameters (DDP's buffers view them) are put back afterwards. Yields the adapted layers."""
    saved, layers = [], []
    for linear, column, gated, _ in target_layers(model, targets):
        own = {k: linear._parameters.pop(k) for k in ("lora_A", "lora_B") if k in linear._parameters}
        saved.append((linear, type(linear), own, {k: linear.__dict__.pop(k) for k in _ADAPTER_STATE
                                                   if k in linear.__dict__}))
        _adapt(linear, rank, alpha, 0.0, column, gated, seed=0)
        layers.append(linear)
    try:
        yield layers
    finally:
        for linear, cls, own, state in saved:
            for k in ("lora_A", "lora_B"):
                linear._parameters.pop(k)
            for k in _ADAPTER_STATE:
                linear.__dict__.pop(k, None)
            linear.__class__ = cls
            linear._parameters.update(own)
            linear.__dict__.update(state)


def is_adapter(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))


def lora_layers(model: torch.nn.Module) -> list[LoRAMixin]:
    return [m for m in model.modules() if isinstance(m, LoRAMixin)]


@contextmanager
def adapters_disabled(model: torch.nn.Module):
    """The base model: every adapter switched off (the LoRA reference policy)."""
    layers = lora_layers(model)
    for layer in layers:
        layer.lora_enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_enabled = True


class MergedParameters(Mapping):
    """named_parameters() without the adapters, each adapted weight read as W + (alpha/rank) B A
    (this shard's; TP attributes kept), the base weights untouched: what a rollout engine's refit
    sends. Merged on each lookup, so the caller holds only the merged weights it is using (a refit
    one group at a time, not every adapted weight of the stage at once). (Export merges from
    checkpoints: convert/lora_export.py.)"""

    def __init__(self, model: torch.nn.Module):
        self._params = {n: p for n, p in model.named_parameters() if not is_adapter(n)}
        self._adapted = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, LoRAMixin)}

    def __getitem__(self, name: str) -> torch.Tensor:
        layer = self._adapted.get(name)
        return merged_weight(layer) if layer is not None and layer.lora_enabled else self._params[name]

    def __iter__(self):
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def merged_parameters(model: torch.nn.Module) -> MergedParameters:
    """The model's weights with its adapters merged, each when it is looked up (MergedParameters)."""
    return MergedParameters(model)


@torch.no_grad()
def merged_weight(layer: LoRAMixin) -> torch.Tensor:
    """A new tensor W + (alpha/rank) B A of this shard, with the weight's TP attributes."""
    w = layer.weight
    merged = w.detach() + layer.lora_delta()
    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
        if hasattr(w, attr):
            setattr(merged, attr, getattr(w, attr))
    return merged
