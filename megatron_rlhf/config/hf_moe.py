"""The mixture-of-experts fields of a Hugging Face config.json in ModelConfig terms, and the MoE
architectures we refuse.

Read: Qwen3-MoE (`qwen3_moe`) and Mixtral (`mixtral`): softmax routing to the top k of
`num_experts` SwiGLU experts; Qwen3-MoE's dense layers (`mlp_only_layers`, `decoder_sparse_step`)
and top-k renormalisation (`norm_topk_prob`); Mixtral always renormalises. Absent keys take
transformers' defaults (5.19: configuration_qwen3_moe.py, configuration_mixtral.py). Refused,
naming the config.json field: shared experts (Qwen2-MoE, DeepSeek), DeepSeek's multi-head latent
attention and group-limited / bias-corrected routing, Mixtral's router jitter noise, and expert
fields in a dense family's config. hf_architecture.read_hf_config calls this; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_rlhf.config.errors import ConvertError
from megatron_rlhf.config.model import MOE_ARCHITECTURE_FIELDS, MOE_FAMILIES, ModelConfig

# transformers' values for keys a config.json leaves out (Qwen3MoeConfig, MixtralConfig). Note
# Qwen3MoeConfig's norm_topk_prob=False: published Qwen3-MoE checkpoints set it true.
DEFAULTS = {
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "router_aux_loss_coef": 0.001},
    "mixtral": {"num_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0},
}
# An MLP every token passes through beside the routed experts (Qwen2-MoE, DeepSeek, Llama 4).
SHARED_EXPERT_FIELDS = ("shared_expert_intermediate_size", "n_shared_experts")
# What DeepSeek-V2/V3 have that our GPTModel does not build: (what, its config.json fields).
DEEPSEEK_FEATURES = (
    ("multi-head latent attention", ("kv_lora_rank", "q_lora_rank")),
    ("shared experts", ("n_shared_experts",)),
    ("group-limited routing", ("n_group", "topk_group")),
    ("its router scoring (V3: sigmoid with bias correction)", ("topk_method", "scoring_func")),
    ("dense first layers", ("first_k_dense_replace",)),
)


@dataclass(frozen=True)
class HFMoE:
    """The experts of a Qwen3-MoE or Mixtral config.json."""

    num_experts: int
    top_k: int                      # num_experts_per_tok
    expert_ffn: int                 # each expert's intermediate size
    norm_topk_prob: bool            # the top-k probabilities renormalised to sum to 1
    dense_layers: tuple[int, ...]   # 0-based layers with a dense MLP (intermediate_size) instead
    router_aux_loss_coef: float     # a training choice: the recipe's model.moe_aux_loss_coef wins

    def architecture_fields(self) -> dict[str, Any]:
        return {"num_experts": self.num_experts, "moe_router_topk": self.top_k, "moe_ffn_hidden_size": self.expert_ffn,
                "moe_router_score_function": "softmax", "moe_norm_topk_prob": self.norm_topk_prob,
                "moe_dense_layers": list(self.dense_layers)}


def dense_architecture_fields() -> dict[str, Any]:
    """The MoE architecture fields of a dense model: ModelConfig's defaults (num_experts null)."""
    defaults = ModelConfig()
    return {name: getattr(defaults, name) for name in MOE_ARCHITECTURE_FIELDS}


def refused_moe_type(raw: dict[str, Any], model_type: Any) -> str | None:
    """Why we refuse an MoE `model_type` we do not read (None: not one of those)."""
    if model_type == "qwen2_moe":
        return (f"Qwen2-MoE adds a shared expert (shared_expert_intermediate_size="
                f"{raw.get('shared_expert_intermediate_size')}) with its own gate to every expert layer, which our "
                "GPTModel does not build (Qwen3-MoE, model_type='qwen3_moe', has none)")
    if model_type in ("deepseek_v2", "deepseek_v3"):
        features = [f"{what} ({', '.join(f'{k}={raw[k]!r}' if k in raw else k for k in fields)})"
                    for what, fields in DEEPSEEK_FEATURES]
        return (f"DeepSeek-{model_type[-2:].upper()} needs what our GPTModel does not build: " + "; ".join(features[:4])
                + f"; its {features[4]} alone would convert (model.moe_dense_layers), the rest do not")
    return None


def _int(where: str, field: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConvertError(f"{where}: {field}={value!r}: expected an integer >= {least}")
    return value


def _expert_count(raw: dict[str, Any], model_type: str, where: str) -> int:
    """num_experts (published Qwen3-MoE) or num_local_experts (Mixtral, and what transformers 5
    writes for both: each config class maps one name onto the other)."""
    given = {k: raw[k] for k in ("num_experts", "num_local_experts") if k in raw}
    if len(set(map(repr, given.values()))) > 1:
        raise ConvertError(f"{where}: num_experts={given['num_experts']!r} and num_local_experts="
                           f"{given['num_local_experts']!r}: two expert counts; keep one")
    field, value = next(iter(given.items()), ("num_experts", DEFAULTS[model_type]["num_experts"]))
    return _int(where, field, value, 2)


def read_moe(raw: dict[str, Any], model_type: str, num_layers: int, intermediate_size: int, where: str) -> HFMoE | None:
    """The experts of config.json `raw` (None for a dense family, whose expert fields are refused)."""
    if model_type not in MOE_FAMILIES:
        for field in ("num_experts", "num_local_experts", "n_routed_experts"):
            if raw.get(field):
                raise ConvertError(f"{where}: {field}={raw[field]}: experts in a model_type={model_type!r} config; "
                                   f"the mixture-of-experts families we read are {list(MOE_FAMILIES)}")
        return None
    for field in SHARED_EXPERT_FIELDS:
        if raw.get(field):
            raise ConvertError(f"{where}: {field}={raw[field]}: shared experts (an MLP every token passes through "
                               "beside the routed experts) are not built; only models without them convert")
    default = DEFAULTS[model_type]
    experts = _expert_count(raw, model_type, where)
    top_k = _int(where, "num_experts_per_tok", raw.get("num_experts_per_tok", default["num_experts_per_tok"]), 1)
    if top_k > experts:
        raise ConvertError(f"{where}: num_experts_per_tok={top_k}: more than the {experts} experts")
    coef = raw.get("router_aux_loss_coef", default["router_aux_loss_coef"])
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
        raise ConvertError(f"{where}: router_aux_loss_coef={coef!r}: expected a number >= 0")
    if model_type == "mixtral":  # every layer has experts of intermediate_size; top-k always renormalised
        jitter = raw.get("router_jitter_noise", default["router_jitter_noise"])
        if jitter not in (None, 0, 0.0):
            raise ConvertError(f"{where}: router_jitter_noise={jitter!r}: Mixtral then scales the router's input by "
                               "random noise while training, which we do not apply (training would not be the "
                               "model's); set router_jitter_noise to 0")
        return HFMoE(experts, top_k, intermediate_size, True, (), float(coef))
    expert_ffn = _int(where, "moe_intermediate_size", raw.get("moe_intermediate_size", default["moe_intermediate_size"]), 1)
    norm = raw.get("norm_topk_prob", default["norm_topk_prob"])
    if not isinstance(norm, bool):
        raise ConvertError(f"{where}: norm_topk_prob={norm!r}: expected true or false")
    step = _int(where, "decoder_sparse_step", raw.get("decoder_sparse_step", default["decoder_sparse_step"]), 1)
    mlp_only = raw.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in mlp_only):
        raise ConvertError(f"{where}: mlp_only_layers={mlp_only!r}: expected a list of layer indices")
    # transformers' Qwen3MoeDecoderLayer: experts iff not in mlp_only_layers and (i + 1) % step == 0
    dense = tuple(i for i in range(num_layers) if i in mlp_only or (i + 1) % step)
    if len(dense) == num_layers:
        raise ConvertError(f"{where}: mlp_only_layers={mlp_only}, decoder_sparse_step={step}: no layer of the "
                           f"{num_layers} has experts; only models with experts read as model_type='qwen3_moe'")
    return HFMoE(experts, top_k, expert_ffn, norm, dense, float(coef))
