"""Hugging Face `config.json` -> our ModelConfig, and what we refuse to convert.

Reads a local HF directory's config.json (no transformers, no hub) and accepts the families
our megatron GPTModel (megatron_rlhf/models/gpt.py) computes exactly: Llama 2 / 3.x (RoPE
scaling 'llama3' or 'linear'), Mistral (sliding window only where it never applies), Qwen2 /
Qwen2.5 (q/k/v biases) and dense Qwen3 (per-head q/k RMSNorm, head_dim of its own); and the
mixture-of-experts Qwen3-MoE and Mixtral, whose expert fields hf_moe.py reads. Every
refusal is a ConvertError naming the HF config field, its value and what to do. Both config
styles are read: transformers 4's (`rope_theta`, `rope_scaling`) and 5's (`rope_parameters`).
It lives in the config package (and imports no torch) because a recipe's model.from_hf_config /
init_from_hf is read here while the recipe loads; convert/hf_config.py builds the config.json
of an exported model.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rlhf.config.errors import ConvertError
from megatron_rlhf.config.hf_moe import HFMoE, dense_architecture_fields, read_moe, refused_moe_type
from megatron_rlhf.config.model import ARCHITECTURE_FIELDS, ModelConfig, RopeScalingConfig


# model_type -> (causal-LM class, sequence-classification class)
SUPPORTED = {
    "llama": ("LlamaForCausalLM", "LlamaForSequenceClassification"),
    "mistral": ("MistralForCausalLM", "MistralForSequenceClassification"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2ForSequenceClassification"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3ForSequenceClassification"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeForSequenceClassification"),
    "mixtral": ("MixtralForCausalLM", "MixtralForSequenceClassification"),
}
REFUSED_TYPES = {  # qwen2_moe and deepseek_v2/v3: hf_moe.refused_moe_type names their fields
    "llama4": "Llama 4 has mixture-of-experts layers with a shared expert, chunked attention and layers without RoPE",
    "gemma": "Gemma scales embeddings, uses (1 + weight) RMSNorm and GeGLU",
    "gemma2": "Gemma 2 uses soft-capping, sliding windows and extra norms",
    "gemma3": "Gemma 3 uses sliding windows, extra norms and (1 + weight) RMSNorm",
    "phi3": "Phi-3 fuses q/k/v and gate/up in its checkpoint and uses its own RoPE scaling",
    "olmo2": "OLMo 2 normalises after attention and MLP (and q/k over all heads), not before",
}
# transformers' default when the key is absent (MistralConfig; Qwen3MoeConfig, used only with
# use_sliding_window; MixtralConfig's is null)
DEFAULT_SLIDING_WINDOW = {"mistral": 4096, "qwen3_moe": 4096}
# rope_type -> why we refuse it (the keys of transformers' ROPE_INIT_FUNCTIONS we do not implement)
REFUSED_ROPE = {
    "dynamic": "dynamic NTK scaling changes the frequencies with the running sequence length",
    "yarn": "YaRN also rescales attention (mscale); megatron-core's GPT rotary embedding does not",
    "longrope": "LongRoPE uses per-dimension factors and rescales attention",
    "su": "LongRoPE (su) uses per-dimension factors and rescales attention",
    "proportional": "proportional RoPE is not implemented",
}


@dataclass(frozen=True)
class HFModel:
    """What we need from an HF config.json, validated, in ModelConfig terms."""

    path: Path
    model_type: str
    architecture: str
    is_value_model: bool       # *ForSequenceClassification with one label: a reward/value model
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: RopeScalingConfig
    rms_norm_eps: float
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_window: int | None  # applies to some layer: caps the exact sequence length
    dtype: str | None
    moe: HFMoE | None           # the experts (qwen3_moe, mixtral); None: a dense model
    bos_token_id: int | None
    eos_token_id: int | list | None
    pad_token_id: int | None

    @property
    def max_seq_length(self) -> int:
        """Longest sequence on which our full attention equals the HF model's."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    def architecture_fields(self) -> dict[str, Any]:
        """ModelConfig field -> value (ARCHITECTURE_FIELDS; max_seq_length: the longest exact length)."""
        return {
            "family": self.model_type, "num_layers": self.num_layers, "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads, "num_query_groups": self.num_key_value_heads,
            "head_dim": None if self.head_dim * self.num_attention_heads == self.hidden_size else self.head_dim,
            "ffn_hidden_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "max_seq_length": self.max_seq_length, "max_position_embeddings": self.max_seq_length,
            "rotary_base": self.rope_theta, "rope_scaling": self.rope_scaling,
            "norm_epsilon": self.rms_norm_eps, "qkv_bias": self.qkv_bias, "qk_layernorm": self.qk_norm,
            "share_embeddings_and_output_weights": self.tie_word_embeddings,
            **(self.moe.architecture_fields() if self.moe else dense_architecture_fields()),
        }


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


def _positive(where: str, field: str, value: Any, kind=(int, float)) -> Any:
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        raise ConvertError(f"{where}: {field}={value!r}: expected a positive number")
    return value


def _rope(raw: dict[str, Any], where: str) -> tuple[float, RopeScalingConfig]:
    """(rope_theta, scaling) after refusing RoPE variants we do not compute exactly."""
    theta = raw.get("rope_theta")
    scaling = RopeScalingConfig()
    for field in ("rope_scaling", "rope_parameters"):  # transformers 5 writes the latter (it wins)
        spec = raw.get(field)
        if spec is None:
            continue
        if not isinstance(spec, dict):
            raise ConvertError(f"{where}: {field}={spec!r}: expected an object or null")
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind in REFUSED_ROPE:
            raise ConvertError(f"{where}: {field}.rope_type={kind!r}: {REFUSED_ROPE[kind]}; supported: 'default', "
                               "'llama3' (Llama 3.1-3.3) and 'linear'. Use the model without this rope scaling "
                               "(e.g. remove it from config.json if you only need the original context length)")
        if kind not in (None, "default", "llama3", "linear"):
            raise ConvertError(f"{where}: {field}.rope_type={kind!r}: unknown RoPE type; supported: 'default', "
                               "'llama3' and 'linear'")
        factor = spec.get("partial_rotary_factor", 1.0)
        if factor not in (None, 1, 1.0):
            raise ConvertError(f"{where}: {field}.partial_rotary_factor={factor}: partial rotary embeddings are "
                               "not implemented; only 1.0 converts")
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if spec.get(key) not in (None, 1, 1.0):
                raise ConvertError(f"{where}: {field}.{key}={spec[key]}: attention rescaling is not implemented")
        if spec.get("rope_theta") is not None:
            theta = spec["rope_theta"]
        if kind == "linear":
            scaling = RopeScalingConfig(type="linear", factor=float(_positive(where, f"{field}.factor", spec.get("factor"))))
        elif kind == "llama3":
            get = lambda key: _positive(where, f"{field}.{key}", spec.get(key))  # noqa: E731
            scaling = RopeScalingConfig(
                type="llama3", factor=float(get("factor")), low_freq_factor=float(get("low_freq_factor")),
                high_freq_factor=float(get("high_freq_factor")),
                original_max_position_embeddings=int(_positive(where, f"{field}.original_max_position_embeddings",
                                                               spec.get("original_max_position_embeddings"), int)))
            if scaling.low_freq_factor >= scaling.high_freq_factor:
                raise ConvertError(f"{where}: {field}: low_freq_factor={scaling.low_freq_factor} must be below "
                                   f"high_freq_factor={scaling.high_freq_factor}")
        elif kind in (None, "default"):
            scaling = RopeScalingConfig()
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
    return float(theta), scaling


def _sliding_window(raw: dict[str, Any], model_type: str, num_layers: int, where: str) -> int | None:
    """The attention window of any layer that slides, else None (every layer attends fully)."""
    window = raw.get("sliding_window", DEFAULT_SLIDING_WINDOW.get(model_type))
    layer_types = raw.get("layer_types")
    if layer_types is not None:  # transformers 5 names each layer's attention
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ConvertError(f"{where}: layer_types contains {unknown}: only 'full_attention' and "
                               "'sliding_attention' layers are implemented")
        slides = "sliding_attention" in layer_types
    elif model_type in ("qwen2", "qwen3"):  # layers from max_window_layers on slide, if use_sliding_window
        slides = bool(raw.get("use_sliding_window")) and raw.get("max_window_layers", num_layers) < num_layers
    elif model_type == "qwen3_moe":  # transformers 5: every layer slides if use_sliding_window (4: from max_window_layers)
        slides = bool(raw.get("use_sliding_window"))
    else:
        slides = model_type in ("mistral", "mixtral")
    if raw.get("use_sliding_window") is False:
        slides = False
    if not slides or window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ConvertError(f"{where}: sliding_window={window!r}: expected a positive integer or null")
    return window


def read_hf_config(hf_dir: str | Path) -> HFModel:
    """Validate `hf_dir`/config.json; raises ConvertError for anything we cannot convert exactly."""
    hf_dir = Path(hf_dir)
    where = str(hf_dir / "config.json")
    raw = _read_json(hf_dir / "config.json")

    model_type = raw.get("model_type")
    if model_type not in SUPPORTED:
        why = refused_moe_type(raw, model_type) or REFUSED_TYPES.get(model_type, "not an architecture we convert")
        raise ConvertError(f"{where}: model_type={model_type!r}: {why}; supported model_type values: "
                           f"{sorted(SUPPORTED)} (their *ForCausalLM and *ForSequenceClassification classes)")
    causal, classifier = SUPPORTED[model_type]
    architectures = raw.get("architectures") or [causal]
    if not isinstance(architectures, list) or len(architectures) != 1 or architectures[0] not in (causal, classifier):
        raise ConvertError(f"{where}: architectures={architectures!r}: expected [{causal!r}] (a policy) or "
                           f"[{classifier!r}] (a reward/value model with num_labels=1)")
    architecture = architectures[0]
    is_value = architecture == classifier

    def need(field: str) -> int:
        value = raw.get(field)
        if value is None or isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConvertError(f"{where}: {field}={value!r}: expected a positive int")
        return value

    num_layers = need("num_hidden_layers")
    hidden = need("hidden_size")
    heads = need("num_attention_heads")
    kv_heads = raw.get("num_key_value_heads") or heads
    ffn = need("intermediate_size")
    vocab = need("vocab_size")
    max_pos = need("max_position_embeddings")
    if not isinstance(kv_heads, int) or heads % kv_heads:
        raise ConvertError(f"{where}: num_key_value_heads={kv_heads!r} must divide num_attention_heads={heads}")
    # Qwen3Config's default (Qwen3MoeConfig has none: hidden_size / heads, as the others)
    head_dim = raw.get("head_dim") or (128 if model_type == "qwen3" else None)
    if head_dim is None:
        if hidden % heads:
            raise ConvertError(f"{where}: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                               "and head_dim is not set")
        head_dim = hidden // heads
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ConvertError(f"{where}: head_dim={head_dim!r}: expected a positive even integer")
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # the same function in transformers' ACT2FN
        raise ConvertError(f"{where}: hidden_act={act!r}: our MLP is SwiGLU (silu); only hidden_act='silu' converts")
    if raw.get("attention_bias") and model_type != "qwen2":
        raise ConvertError(f"{where}: attention_bias=true: {model_type} then biases q, k, v and o_proj; our GPTModel "
                           "biases only q, k and v (as Qwen2 does); only models without attention biases convert")
    if raw.get("mlp_bias"):
        raise ConvertError(f"{where}: mlp_bias=true: our GPTModel has no MLP biases; only models without them convert")
    if raw.get("quantization_config"):
        raise ConvertError(f"{where}: quantization_config is set: quantized weights are not converted; "
                           "use the unquantized (float32/bfloat16/float16) checkpoint")
    moe = read_moe(raw, model_type, num_layers, ffn, where)
    sliding = _sliding_window(raw, model_type, num_layers, where)
    eps = raw.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
        raise ConvertError(f"{where}: rms_norm_eps={eps!r}: expected a positive number")
    theta, scaling = _rope(raw, where)
    if is_value:
        labels = raw.get("num_labels", len(raw.get("id2label") or {}) or 2)
        if labels != 1:
            raise ConvertError(f"{where}: num_labels={labels} (id2label): a reward/value model has one output "
                               "(score.weight [1, hidden_size]); set num_labels=1 (id2label with one entry)")
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    return HFModel(
        path=hf_dir, model_type=model_type, architecture=architecture, is_value_model=is_value,
        num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=max_pos,
        rope_theta=theta, rope_scaling=scaling, rms_norm_eps=float(eps), qkv_bias=model_type == "qwen2",
        qk_norm=model_type in ("qwen3", "qwen3_moe"), tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        sliding_window=sliding, dtype=dtype if isinstance(dtype, str) else None, moe=moe,
        bos_token_id=raw.get("bos_token_id"), eos_token_id=raw.get("eos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
    )


def model_config_from_hf(hf_dir: str | Path) -> dict[str, Any]:
    """ModelConfig field -> value for the HF model at `hf_dir` (ARCHITECTURE_FIELDS; the
    run's params_dtype, init_method_std, make_vocab_size_divisible_by are not among them).
    `max_seq_length` is the longest length on which the conversion is exact."""
    return read_hf_config(hf_dir).architecture_fields()


def _yaml(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _flat(fields: dict[str, Any]) -> dict[str, Any]:
    """rope_scaling as its dotted keys (only those its type uses)."""
    out = {k: v for k, v in fields.items() if k != "rope_scaling"}
    r = fields.get("rope_scaling")
    if r is not None:
        used = {None: ("type",), "linear": ("type", "factor")}.get(r.type, tuple(f.name for f in dataclasses.fields(r)))
        out.update({f"rope_scaling.{k}": getattr(r, k) for k in used})
    return out


def hf_overrides(hf_dir: str | Path) -> list[str]:
    """`model.<field>=<value>` overrides that give a recipe the HF model's architecture."""
    return [f"model.{k}={_yaml(v)}" for k, v in _flat(model_config_from_hf(hf_dir)).items()]


# Fields _comparable resolves from others (kv_heads, kv_channels, expert_ffn_hidden_size).
_RESOLVED = ("num_query_groups", "head_dim", "moe_ffn_hidden_size")


def _comparable(model_cfg: ModelConfig, field: str) -> Any:
    if field == "num_query_groups":
        return model_cfg.kv_heads
    if field == "head_dim":
        return model_cfg.kv_channels
    if field == "moe_ffn_hidden_size" and model_cfg.num_experts is not None:
        return model_cfg.expert_ffn_hidden_size  # null means ffn_hidden_size
    if field == "moe_dense_layers":
        return sorted(model_cfg.moe_dense_layers)  # a set of layers: the order is not the model's
    return getattr(model_cfg, field)


def _hf_comparable(hf: HFModel) -> dict[str, Any]:
    """hf's architecture fields as _comparable gives ours (head_dim always explicit)."""
    return {**hf.architecture_fields(), "head_dim": hf.head_dim}


def model_mismatches(model_cfg: ModelConfig, hf: HFModel, fields=ARCHITECTURE_FIELDS) -> list[str]:
    """One line per `model.<field>` (of `fields`) of `model_cfg` that differs from `hf`."""
    want = _hf_comparable(hf)
    lines = []
    for field in fields:
        value, have = want[field], _comparable(model_cfg, field)
        if field == "max_seq_length":
            if have > value:
                cap = (f"sliding_window={hf.sliding_window}" if value != hf.max_position_embeddings
                       else f"max_position_embeddings={value}")
                lines.append(f"model.max_seq_length={have}: longer than the HF model's {cap}; "
                             f"set model.max_seq_length<={value}")
            continue
        if field == "max_position_embeddings" and have is None:
            continue  # not stated: export-hf then writes max_seq_length
        if field == "share_embeddings_and_output_weights" and hf.is_value_model:
            continue  # value models never tie (GPTValueModel), whatever the HF config says
        if field == "rope_scaling":
            mine, theirs = _flat({field: have}), _flat({field: value})
            if mine != theirs:
                lines.append(f"model.rope_scaling={' '.join(f'{k}={_yaml(v)}' for k, v in mine.items())}: the HF model "
                             f"has {' '.join(f'{k}={_yaml(v)}' for k, v in theirs.items())}; set "
                             + " ".join(f"model.{k}={_yaml(v)}" for k, v in theirs.items()))
            continue
        if field in ("norm_epsilon", "rotary_base"):
            same = math.isclose(float(have), float(value), rel_tol=1e-9, abs_tol=0.0)
        else:
            same = have == value
        if not same:
            lines.append(f"model.{field}={_yaml(have)}: the HF model has {_yaml(value)}; set model.{field}={_yaml(value)}")
    return lines


def check_model_matches_hf(model_cfg: ModelConfig, hf_dir: str | Path) -> None:
    """Raise ConvertError naming each `model.<field>` of `model_cfg` that does not match the HF
    model at `hf_dir`, with the value to set."""
    hf = read_hf_config(hf_dir)
    lines = model_mismatches(model_cfg, hf)
    if lines:
        raise ConvertError(f"the model config does not match {hf.path / 'config.json'}:\n  " + "\n  ".join(lines)
                           + f"\n(or set model.from_hf_config={hf.path} and leave the architecture fields unset)")


def resolve_from_hf(model_cfg: ModelConfig, checked: set[str], replaceable: set[str]) -> tuple[ModelConfig, list[str]]:
    """The architecture of `model_cfg.hf_source`'s config.json applied to `model_cfg`.

    `checked`: dotted `model.*` keys set where (or after where) the HF directory was named:
    each that differs is an error, all listed in one ConvertError. Other architecture fields
    take the HF value; `replaceable` (keys set earlier) that change get a note.
    max_seq_length is the run's choice when set anywhere (checked against the HF limit).
    model.moe_aux_loss_coef, a training choice, is HF's router_aux_loss_coef (with a note)
    unless set anywhere."""
    hf = read_hf_config(model_cfg.hf_source)
    given = checked | replaceable

    def set_in(keys: set[str], field: str) -> bool:
        return f"model.{field}" in keys or any(k.startswith(f"model.{field}.") for k in keys)

    errors = model_mismatches(model_cfg, hf, [f for f in ARCHITECTURE_FIELDS
                                              if set_in(checked, f) or (f == "max_seq_length" and set_in(given, f))])
    if errors:
        where = "model.from_hf_config" if model_cfg.from_hf_config else "model.init_from_hf"
        raise ConvertError(f"{where}={hf.path}: these model fields differ from its config.json:\n  "
                           + "\n  ".join(errors) + "\n(or remove them: unset architecture fields are read from config.json)")
    values, notes, comparable = {}, [], _hf_comparable(hf)
    taken = {field: value for field, value in hf.architecture_fields().items()
             if not (set_in(checked, field) or (field == "max_seq_length" and set_in(given, field)))}
    # A field compared by what it resolves to (null num_query_groups: one kv head per query head)
    # is compared once the fields it resolves from hold the HF values: against the recipe's
    # num_attention_heads, a null would pass for 4 kv heads when the recipe has 4 heads.
    for group in ([f for f in taken if f not in _RESOLVED], [f for f in taken if f in _RESOLVED]):
        current = dataclasses.replace(model_cfg, **values)
        for field in group:
            if _flat({field: _comparable(current, field)}) != _flat({field: comparable[field]}):
                values[field] = taken[field]
                if set_in(replaceable, field):
                    notes.append(f"model.{field}={_yaml(getattr(model_cfg, field))} (recipe) replaced by "
                                 f"{_yaml(taken[field])} from {hf.path / 'config.json'}")
    coef = hf.moe.router_aux_loss_coef if hf.moe else None
    if coef is not None and not set_in(given, "moe_aux_loss_coef") and coef != model_cfg.moe_aux_loss_coef:
        values["moe_aux_loss_coef"] = coef
        notes.append(f"model.moe_aux_loss_coef={_yaml(coef)}: router_aux_loss_coef of {hf.path / 'config.json'} "
                     "(the load-balancing loss; set model.moe_aux_loss_coef to choose another)")
    return dataclasses.replace(model_cfg, **values), notes
