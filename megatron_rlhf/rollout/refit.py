"""Weight refit, trainer side: the actor's TP x PP shards as full Hugging Face tensors, one
group at a time, streamed in buckets of bounded size to a rollout engine.

Groups go in HF file order: the embedding (first pipeline stage), each decoder layer (the
stage that holds it), the final norm and the LM head (last stage). The stage that owns a group
gathers it over its TP group (`all_gather`; fused QKV and the SwiGLU FC1 re-assembled as the
TP1 layout), names it with the mapping `convert/hf_weights.py` uses for export, and its TP rank
0 sends the tensors to the engine's rank (the first rank of the model-parallel group) with
point-to-point sends. The engine rank packs them into buckets of at most `bucket_bytes` and
yields each. So the trainer never holds more than one group and one bucket beyond the model: no
second copy of it. A LoRA actor's weights are merged (W + (alpha/r) B A) as their group is
gathered, so the only merged copies are the group's being sent, not the whole stage's. Every
rank of the model-parallel group must call `stream_hf_weights`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_rlhf.convert.hf_weights import LAYER_PARAMS, Dims, hf_expected_shapes, hf_layer_tensors
from megatron_rlhf.models.lora import merged_parameters
from megatron_rlhf.parallel import device

EMBEDDING, FINAL = -1, 1 << 30  # group keys around the layer indices


def expected_hf_shapes(model_cfg) -> dict[str, tuple[int, ...]]:
    """Every HF tensor a refit sends, and its shape (the engine's model has exactly these)."""
    return hf_expected_shapes(Dims.of(model_cfg), value_model=False)


def group_of(hf_name: str) -> int:
    if hf_name.startswith("model.layers."):
        return int(hf_name.split(".")[2])
    return EMBEDDING if hf_name == "model.embed_tokens.weight" else FINAL


def _full(param: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """`param` gathered over the TP group (a replicated parameter as it is)."""
    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return param.detach()
    parts = [torch.empty_like(param) for _ in range(tp)]
    dist.all_gather(parts, param.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    if swiglu:  # each rank holds [gate_r; up_r]: the TP1 layout is [all gates; all ups]
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(parts, dim=param.partition_dim)


def _local_groups(module, d: Dims) -> dict[int, Callable[[], dict[str, torch.Tensor]]]:
    """The groups this pipeline stage holds: key -> a function gathering them (collective over TP)."""
    params = merged_parameters(module)  # a LoRA actor's: merged on lookup, i.e. when a group is gathered
    groups: dict[int, Callable[[], dict[str, torch.Tensor]]] = {}
    if "embedding.word_embeddings.weight" in params:
        groups[EMBEDDING] = lambda: {"model.embed_tokens.weight": _full(params["embedding.word_embeddings.weight"],
                                                                         False)[: d.vocab]}
    for local, layer in enumerate(module.decoder.layers):
        prefix = f"decoder.layers.{local}."
        kinds = {LAYER_PARAMS[n.removeprefix(prefix)]: n for n in params
                 if n.startswith(prefix) and n.removeprefix(prefix) in LAYER_PARAMS}

        def gather(kinds=kinds, number=layer.layer_number - 1):
            full = {kind: _full(params[name], swiglu=kind == "fc1") for kind, name in kinds.items()}
            return hf_layer_tensors(number, full.__getitem__, d)

        groups[layer.layer_number - 1] = gather
    if "decoder.final_layernorm.weight" in params:
        def final():
            out = {"model.norm.weight": params["decoder.final_layernorm.weight"].detach()}
            if not d.tied:
                out["lm_head.weight"] = _full(params["output_layer.weight"], False)[: d.vocab]
            return out

        groups[FINAL] = final
    return groups


@dataclasses.dataclass
class RefitPlan:
    """Which pipeline stage owns which group (the same on every rank; built once)."""

    owner: dict[int, int]          # group key -> pipeline rank
    pp_ranks: list[int]            # global rank of each stage of this rank's pipeline group
    engine_rank: int               # global rank that feeds the engine

    @classmethod
    def build(cls, module, model_cfg) -> RefitPlan:
        mine = list(_local_groups(module, Dims.of(model_cfg)))
        pp_group = ps.get_pipeline_model_parallel_group()
        stages: list[list[int]] = [None] * ps.get_pipeline_model_parallel_world_size()  # type: ignore[list-item]
        dist.all_gather_object(stages, mine, group=pp_group)
        owner = {key: stage for stage, keys in enumerate(stages) for key in keys}
        return cls(owner, dist.get_process_group_ranks(pp_group), engine_rank(ps.get_model_parallel_group()))


def engine_rank(model_parallel_group) -> int:
    """The global rank of TP rank 0 of the first pipeline stage of this model-parallel group."""
    first = ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0
    ranks = dist.get_process_group_ranks(model_parallel_group)
    flags = torch.tensor([dist.get_rank() if first else max(ranks) + 1], dtype=torch.long, device=device())
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=model_parallel_group)
    return int(flags.item())


def stream_hf_weights(module, model_cfg, plan: RefitPlan, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Collective over the model-parallel group. On the engine rank, yields buckets ({HF name:
    full tensor}, each bucket at most `bucket_bytes` unless one tensor is larger); elsewhere
    yields nothing. Tensors are on the actor's device, in its parameter dtype."""
    d = Dims.of(model_cfg)
    shapes = hf_expected_shapes(d, value_model=False)
    local = _local_groups(module, d)
    me, pp_rank = dist.get_rank(), ps.get_pipeline_model_parallel_rank()
    tp_first = ps.get_tensor_model_parallel_rank() == 0
    dtype, device = next(module.parameters()).dtype, next(module.parameters()).device
    by_group: dict[int, list[str]] = {}
    for name in shapes:
        by_group.setdefault(group_of(name), []).append(name)
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for key in sorted(by_group):
        owner = plan.owner[key]
        tensors = local[key]() if owner == pp_rank else None  # all TP ranks of the owner stage gather
        if me == plan.engine_rank:
            if tensors is None:
                tensors = {}
                for name in by_group[key]:
                    t = torch.empty(shapes[name], dtype=dtype, device=device)
                    dist.recv(t, src=plan.pp_ranks[owner])
                    tensors[name] = t
            for name in by_group[key]:
                t = tensors[name]
                if size and size + t.numel() * t.element_size() > bucket_bytes:
                    yield bucket
                    bucket, size = {}, 0
                bucket[name] = t.contiguous()
                size += t.numel() * t.element_size()
        elif tensors is not None and tp_first:
            for name in by_group[key]:
                if tuple(tensors[name].shape) != shapes[name]:  # the receiver posts a buffer of this shape
                    raise RuntimeError(f"refit: {name} gathered as {list(tensors[name].shape)}, expected "
                                       f"{list(shapes[name])} (model config out of sync with the model?)")
                dist.send(tensors[name].to(dtype).contiguous(), dst=plan.engine_rank)
    if bucket:
        yield bucket
