"""Hugging Face `config.json` <-> our ModelConfig, and what we refuse to convert.

Reads a local HF directory's config.json (no transformers, no hub), accepts only
Llama-family models that our megatron GPTModel (megatron_rlhf/models/gpt.py) computes
exactly: RMSNorm, SwiGLU, plain rotate-half RoPE with an integer base, no biases, full
causal attention, head_dim = hidden_size / num_attention_heads. Every refusal is a
ConvertError naming the HF config field and what to do. Both config styles are read: the
transformers 4 one (`rope_theta`, `rope_scaling`) and the transformers 5 one
(`rope_parameters`). The reverse direction builds the config.json of an exported model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ConvertError(ValueError):
    """A checkpoint or HF model that cannot be converted; the message names the HF config
    field, tensor or `model.<field>` involved, and the fix."""


# model_type -> (causal-LM class, sequence-classification class). Mistral is Llama plus
# optional sliding-window attention, which is accepted only where it never applies.
# Qwen2 is refused: its q/k/v projections have biases, and megatron_rlhf/models/gpt.py
# builds attention without them (add_qkv_bias=False).
SUPPORTED = {
    "llama": ("LlamaForCausalLM", "LlamaForSequenceClassification"),
    "mistral": ("MistralForCausalLM", "MistralForSequenceClassification"),
}
REFUSED_TYPES = {
    "qwen2": "Qwen2 has q/k/v biases, which our GPTModel does not build "
             "(megatron_rlhf/models/gpt.py sets add_qkv_bias=False)",
    "qwen3": "Qwen3 normalises queries and keys per head (q_norm/k_norm), which our GPTModel does not build",
    "gemma": "Gemma scales embeddings, uses (1 + weight) RMSNorm and GeGLU",
    "gemma2": "Gemma 2 uses soft-capping, sliding windows and extra norms",
    "phi3": "Phi-3 fuses q/k/v and gate/up in its checkpoint and uses its own RoPE scaling",
}
MISTRAL_DEFAULT_SLIDING_WINDOW = 4096  # transformers' MistralConfig default when the key is absent


@dataclass(frozen=True)
class HFModel:
    """What we need from an HF Llama-family config.json, validated."""

    path: Path
    model_type: str
    architecture: str
    is_value_model: bool       # *ForSequenceClassification with one label: a reward/value model
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    sliding_window: int | None
    dtype: str | None
    bos_token_id: int | None
    eos_token_id: int | list | None
    pad_token_id: int | None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def max_seq_length(self) -> int:
        """Longest sequence on which our full attention equals the HF model's."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConvertError(f"{path}: not found; a Hugging Face model directory holds config.json "
                           "next to its *.safetensors files (download it first: conversion is offline)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConvertError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConvertError(f"{path}: expected a JSON object")
    return data


def _rope(raw: dict[str, Any], where: str) -> float:
    """rope_theta, after refusing any RoPE variant other than plain (default) RoPE."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    theta = raw.get("rope_theta")
    for field, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
        if spec is None:
            continue
        if not isinstance(spec, dict):
            raise ConvertError(f"{where}: {field}={spec!r}: expected an object or null")
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind not in (None, "default"):
            raise ConvertError(
                f"{where}: {field}.rope_type={kind!r}: RoPE scaling is not implemented (our GPTModel "
                "uses plain RoPE; 'llama3' (Llama 3.1+), 'linear', 'dynamic', 'yarn', 'longrope' all "
                "change the rotary frequencies). Only models with rope_type 'default' (or no "
                "rope_scaling) convert exactly")
        factor = spec.get("partial_rotary_factor", 1.0)
        if factor not in (None, 1, 1.0):
            raise ConvertError(f"{where}: {field}.partial_rotary_factor={factor}: partial rotary "
                               "embeddings are not implemented; only 1.0 converts")
        if "rope_theta" in spec and spec["rope_theta"] is not None:
            theta = spec["rope_theta"]
    if raw.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
        raise ConvertError(f"{where}: partial_rotary_factor={raw['partial_rotary_factor']}: partial "
                           "rotary embeddings are not implemented; only 1.0 converts")
    theta = 10000.0 if theta is None else theta
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ConvertError(f"{where}: rope_theta={theta!r}: expected a positive number")
    if float(theta) != math.floor(float(theta)):
        raise ConvertError(f"{where}: rope_theta={theta}: our GPTModel takes an integer rotary base "
                           "(megatron_rlhf/models/gpt.py passes int(model.rotary_base)); a fractional "
                           "base would change the rotary frequencies")
    return float(theta)


def read_hf_config(hf_dir: str | Path) -> HFModel:
    """Validate `hf_dir`/config.json; raises ConvertError for anything we cannot convert exactly."""
    hf_dir = Path(hf_dir)
    where = str(hf_dir / "config.json")
    raw = _read_json(hf_dir / "config.json")

    model_type = raw.get("model_type")
    if model_type not in SUPPORTED:
        why = REFUSED_TYPES.get(model_type, "not a Llama-family architecture we convert")
        raise ConvertError(f"{where}: model_type={model_type!r}: {why}; supported model_type values: "
                           f"{sorted(SUPPORTED)} (LlamaForCausalLM / LlamaForSequenceClassification and "
                           "the Mistral equivalents)")
    causal, classifier = SUPPORTED[model_type]
    architectures = raw.get("architectures") or [causal]
    if not isinstance(architectures, list) or len(architectures) != 1 or architectures[0] not in (causal, classifier):
        raise ConvertError(f"{where}: architectures={architectures!r}: expected [{causal!r}] (a policy) or "
                           f"[{classifier!r}] (a reward/value model with num_labels=1)")
    architecture = architectures[0]
    is_value = architecture == classifier

    def need(field: str, kind=int) -> Any:
        value = raw.get(field)
        if value is None or isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
            raise ConvertError(f"{where}: {field}={value!r}: expected a positive {kind.__name__}")
        return value

    num_layers = need("num_hidden_layers")
    hidden = need("hidden_size")
    heads = need("num_attention_heads")
    kv_heads = raw.get("num_key_value_heads") or heads
    ffn = need("intermediate_size")
    vocab = need("vocab_size")
    max_pos = need("max_position_embeddings")
    if hidden % heads:
        raise ConvertError(f"{where}: hidden_size={hidden} is not divisible by num_attention_heads={heads}")
    if not isinstance(kv_heads, int) or heads % kv_heads:
        raise ConvertError(f"{where}: num_key_value_heads={kv_heads!r} must divide num_attention_heads={heads}")
    head_dim = raw.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        raise ConvertError(f"{where}: head_dim={head_dim} differs from hidden_size / num_attention_heads = "
                           f"{hidden // heads}; our GPTModel sets kv_channels = hidden_size // "
                           "num_attention_heads, so this model cannot be represented")
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # the same function in transformers' ACT2FN
        raise ConvertError(f"{where}: hidden_act={act!r}: our MLP is SwiGLU (silu); only hidden_act='silu' converts")
    for field in ("attention_bias", "mlp_bias"):
        if raw.get(field):
            raise ConvertError(f"{where}: {field}=true: our GPTModel has no linear biases "
                               "(add_bias_linear=False, add_qkv_bias=False); only models without them convert")
    if raw.get("quantization_config"):
        raise ConvertError(f"{where}: quantization_config is set: quantized weights are not converted; "
                           "use the unquantized (float32/bfloat16/float16) checkpoint")
    layer_types = raw.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ConvertError(f"{where}: layer_types={sorted(set(layer_types))}: only 'full_attention' "
                           "layers are implemented")
    sliding = raw.get("sliding_window", MISTRAL_DEFAULT_SLIDING_WINDOW if model_type == "mistral" else None)
    if raw.get("use_sliding_window") is False:
        sliding = None
    if sliding is not None and (isinstance(sliding, bool) or not isinstance(sliding, int) or sliding <= 0):
        raise ConvertError(f"{where}: sliding_window={sliding!r}: expected a positive integer or null")
    eps = raw.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
        raise ConvertError(f"{where}: rms_norm_eps={eps!r}: expected a positive number")
    theta = _rope(raw, where)
    if is_value:
        labels = raw.get("num_labels", len(raw.get("id2label") or {}) or 2)
        if labels != 1:
            raise ConvertError(f"{where}: num_labels={labels} (id2label): a reward/value model has one output "
                               "(score.weight [1, hidden_size]); set num_labels=1 (id2label with one entry)")
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    return HFModel(
        path=hf_dir, model_type=model_type, architecture=architecture, is_value_model=is_value,
        num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=max_pos, rope_theta=theta,
        rms_norm_eps=float(eps), tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        sliding_window=sliding, dtype=dtype if isinstance(dtype, str) else None,
        bos_token_id=raw.get("bos_token_id"), eos_token_id=raw.get("eos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
    )


def model_config_from_hf(hf_dir: str | Path) -> dict[str, Any]:
    """ModelConfig field -> value for the HF model at `hf_dir` (architecture fields only:
    params_dtype, init_method_std and make_vocab_size_divisible_by stay the run's choice).
    `max_seq_length` is the longest length on which the conversion is exact."""
    hf = read_hf_config(hf_dir)
    return {
        "num_layers": hf.num_layers,
        "hidden_size": hf.hidden_size,
        "num_attention_heads": hf.num_attention_heads,
        "num_query_groups": hf.num_key_value_heads,
        "ffn_hidden_size": hf.intermediate_size,
        "vocab_size": hf.vocab_size,
        "max_seq_length": hf.max_seq_length,
        "rotary_base": hf.rope_theta,
        "norm_epsilon": hf.rms_norm_eps,
        "share_embeddings_and_output_weights": hf.tie_word_embeddings,
    }


def model_mismatches(model_cfg, hf: HFModel) -> list[str]:
    """One line per `model.<field>` of `model_cfg` (a ModelConfig) that differs from `hf`."""
    want = model_config_from_hf(hf.path)
    lines = []
    for field, value in want.items():
        have = model_cfg.kv_heads if field == "num_query_groups" else getattr(model_cfg, field)
        if field == "max_seq_length":
            if have > value:
                cap = (f"sliding_window={hf.sliding_window}" if value != hf.max_position_embeddings
                       else f"max_position_embeddings={value}")
                lines.append(f"model.max_seq_length={have}: longer than the HF model's {cap}; "
                             f"set model.max_seq_length<={value}")
            continue
        if field == "share_embeddings_and_output_weights" and hf.is_value_model:
            continue  # value models never tie (GPTValueModel), whatever the HF config says
        if field == "norm_epsilon" or field == "rotary_base":
            same = math.isclose(float(have), float(value), rel_tol=1e-9, abs_tol=0.0)
        else:
            same = have == value
        if not same:
            lines.append(f"model.{field}={have!r}: the HF model has {value!r}; set model.{field}={value!r}")
    return lines


def check_model_matches_hf(cfg, hf_dir: str | Path) -> None:
    """Raise ConvertError naming each `model.<field>` of `cfg` (a Config or a ModelConfig)
    that does not match the HF model at `hf_dir`, with the value to set."""
    hf = read_hf_config(hf_dir)
    model_cfg = getattr(cfg, "model", cfg)
    lines = model_mismatches(model_cfg, hf)
    if lines:
        fix = " ".join(f"model.{k}={v}" for k, v in model_config_from_hf(hf_dir).items())
        raise ConvertError(f"the model config does not match {hf.path / 'config.json'}:\n  " + "\n  ".join(lines)
                           + f"\n(all architecture overrides for this model: {fix})")


# ----------------------------------------------------------------------------- export


def hf_config_dict(model_cfg, value_model: bool, dtype: str, token_ids: dict[str, Any] | None = None,
                   extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json of an exported LlamaForCausalLM / LlamaForSequenceClassification, readable
    by transformers 4 (rope_theta, rope_scaling, torch_dtype) and 5 (rope_parameters, dtype)."""
    m = model_cfg
    config: dict[str, Any] = {
        "architectures": ["LlamaForSequenceClassification" if value_model else "LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.hidden_size // m.num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_seq_length,
        "rms_norm_eps": m.norm_epsilon,
        "rope_theta": float(int(m.rotary_base)),
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(int(m.rotary_base))},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": bool(m.share_embeddings_and_output_weights) and not value_model,
        "initializer_range": m.init_method_std,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    config.update({k: v for k, v in (token_ids or {}).items() if v is not None})
    if value_model:
        config.update({"num_labels": 1, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}})
    config.update(extra or {})
    return config
