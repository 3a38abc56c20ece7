"""The tensor mapping between our megatron GPTModel and Hugging Face Llama / Mistral / Qwen2 /
Qwen3 (one naming scheme: model.layers.<i>.self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj),
both directions; the expert layers of Qwen3-MoE and Mixtral: hf_moe_weights.py.

megatron-core fuses what HF keeps apart:
- `linear_qkv.weight` [(nq + 2 nkv) * d, h]: rows grouped per key/value group g,
  [q heads of g (nq/nkv of them), k_g, v_g], d = head_dim rows each. Tensor parallelism
  splits the groups contiguously, so a TP rank holds whole groups.
- `linear_fc1.weight` [2 f, h] = [gate; up] on each TP rank (SwiGLU: silu(gate) * up), each
  half split over TP ranks.
- RMSNorm weights sit in `input_layernorm` / `pre_mlp_layernorm` (local spec) or inside
  the fused linears as `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight`
  (Transformer Engine spec). Parameters are named from the model's own state dict, so both
  specs load.
- Embedding and output layer are padded to the padded vocabulary and split by rows over TP
  (padding rows: zeros on import, dropped on export). RoPE is rotate-half in both, so q/k
  need no permutation.
- Qwen2's q/k/v biases fuse into `linear_qkv.bias` with the same group layout as the weight
  rows; Qwen3's per-head `q_norm` / `k_norm` [head_dim] are megatron's `q_layernorm` /
  `k_layernorm` (replicated over TP).

In megatron's torch_dist checkpoints (what export reads) the model is stored TP- and
PP-independently: per-layer tensors are stacked under `decoder.layers.<name>` with a leading
layer axis [num_layers, ...], norms under the TE-spec names, `linear_fc1.weight` as the global
[2 f, h] = [all gate rows; all up rows] (apply_swiglu_sharded_factory saves each TP rank's
gate and up halves as separate chunks at offsets r * f/TP and f + r * f/TP), and
`linear_qkv.weight` as the TP1 group-interleaved layout above.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_rlhf.convert.hf_config import ConvertError
from megatron_rlhf.convert.hf_moe_weights import (
    CKPT_MOE_KEYS, ExpertRanks, MoEDims, expert_layer_tensors, expert_shard, hf_expert_shapes, is_expert_param,
)


@dataclass(frozen=True)
class Dims:
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int           # the tokenizer's (= HF vocab_size)
    padded_vocab: int    # rows of our embedding / output layer
    tied: bool
    head_dim: int
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: MoEDims | None = None  # the experts (qwen3_moe, mixtral); None: a dense model
    family: str = "llama"       # model.family (named in refusals)

    @property
    def q_per_group(self) -> int:
        return self.heads // self.kv_heads

    @classmethod
    def of(cls, model_cfg) -> Dims:
        m = model_cfg
        return cls(m.num_layers, m.hidden_size, m.num_attention_heads, m.kv_heads, m.ffn_hidden_size,
                   m.vocab_size, m.padded_vocab_size, bool(m.share_embeddings_and_output_weights), m.kv_channels,
                   m.qkv_bias, m.qk_layernorm, MoEDims.of(m), m.family)

    def has_experts(self, layer: int) -> bool:
        return self.moe is not None and self.moe.has_experts(layer)


def hf_layer(layer: int) -> str:
    return f"model.layers.{layer}"


def hf_expected_shapes(d: Dims, value_model: bool, has_output: bool = True) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of the model and its shape, in file order (embedding, layers, norm, head)."""
    h, hd = d.hidden, d.head_dim
    shapes = {"model.embed_tokens.weight": (d.vocab, h)}
    for layer in range(d.num_layers):
        p = hf_layer(layer)
        shapes.update({
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (d.heads * hd, h),
            f"{p}.self_attn.k_proj.weight": (d.kv_heads * hd, h),
            f"{p}.self_attn.v_proj.weight": (d.kv_heads * hd, h),
            f"{p}.self_attn.o_proj.weight": (h, d.heads * hd),
            f"{p}.post_attention_layernorm.weight": (h,),
        })
        if d.has_experts(layer):
            shapes.update(hf_expert_shapes(d.moe, layer, h))
        else:
            shapes.update({f"{p}.mlp.gate_proj.weight": (d.ffn, h), f"{p}.mlp.up_proj.weight": (d.ffn, h),
                           f"{p}.mlp.down_proj.weight": (h, d.ffn)})
        if d.qkv_bias:
            shapes.update({f"{p}.self_attn.q_proj.bias": (d.heads * hd,), f"{p}.self_attn.k_proj.bias": (d.kv_heads * hd,),
                           f"{p}.self_attn.v_proj.bias": (d.kv_heads * hd,)})
        if d.qk_norm:
            shapes.update({f"{p}.self_attn.q_norm.weight": (hd,), f"{p}.self_attn.k_norm.weight": (hd,)})
    shapes["model.norm.weight"] = (h,)
    if value_model:
        shapes["score.weight"] = (1, h)
    elif has_output and not d.tied:
        shapes["lm_head.weight"] = (d.vocab, h)
    return shapes


# ----------------------------------------------------------------------------- import

# Our per-layer parameter suffix (local spec and TE spec names) -> what it is.
LAYER_PARAMS = {
    "input_layernorm.weight": "input_norm",
    "self_attention.linear_qkv.layer_norm_weight": "input_norm",
    "pre_mlp_layernorm.weight": "post_norm",
    "mlp.linear_fc1.layer_norm_weight": "post_norm",
    "self_attention.linear_qkv.weight": "qkv",
    "self_attention.linear_qkv.bias": "qkv_bias",
    "self_attention.q_layernorm.weight": "q_norm",
    "self_attention.k_layernorm.weight": "k_norm",
    "self_attention.linear_proj.weight": "o_proj",
    "mlp.linear_fc1.weight": "fc1",
    "mlp.linear_fc2.weight": "down",
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# read(hf_name, rows=(start, stop) | None, cols=(start, stop) | None) -> tensor
Read = Callable[..., torch.Tensor]


def split(size: int, rank: int, parts: int, what: str) -> tuple[int, int]:
    if size % parts:
        raise ConvertError(f"{what}: {size} does not split over tensor_parallel={parts}")
    step = size // parts
    return rank * step, (rank + 1) * step


def _vocab_rows(read: Read, name: str, d: Dims, tp_rank: int, tp_size: int, dtype) -> torch.Tensor:
    """Rows [r*Vp/TP, (r+1)*Vp/TP) of the padded vocabulary; padding rows are zeros."""
    lo, hi = split(d.padded_vocab, tp_rank, tp_size, "model.padded_vocab_size")
    out = torch.zeros(hi - lo, d.hidden, dtype=dtype)
    if lo < d.vocab:
        out[: min(hi, d.vocab) - lo] = read(name, rows=(lo, min(hi, d.vocab)))
    return out


def _qkv_rows(read: Read, p: str, d: Dims, tp_rank: int, tp_size: int, part: str = "weight") -> torch.Tensor:
    """This rank's rows of the fused q/k/v weight (or bias: part="bias")."""
    hd, qpg = d.head_dim, d.q_per_group
    g0, g1 = split(d.kv_heads, tp_rank, tp_size, "num_key_value_heads")
    groups = g1 - g0
    q = read(f"{p}.self_attn.q_proj.{part}", rows=(g0 * qpg * hd, g1 * qpg * hd))
    k = read(f"{p}.self_attn.k_proj.{part}", rows=(g0 * hd, g1 * hd))
    v = read(f"{p}.self_attn.v_proj.{part}", rows=(g0 * hd, g1 * hd))
    cols = q.shape[1:]
    fused = torch.cat([q.reshape(groups, qpg * hd, *cols), k.reshape(groups, hd, *cols),
                       v.reshape(groups, hd, *cols)], dim=1)
    return fused.reshape(-1, *cols)


def shard_for_param(name: str, read: Read, d: Dims, tp_rank: int, tp_size: int, global_layer: Callable[[int], int],
                    value_model: bool, hf_value_head: bool, dtype,
                    experts: ExpertRanks = ExpertRanks()) -> torch.Tensor | None:
    """This rank's shard of our parameter `name`, read from the HF tensors; None: keep the
    parameter as it is (a value model's fresh head when the HF model has no score).
    `experts`: this rank's expert-parallel place (expert layers only)."""
    if m := _LAYER.match(name):
        layer, suffix = global_layer(int(m.group(1))), m.group(2)
        if is_expert_param(suffix):
            return expert_shard(name, suffix, layer, read, d.moe, experts)
        kind, p = LAYER_PARAMS.get(suffix), hf_layer(layer)
        if kind in ("fc1", "down") and d.has_experts(layer):
            raise ConvertError(f"our model parameter {name!r}: a dense MLP in layer {layer}, but the model config "
                               "gives it experts (model.moe_dense_layers out of sync with the model?)")
        if kind == "input_norm":
            return read(f"{p}.input_layernorm.weight")
        if kind == "post_norm":
            return read(f"{p}.post_attention_layernorm.weight")
        if kind == "qkv":
            return _qkv_rows(read, p, d, tp_rank, tp_size)
        if kind == "qkv_bias":
            return _qkv_rows(read, p, d, tp_rank, tp_size, part="bias")
        if kind in ("q_norm", "k_norm"):
            return read(f"{p}.self_attn.{kind}.weight")
        if kind == "o_proj":
            cols = split(d.heads * d.head_dim, tp_rank, tp_size, "num_attention_heads")
            return read(f"{p}.self_attn.o_proj.weight", cols=cols)
        if kind == "fc1":
            rows = split(d.ffn, tp_rank, tp_size, "intermediate_size")
            return torch.cat([read(f"{p}.mlp.gate_proj.weight", rows=rows), read(f"{p}.mlp.up_proj.weight", rows=rows)])
        if kind == "down":
            return read(f"{p}.mlp.down_proj.weight", cols=split(d.ffn, tp_rank, tp_size, "intermediate_size"))
        raise ConvertError(f"our model parameter {name!r} has no Hugging Face counterpart "
                           "(an unexpected megatron layer spec?)")
    if name == "embedding.word_embeddings.weight":
        return _vocab_rows(read, "model.embed_tokens.weight", d, tp_rank, tp_size, dtype)
    if name == "decoder.final_layernorm.weight":
        return read("model.norm.weight")
    if name == "output_layer.weight":
        if value_model:
            if not hf_value_head:
                return None
            return read("score.weight", cols=split(d.hidden, tp_rank, tp_size, "hidden_size"))
        source = "model.embed_tokens.weight" if d.tied else "lm_head.weight"
        return _vocab_rows(read, source, d, tp_rank, tp_size, dtype)
    if name == "output_layer.bias" and value_model:
        return torch.zeros(1, dtype=dtype) if hf_value_head else None
    raise ConvertError(f"our model parameter {name!r} has no Hugging Face counterpart "
                       "(an unexpected megatron layer spec?)")


# ----------------------------------------------------------------------------- export

# Checkpoint keys (megatron sharded-state-dict keys: the TE-spec names, also for the local
# spec) of one layer, stacked over layers; the local-spec name is accepted as a fallback.
CKPT_LAYER_KEYS = {
    "input_norm": ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    "post_norm": ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    "qkv": ("self_attention.linear_qkv.weight",),
    "o_proj": ("self_attention.linear_proj.weight",),
    "fc1": ("mlp.linear_fc1.weight",),
    "down": ("mlp.linear_fc2.weight",),
}
OPTIONAL_LAYER_KEYS = {  # present when the Dims flag is set
    "qkv_bias": ("self_attention.linear_qkv.bias",),
    "q_norm": ("self_attention.q_layernorm.weight",),
    "k_norm": ("self_attention.k_layernorm.weight",),
}


def layer_kinds(d: Dims, layer: int = 0) -> dict[str, tuple[str, ...]]:
    """The checkpoint keys of layer `layer` of a model with `d`'s features."""
    kinds = dict(CKPT_LAYER_KEYS)
    if d.has_experts(layer):
        del kinds["fc1"], kinds["down"]
        kinds.update(CKPT_MOE_KEYS)
    if d.qkv_bias:
        kinds["qkv_bias"] = OPTIONAL_LAYER_KEYS["qkv_bias"]
    if d.qk_norm:
        kinds.update(q_norm=OPTIONAL_LAYER_KEYS["q_norm"], k_norm=OPTIONAL_LAYER_KEYS["k_norm"])
    return kinds


def hf_layer_tensors(layer: int, get: Callable[[str], torch.Tensor], d: Dims,
                     experts: bool = True) -> dict[str, torch.Tensor]:
    """HF tensors of `layer` from our full (unsharded) tensors of that layer: get(kind).
    `experts=False`: without an expert layer's MLP (router and experts; the refit streams those
    expert by expert)."""
    p, hd, qpg = hf_layer(layer), d.head_dim, d.q_per_group

    def unfuse(fused: torch.Tensor) -> list[torch.Tensor]:
        cols = fused.shape[1:]
        q, k, v = torch.split(fused.reshape(d.kv_heads, (qpg + 2) * hd, *cols), [qpg * hd, hd, hd], dim=1)
        return [t.reshape(-1, *cols) for t in (q, k, v)]

    q, k, v = unfuse(get("qkv"))
    out = {
        f"{p}.input_layernorm.weight": get("input_norm"),
        f"{p}.self_attn.q_proj.weight": q,
        f"{p}.self_attn.k_proj.weight": k,
        f"{p}.self_attn.v_proj.weight": v,
        f"{p}.self_attn.o_proj.weight": get("o_proj"),
        f"{p}.post_attention_layernorm.weight": get("post_norm"),
    }
    if d.has_experts(layer):
        if experts:
            out.update(expert_layer_tensors(layer, get, d.moe))
    else:
        fc1 = get("fc1")
        out.update({f"{p}.mlp.gate_proj.weight": fc1[: d.ffn], f"{p}.mlp.up_proj.weight": fc1[d.ffn:],
                    f"{p}.mlp.down_proj.weight": get("down")})
    if d.qkv_bias:
        out.update(zip([f"{p}.self_attn.{x}_proj.bias" for x in "qkv"], unfuse(get("qkv_bias"))))
    if d.qk_norm:
        out.update({f"{p}.self_attn.q_norm.weight": get("q_norm"), f"{p}.self_attn.k_norm.weight": get("k_norm")})
    return out
