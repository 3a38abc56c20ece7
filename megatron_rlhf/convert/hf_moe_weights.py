"""The mixture-of-experts part of the tensor mapping (hf_weights.py calls it; the vLLM refit,
rollout/refit.py, names and places experts with it too): Qwen3-MoE and Mixtral expert layers, in
the per-expert names Hugging Face checkpoints use on disk, both ways.

On disk (what the hub ships and transformers' save_pretrained writes; transformers 5 fuses the
experts only in memory, `experts.gate_up_proj` [E, 2F, h], and converts back when saving):

    Qwen3-MoE  model.layers.<i>.mlp.gate.weight [E, h]                          (router)
               model.layers.<i>.mlp.experts.<e>.{gate_proj,up_proj}.weight [F, h], down_proj [h, F]
    Mixtral    model.layers.<i>.block_sparse_moe.gate.weight [E, h]
               model.layers.<i>.block_sparse_moe.experts.<e>.{w1 (gate), w3 (up)}.weight [F, h], w2 (down) [h, F]

Qwen3-MoE's dense layers (model.moe_dense_layers, HF mlp_only_layers) keep the dense names.

Ours, one MoE layer (the rest of the layer is the dense mapping's):
- `mlp.router.weight` [E, h]: replicated.
- Experts are split over expert parallelism: EP rank r holds experts r*E/EP ... (r+1)*E/EP - 1 as
  local experts 0 ... E/EP - 1, and each expert's matrices over expert tensor parallelism (ETP)
  like a dense MLP: fc1 [2F/ETP, h] = [gate rows; up rows] of ETP rank t, fc2 [h, F/ETP].
  Local spec (SequentialMLP): `mlp.experts.local_experts.<j>.linear_fc{1,2}.weight`;
  Transformer Engine (TEGroupedMLP): `mlp.experts.linear_fc{1,2}.weight<j>`.
- In megatron's torch_dist checkpoints (both specs save the same keys; layers with experts are
  stored per layer, `decoder.layers.<i>.`, since moe_layer_freq is a list) the experts are global
  and EP/ETP-independent: `mlp.experts.experts.linear_fc1.weight` [E, 2F, h] = per expert [all
  gate rows; all up rows], `mlp.experts.experts.linear_fc2.weight` [E, h, F], `mlp.router.weight`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from megatron_rlhf.config.errors import ConvertError

# family -> (the MoE block's name in a layer, the names of an expert's gate, up and down projections)
HF_EXPERT_NAMES = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}
# Our checkpoint keys of an expert layer (after decoder.layers.<i>.), by kind.
CKPT_MOE_KEYS = {
    "router": ("mlp.router.weight",),
    "experts_fc1": ("mlp.experts.experts.linear_fc1.weight",),
    "experts_fc2": ("mlp.experts.experts.linear_fc2.weight",),
}
# Our parameters of an expert layer: router, or (local index, fc1|fc2) in either spec.
_ROUTER = "mlp.router.weight"
_EXPERT_PARAM = re.compile(r"^mlp\.experts\.(?:local_experts\.(?P<j>\d+)\.(?P<fc>linear_fc[12])\.weight"
                           r"|(?P<te_fc>linear_fc[12])\.weight(?P<te_j>\d+))$")


@dataclass(frozen=True)
class MoEDims:
    family: str                    # qwen3_moe | mixtral: which HF names
    num_experts: int
    ffn: int                       # each expert's intermediate size
    dense_layers: tuple[int, ...]  # layers with a dense MLP (ffn_hidden_size) instead

    @classmethod
    def of(cls, model_cfg) -> MoEDims | None:
        m = model_cfg
        if m.num_experts is None:
            return None
        return cls(m.family, m.num_experts, m.expert_ffn_hidden_size, tuple(sorted(m.moe_dense_layers)))

    def has_experts(self, layer: int) -> bool:
        return layer not in self.dense_layers

    @property
    def ffn_field(self) -> str:
        return "moe_intermediate_size" if self.family == "qwen3_moe" else "intermediate_size"


@dataclass(frozen=True)
class ExpertRanks:
    """Where this rank's experts are: EP rank / size, expert-TP rank / size."""

    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1

    @classmethod
    def current(cls) -> ExpertRanks:
        from megatron.core import parallel_state as ps

        return cls(ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size(),
                   ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())


def hf_router(moe: MoEDims, layer: int) -> str:
    return f"model.layers.{layer}.{HF_EXPERT_NAMES[moe.family][0]}.gate.weight"


def hf_expert(moe: MoEDims, layer: int, expert: int, which: str) -> str:
    """which: gate | up | down."""
    block, (gate, up, down) = HF_EXPERT_NAMES[moe.family]
    return f"model.layers.{layer}.{block}.experts.{expert}.{dict(gate=gate, up=up, down=down)[which]}.weight"


def hf_expert_shapes(moe: MoEDims, layer: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """The HF tensors of an expert layer's MLP and their shapes (router, then expert by expert)."""
    shapes = {hf_router(moe, layer): (moe.num_experts, hidden)}
    for e in range(moe.num_experts):
        shapes.update({hf_expert(moe, layer, e, "gate"): (moe.ffn, hidden), hf_expert(moe, layer, e, "up"): (moe.ffn, hidden),
                       hf_expert(moe, layer, e, "down"): (hidden, moe.ffn)})
    return shapes


def fused_experts_hint(names) -> str:
    """A hint when an HF directory holds transformers' in-memory (fused) expert tensors."""
    fused = next((n for n in names if n.endswith(("experts.gate_up_proj", "experts.down_proj"))), None)
    if fused is None:
        return ""
    return (f" (it holds {fused!r}: transformers' fused in-memory layout, written by save_pretrained("
            "save_original_format=False); re-save it with save_pretrained's default, the per-expert names)")


# ----------------------------------------------------------------------------- import


def _split(size: int, rank: int, parts: int, what: str) -> tuple[int, int]:
    if size % parts:
        raise ConvertError(f"{what}: {size} does not split over expert_tensor_parallel={parts}")
    step = size // parts
    return rank * step, (rank + 1) * step


def is_expert_param(suffix: str) -> bool:
    """Whether a layer parameter (name after decoder.layers.<i>.) belongs to an expert layer's MLP."""
    return suffix == _ROUTER or local_expert(suffix) is not None


def is_router(suffix: str) -> bool:
    return suffix == _ROUTER


def local_expert(suffix: str) -> tuple[int, str] | None:
    """(local expert index j, "linear_fc1" | "linear_fc2") of an expert's parameter in either spec's
    name (suffix after decoder.layers.<i>.); None for any other parameter."""
    m = _EXPERT_PARAM.match(suffix)
    if m is None:
        return None
    return (int(m["j"]), m["fc"]) if m["j"] is not None else (int(m["te_j"]), m["te_fc"])


def experts_per_rank(moe: MoEDims, ep_size: int) -> int:
    """How many experts each expert-parallel rank holds (EP rank r: experts r*n ... (r+1)*n - 1)."""
    if moe.num_experts % ep_size:
        raise ConvertError(f"model.num_experts={moe.num_experts} does not split over expert_parallel={ep_size}")
    return moe.num_experts // ep_size


def expert_shard(name: str, suffix: str, layer: int, read, moe: MoEDims | None, ranks: ExpertRanks) -> torch.Tensor:
    """This rank's shard of our expert-layer parameter `name` (suffix after decoder.layers.<i>.,
    `layer` the global layer index), read from the HF tensors."""
    if moe is None or not moe.has_experts(layer):
        raise ConvertError(f"our model parameter {name!r}: layer {layer} has experts in the model, but the model "
                           f"config gives it a dense MLP (model.num_experts / model.moe_dense_layers out of sync "
                           "with the model?)")
    if suffix == _ROUTER:
        return read(hf_router(moe, layer))
    local, fc = local_expert(suffix)
    per_rank = experts_per_rank(moe, ranks.ep_size)
    if local >= per_rank:
        raise ConvertError(f"our model parameter {name!r}: local expert {local}, but expert_parallel={ranks.ep_size} "
                           f"gives each rank {per_rank} of model.num_experts={moe.num_experts}")
    expert = ranks.ep_rank * per_rank + local
    span = _split(moe.ffn, ranks.etp_rank, ranks.etp_size, moe.ffn_field)
    if fc == "linear_fc1":  # SwiGLU: [gate rows; up rows] of this ETP rank
        return torch.cat([read(hf_expert(moe, layer, expert, "gate"), rows=span),
                          read(hf_expert(moe, layer, expert, "up"), rows=span)])
    return read(hf_expert(moe, layer, expert, "down"), cols=span)


# ----------------------------------------------------------------------------- export


def expert_layer_tensors(layer: int, get, moe: MoEDims) -> dict[str, torch.Tensor]:
    """HF tensors of an expert layer's MLP from our full tensors of that layer: get(kind) with
    kind router [E, h], experts_fc1 [E, 2F, h], experts_fc2 [E, h, F]."""
    fc1, fc2 = get("experts_fc1"), get("experts_fc2")
    out = {hf_router(moe, layer): get("router")}
    for e in range(moe.num_experts):
        out.update(hf_expert_tensors(moe, layer, e, fc1[e], fc2[e]))
    return out


def hf_expert_tensors(moe: MoEDims, layer: int, expert: int, fc1: torch.Tensor, fc2: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF tensors of one expert from its full matrices: fc1 [2F, h] = [gate rows; up rows], fc2 [h, F]."""
    return {hf_expert(moe, layer, expert, "gate"): fc1[: moe.ffn], hf_expert(moe, layer, expert, "up"): fc1[moe.ffn:],
            hf_expert(moe, layer, expert, "down"): fc2}


def stored_expert_layers(tensors, num_layers: int) -> list[int]:
    """Per layer, 1 if the checkpoint (its tensor keys) has a router there, else 0."""
    keys = set(tensors)
    if f"decoder.layers.{CKPT_MOE_KEYS['router'][0]}" in keys:  # layer-stacked: every layer has experts
        return [1] * num_layers
    return [int(f"decoder.layers.{i}.{CKPT_MOE_KEYS['router'][0]}" in keys) for i in range(num_layers)]


def check_checkpoint_experts(path, tensors, shape_of, family: str, num_layers: int, hidden: int,
                             moe: MoEDims | None) -> None:
    """A checkpoint's expert layers against the model config (ConvertError naming the model.*
    field). `shape_of(kind, layer)`: the stored shape of one layer's tensor of that kind (without
    a layer axis)."""
    fix = "give `export-hf --config <the run's recipe>` (or model.* overrides)"
    stored = stored_expert_layers(tensors, num_layers)
    if moe is None:
        if any(stored):
            raise ConvertError(f"{path}: the checkpoint has mixture-of-experts layers (experts in layers "
                               f"{[i for i, s in enumerate(stored) if s]}), but model.family={family!r} with "
                               f"model.num_experts=null is dense; it exports as model.family=qwen3_moe or mixtral "
                               f"with its model.num_experts: {fix}")
        return
    if not any(stored):
        raise ConvertError(f"{path}: the checkpoint is a dense model (no router in any layer), but model.family="
                           f"{family!r} has model.num_experts={moe.num_experts}: {fix}")
    want = [int(moe.has_experts(i)) for i in range(num_layers)]
    if stored != want:
        dense = [i for i, s in enumerate(stored) if not s]
        raise ConvertError(f"{path}: the checkpoint has dense MLPs in layers {dense}, but model.family={family!r} "
                           f"with model.moe_dense_layers={list(moe.dense_layers)} gives {[i for i, w in enumerate(want) if not w]}"
                           + (" (MixtralForCausalLM has experts in every layer: a model with dense layers is "
                              "model.family=qwen3_moe)" if family == "mixtral" else "") + f": {fix}")
    first = want.index(1)
    checks = {"router": ((moe.num_experts, hidden), "model.num_experts"),
              "experts_fc1": ((moe.num_experts, 2 * moe.ffn, hidden), "model.num_experts / model.moe_ffn_hidden_size"),
              "experts_fc2": ((moe.num_experts, hidden, moe.ffn), "model.num_experts / model.moe_ffn_hidden_size")}
    for kind, (shape, fields) in checks.items():
        got = shape_of(kind, first)
        if got != shape:
            raise ConvertError(f"{path}: layer {first}'s {CKPT_MOE_KEYS[kind][0]} is {list(got)}, {fields} give "
                               f"{list(shape)}: {fix}")
