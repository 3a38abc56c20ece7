"""Our ModelConfig -> a Hugging Face `config.json` (export-hf, the vLLM engine's model
directory), and what a run records for its exports.

The other direction (reading config.json, what we refuse) is config/hf_architecture.py: a recipe
reads it while it loads. Its names are re-exported here, where the converters look for them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from megatron_rlhf.config.hf_architecture import (  # noqa: F401  (re-exported for convert/ and its users)
    SUPPORTED, ConvertError, check_model_matches_hf, hf_overrides, model_config_from_hf, read_hf_config,
    resolve_from_hf,
)
from megatron_rlhf.config.model import ModelConfig

# What a run records for its exports (trainers/stage_data.py record_run, in the run directory;
# import_hf in its output directory), so that `export-hf --ckpt DIR` needs no more: the
# tokenizer as Hugging Face files (data/tokenizers.py record_tokenizer) and the sampling
# settings the run generates with (its rollouts; not exported).
RECORDED_TOKENIZER = "tokenizer"
RECORDED_SAMPLING = "sampling.json"
# The generation_config.json of the Hugging Face model a run started from (model.init_from_hf;
# import_hf keeps it in the trainer state instead): export-hf writes it back with the token ids
# made right. The run's sampling settings (sampling.json) are for its rollouts, not the export.
RECORDED_GENERATION_CONFIG = "hf_generation_config.json"
# The keys record_run writes to sampling.json, each with its rule: a damaged or edited file (a
# `trust_remote_code`, a temperature of "hot") is refused where it is read.
_SAMPLING_KEYS = {
    "do_sample": (lambda v: isinstance(v, bool), "true or false"),
    "temperature": (lambda v: _number(v) and v > 0, "a number > 0"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: _integer(v) and v >= 0, "an integer >= 0 (0: no top-k)"),
    "max_new_tokens": (lambda v: _integer(v) and v >= 1, "an integer >= 1"),
}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_recorded_sampling(path: Path) -> dict[str, Any]:
    """The sampling settings a run recorded in `path` (its sampling.json, trainers/stage_data.py
    record_run), checked when export-hf reads the run's records (it does not export them: the
    rollout settings are not the model's generation config): a JSON object
    of record_run's keys (any of them), each of its type and range. A ConvertError names the
    file, the key and the fix."""
    fix = f"delete {path} (the run's next stage records its sampling settings again)"
    recorded = _json_object(path, "the JSON object of sampling settings a run records", fix)
    for key, value in recorded.items():
        if key not in _SAMPLING_KEYS:
            raise ConvertError(f"{path}: {key!r} is not a sampling setting (a run records only "
                               f"{', '.join(_SAMPLING_KEYS)}); remove it, or {fix}")
        valid, rule = _SAMPLING_KEYS[key]
        if not valid(value):
            what = "true (the stages sample)" if key == "do_sample" else f"the run's sampling.{key}"
            raise ConvertError(f"{path}: {key}={json.dumps(value)}: must be {rule}; set it to {what}, or {fix}")
    return recorded


def read_recorded_generation_config(path: Path) -> dict[str, Any]:
    """The Hugging Face generation config a run recorded in `path` (RECORDED_GENERATION_CONFIG,
    trainers/stage_data.py record_run): a JSON object; a ConvertError names the file and the fix."""
    fix = (f"delete {path} (the export then writes only the token ids to generation_config.json) or copy "
           "the model's generation_config.json there again")
    return _json_object(path, "a generation config (a JSON object)", fix)


def _json_object(path: Path, what: str, fix: str) -> dict[str, Any]:
    """The JSON object in `path`; a ConvertError naming the file, `what` it should hold and `fix`."""
    try:
        recorded = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
        raise ConvertError(f"{path}: unreadable ({why}); {fix}") from None
    if not isinstance(recorded, dict):
        raise ConvertError(f"{path}: holds {type(recorded).__name__} {json.dumps(recorded)[:40]}, not {what}; {fix}")
    return recorded


def _rope_json(m: ModelConfig) -> dict[str, Any] | None:
    r = m.rope_scaling
    if r.type == "linear":
        return {"rope_type": "linear", "factor": r.factor}
    if r.type == "llama3":
        return {"rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                "high_freq_factor": r.high_freq_factor,
                "original_max_position_embeddings": r.original_max_position_embeddings}
    return None


def check_hf_expressible(m: ModelConfig) -> None:
    """Refuse (ConvertError naming the field) expert settings model.family's HF class cannot
    express: transformers routes by softmax, and Mixtral has experts of intermediate_size in
    every layer and always renormalises its top-k."""
    if m.num_experts is None:
        return
    if m.moe_router_score_function != "softmax":
        raise ConvertError(f"model.moe_router_score_function={m.moe_router_score_function}: {SUPPORTED[m.family][0]} "
                           "routes by softmax; a model trained with sigmoid scores does not export to it")
    if m.family != "mixtral":
        return
    why = ("MixtralForCausalLM has experts in every layer, each of intermediate_size, and always renormalises "
           "the top-k probabilities")
    if m.moe_dense_layers:
        raise ConvertError(f"model.moe_dense_layers={m.moe_dense_layers}: {why}; a model with dense layers exports as "
                           "model.family=qwen3_moe")
    if m.expert_ffn_hidden_size != m.ffn_hidden_size:
        raise ConvertError(f"model.moe_ffn_hidden_size={m.moe_ffn_hidden_size} with model.ffn_hidden_size="
                           f"{m.ffn_hidden_size}: {why}; set model.ffn_hidden_size={m.expert_ffn_hidden_size}")
    if not m.moe_norm_topk_prob:
        raise ConvertError(f"model.moe_norm_topk_prob=false: {why}; a model without renormalisation exports as "
                           "model.family=qwen3_moe")


def _moe_json(m: ModelConfig) -> dict[str, Any]:
    """The expert fields of a qwen3_moe / mixtral config.json (check_hf_expressible has passed)."""
    common = {"num_experts_per_tok": m.moe_router_topk, "router_aux_loss_coef": m.moe_aux_loss_coef,
              "output_router_logits": False}
    if m.family == "mixtral":
        return {"num_local_experts": m.num_experts, **common, "router_jitter_noise": 0.0}
    # each listed layer dense, every other with experts (decoder_sparse_step 1 skips none)
    return {"num_experts": m.num_experts, **common, "moe_intermediate_size": m.expert_ffn_hidden_size,
            "norm_topk_prob": m.moe_norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": sorted(m.moe_dense_layers)}


def hf_config_dict(model_cfg: ModelConfig, value_model: bool, dtype: str, token_ids: dict[str, Any] | None = None,
                   extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json of an exported *ForCausalLM / *ForSequenceClassification of model.family,
    readable by transformers 4 (rope_theta, rope_scaling, torch_dtype) and 5 (rope_parameters, dtype)."""
    m = model_cfg
    check_hf_expressible(m)
    causal, classifier = SUPPORTED[m.family]
    theta = float(int(m.rotary_base))
    scaling = _rope_json(m)
    config: dict[str, Any] = {
        "architectures": [classifier if value_model else causal],
        "model_type": m.family,
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_position_embeddings or m.max_seq_length,
        "rms_norm_eps": m.norm_epsilon,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": theta},
        "attention_dropout": 0.0,
        "tie_word_embeddings": bool(m.share_embeddings_and_output_weights) and not value_model,
        "initializer_range": m.init_method_std,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if m.family == "llama":
        config.update({"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1})
    elif m.family in ("mistral", "mixtral"):
        config["sliding_window"] = None  # full attention: what our model computed
    elif m.family == "qwen3_moe":  # its config class has no layer_types
        config.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": m.num_layers,
                       "attention_bias": False})
    else:  # qwen2, qwen3
        config.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": m.num_layers,
                       "layer_types": ["full_attention"] * m.num_layers})
        if m.family == "qwen3":
            config["attention_bias"] = False
    if m.num_experts is not None:
        config.update(_moe_json(m))
    config.update({k: v for k, v in (token_ids or {}).items() if v is not None})
    if value_model:
        config.update({"num_labels": 1, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}})
    config.update(extra or {})
    return config
