"""Weight refit, trainer side: the actor's TP x PP (x EP) shards as full Hugging Face tensors,
one group at a time, streamed in buckets of bounded size to a rollout engine.

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

A mixture-of-experts layer (`convert/hf_moe_weights.py`: the router, then each expert under its
own HF names) streams its experts one at a time, so its group never holds more than one expert
beyond the attention part: expert e lives on one expert-parallel rank (e // (E/EP)), which
gathers it over its expert-TP group and broadcasts it over its expert-parallel group. The
expert-parallel group spans data-parallel replicas, so with EP > 1 every rank of the world calls
`stream_hf_weights` together (each replica refits its own engine at the same time, as the RL
loop does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_rlhf.convert.hf_moe_weights import (
    ExpertRanks, MoEDims, experts_per_rank, hf_expert_tensors, hf_router, is_router, local_expert,
)
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


def _gather(t: torch.Tensor, group, dim: int, swiglu: bool) -> torch.Tensor:
    """`t` gathered over `group` along `dim`; `swiglu`: each rank holds [gate_r; up_r] and the
    full layout is [all gates; all ups]."""
    size = dist.get_world_size(group)
    if size == 1:
        return t.detach()
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    if swiglu:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(parts, dim=dim)


def _full(param: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """`param` gathered over the TP group (a replicated parameter as it is)."""
    if ps.get_tensor_model_parallel_world_size() == 1 or not getattr(param, "tensor_model_parallel", False):
        return param.detach()
    return _gather(param, ps.get_tensor_model_parallel_group(), param.partition_dim, swiglu)


Parts = Iterator[dict[str, torch.Tensor]]  # a group's HF tensors, in parts (an expert layer: one per expert)


def _experts(layer: int, local: dict[tuple[int, str], torch.Tensor], moe: MoEDims, hidden: int) -> Parts:
    """The HF tensors of expert layer `layer`'s experts, one expert per part, from this rank's
    local experts `local` ((local index, linear_fc1 | linear_fc2) -> parameter). Collective over
    the stage's expert-parallel and expert-TP groups: expert e's EP rank gathers it over expert TP
    and broadcasts it (fc1 [2F, h] and fc2 [h, F] in one buffer) over expert parallelism."""
    ranks = ExpertRanks.current()
    per_rank = experts_per_rank(moe, ranks.ep_size)
    have = sorted(local)
    want = [(j, fc) for j in range(per_rank) for fc in ("linear_fc1", "linear_fc2")]
    if have != want:
        raise RuntimeError(f"refit: layer {layer} holds local experts {sorted({j for j, _ in have})}, but "
                           f"model.num_experts={moe.num_experts} over expert_parallel={ranks.ep_size} gives each rank "
                           f"{per_rank} (model config out of sync with the model?)")
    ep_group, etp_group = ps.get_expert_model_parallel_group(), ps.get_expert_tensor_parallel_group()
    f, h = moe.ffn, hidden
    sample = local[(0, "linear_fc1")]
    for e in range(moe.num_experts):
        owner, j = divmod(e, per_rank)
        if ranks.ep_rank == owner:
            fc1 = _gather(local[(j, "linear_fc1")], etp_group, 0, swiglu=True)
            fc2 = _gather(local[(j, "linear_fc2")], etp_group, 1, swiglu=False)
            if ranks.ep_size == 1:
                yield hf_expert_tensors(moe, layer, e, fc1, fc2)
                continue
            flat = torch.cat([fc1.reshape(-1), fc2.reshape(-1)])
        else:
            flat = torch.empty(3 * f * h, dtype=sample.dtype, device=sample.device)
        dist.broadcast(flat, src=dist.get_global_rank(ep_group, owner), group=ep_group)
        yield hf_expert_tensors(moe, layer, e, flat[: 2 * f * h].view(2 * f, h), flat[2 * f * h:].view(h, f))


def _layer_part(params, kinds: dict[str, str], layer: int, d: Dims) -> dict[str, torch.Tensor]:
    """HF tensors of `layer` but its experts (an expert layer's router included), from this
    stage's parameters `params` of each kind in `kinds` (collective over TP). A function of its
    own, so that the gathered full tensors are freed when it returns, not kept by the suspended
    group generator while the experts stream."""
    full = {kind: _full(params[name], swiglu=kind == "fc1") for kind, name in kinds.items()}
    out = hf_layer_tensors(layer, full.__getitem__, d, experts=False)
    if d.has_experts(layer):
        out[hf_router(d.moe, layer)] = full["router"]
    return out


def _local_groups(module, d: Dims) -> dict[int, Callable[[], Parts]]:
    """The groups this pipeline stage holds: key -> a function gathering them (collective over TP,
    and over expert parallelism for an expert layer), part by part."""
    params = merged_parameters(module)  # a LoRA actor's: merged on lookup, i.e. when a group is gathered
    groups: dict[int, Callable[[], Parts]] = {}
    if "embedding.word_embeddings.weight" in params:
        groups[EMBEDDING] = lambda: iter([{"model.embed_tokens.weight": _full(params["embedding.word_embeddings.weight"],
                                                                              False)[: d.vocab]}])
    for local, layer in enumerate(module.decoder.layers):
        prefix = f"decoder.layers.{local}."
        suffixes = {n.removeprefix(prefix): n for n in params if n.startswith(prefix)}
        kinds = {LAYER_PARAMS[s]: n for s, n in suffixes.items() if s in LAYER_PARAMS}
        kinds.update({"router": n for s, n in suffixes.items() if is_router(s)})
        experts = {local_expert(s): n for s, n in suffixes.items() if local_expert(s) is not None}

        def gather(kinds=kinds, experts=experts, number=layer.layer_number - 1):
            yield _layer_part(params, kinds, number, d)
            if d.has_experts(number):
                yield from _experts(number, {key: params[name] for key, name in experts.items()}, d.moe, d.hidden)

        groups[layer.layer_number - 1] = gather
    if "decoder.final_layernorm.weight" in params:
        def final():
            out = {"model.norm.weight": params["decoder.final_layernorm.weight"].detach()}
            if not d.tied:
                out["lm_head.weight"] = _full(params["output_layer.weight"], False)[: d.vocab]
            yield out

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
    """Collective over the model-parallel group (with expert parallelism > 1: over the world, see
    the module's docstring). On the engine rank, yields buckets ({HF name:
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
        parts = local[key]() if owner == pp_rank else None  # all ranks of the owner stage gather
        pending: dict[str, torch.Tensor] = {}  # gathered, not yet sent
        for name in by_group[key]:
            t = None
            if parts is not None:
                while name not in pending:
                    part = next(parts, None)
                    if part is None:
                        raise RuntimeError(f"refit: the model has no {name} (model config out of sync with the model?)")
                    pending.update(part)
                    del part  # what is sent leaves memory once the bucket lets it go
                t = pending.pop(name)
            if me == plan.engine_rank:
                if t is None:
                    t = torch.empty(shapes[name], dtype=dtype, device=device)
                    dist.recv(t, src=plan.pp_ranks[owner])
                if size and size + t.numel() * t.element_size() > bucket_bytes:
                    yield bucket
                    bucket, size = {}, 0
                bucket[name] = t.contiguous()
                size += t.numel() * t.element_size()
            elif t is not None and tp_first:
                if tuple(t.shape) != shapes[name]:  # the receiver posts a buffer of this shape
                    raise RuntimeError(f"refit: {name} gathered as {list(t.shape)}, expected "
                                       f"{list(shapes[name])} (model config out of sync with the model?)")
                dist.send(t.to(dtype).contiguous(), dst=plan.engine_rank)
        if parts is not None:
            for part in parts:
                pending.update(part)
            if pending:
                raise RuntimeError(f"refit: gathered {sorted(pending)[:4]}, which the engine's model does not have "
                                   "(model config out of sync with the model?)")
    if bucket:
        yield bucket
