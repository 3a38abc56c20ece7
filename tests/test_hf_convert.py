"""Hugging Face import/export (megatron_rlhf/convert) against transformers itself.

Fast tests: config reading and refusals, the model-config check and from_hf_config, the
tensor mapping (TE and local spec names, TP shards, q/k/v biases, q/k norms) and slice
reading, RoPE scaling frequencies. Slow tests (torchrun, world size <= 2): tiny random models
(GQA 4 heads / 2 kv heads, 4 layers, vocabulary 100 padded to 128) of every family: Llama
untied and sharded, tied, with Llama 3.1 RoPE scaling (original window 32, sequences of 40);
Qwen2 (q/k/v biases, tied), Qwen3 (q/k norms, head_dim 32 != 64 / 4); and a
*ForSequenceClassification reward model of Llama, Qwen2 and Qwen3 - loaded at TP1-PP1,
TP2-PP1 and TP1-PP2 give transformers' logits and log-probs within 1e-5; import -> export
returns the original tensors exactly; trained roles export to directories transformers loads
and that score like our roles.
"""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_rlhf.config import ConfigError, ModelConfig, RopeScalingConfig, load_config, validate
from megatron_rlhf.convert import (
    ConvertError, check_model_matches_hf, export_hf, hf_overrides, model_config_from_hf,
)
from megatron_rlhf.convert.hf_weights import Dims, hf_layer_tensors, shard_for_param
from megatron_rlhf.convert.safetensors_io import HFWeights

ATOL = 1e-5
VOCAB, SEQ, BATCH = 100, 40, 4
BASE_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
}


def write_config(directory: Path, **changes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = {**BASE_CONFIG, **changes}
    (directory / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v != "<drop>"}))
    return directory


# ----------------------------------------------------------------------------- fast: config


LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def test_model_config_from_hf_reads_both_config_styles(tmp_path):
    old = model_config_from_hf(write_config(tmp_path / "old"))
    assert old == {"family": "llama", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                   "num_query_groups": 2, "head_dim": None, "ffn_hidden_size": 128, "vocab_size": VOCAB,
                   "max_seq_length": 64, "max_position_embeddings": 64, "rotary_base": 10000.0,
                   "rope_scaling": RopeScalingConfig(),
                   "norm_epsilon": 1e-5, "qkv_bias": False, "qk_layernorm": False,
                   "share_embeddings_and_output_weights": False,
                   # a dense model: no experts, the MoE fields at their defaults (tests/test_moe_config.py)
                   "num_experts": None, "moe_router_topk": 2, "moe_ffn_hidden_size": None,
                   "moe_router_score_function": "softmax", "moe_norm_topk_prob": True, "moe_dense_layers": []}
    new = write_config(tmp_path / "new", rope_theta="<drop>", rope_scaling="<drop>",
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=True)
    got = model_config_from_hf(new)
    assert got["rotary_base"] == 500000.0 and got["share_embeddings_and_output_weights"] is True
    # Llama 3.1-3.3: RoPE scaling, in both styles
    want = RopeScalingConfig("llama3", 8.0, 1.0, 4.0, 8192)
    for i, style in enumerate(({"rope_scaling": LLAMA31_ROPE}, {"rope_parameters": {**LLAMA31_ROPE, "rope_theta": 5e5},
                                                                  "rope_theta": "<drop>", "rope_scaling": "<drop>"})):
        got = model_config_from_hf(write_config(tmp_path / f"llama31_{i}", max_position_embeddings=131072, **style))
        assert got["rope_scaling"] == want and got["max_seq_length"] == got["max_position_embeddings"] == 131072
    linear = model_config_from_hf(write_config(tmp_path / "linear", rope_scaling={"type": "linear", "factor": 2.0}))
    assert linear["rope_scaling"] == RopeScalingConfig("linear", 2.0)
    # Qwen2.5: q/k/v biases, its sliding window off; Qwen3: q/k norms, head_dim of its own
    qwen2 = model_config_from_hf(write_config(tmp_path / "qwen2", model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                                              use_sliding_window=False, sliding_window=131072, max_window_layers=28))
    assert (qwen2["family"], qwen2["qkv_bias"], qwen2["qk_layernorm"], qwen2["max_seq_length"]) == ("qwen2", True, False, 64)
    qwen3 = model_config_from_hf(write_config(tmp_path / "qwen3", model_type="qwen3", architectures=["Qwen3ForCausalLM"],
                                              head_dim=32, use_sliding_window=False, sliding_window=None))
    assert (qwen3["family"], qwen3["qkv_bias"], qwen3["qk_layernorm"], qwen3["head_dim"]) == ("qwen3", False, True, 32)
    # a Qwen sliding window that applies to some layer caps the exact length, as Mistral's
    sliding = write_config(tmp_path / "qwen2_sliding", model_type="qwen2", use_sliding_window=True, sliding_window=32,
                           max_window_layers=2, architectures=["Qwen2ForCausalLM"])
    assert model_config_from_hf(sliding)["max_seq_length"] == 32
    # Mistral: sliding-window attention equals full attention up to the window
    mistral = write_config(tmp_path / "mistral", model_type="mistral", architectures=["MistralForCausalLM"],
                           max_position_embeddings=4096, sliding_window=32)
    assert model_config_from_hf(mistral)["max_seq_length"] == 32


REFUSALS = {
    "model_type='qwen2_moe'": {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"]},
    "model_type='gemma2'": {"model_type": "gemma2"},
    "architectures": {"architectures": ["LlamaForTokenClassification"]},
    "rope_scaling.rope_type='dynamic'": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    "rope_parameters.rope_type='yarn'": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
    "rope_scaling.rope_type='longrope'": {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]}},
    "rope_scaling.factor": {"rope_scaling": {**LLAMA31_ROPE, "factor": None}},
    "rope_scaling: low_freq_factor=4.0": {"rope_scaling": {**LLAMA31_ROPE, "low_freq_factor": 4.0}},
    "partial_rotary_factor": {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
    "rope_theta": {"rope_theta": 10000.5},
    "attention_bias": {"attention_bias": True},
    "attention_bias=true: qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "attention_bias": True},
    "mlp_bias": {"mlp_bias": True},
    "num_experts": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "num_experts": 8},
    "hidden_act": {"hidden_act": "gelu"},
    "head_dim": {"head_dim": 31},
    "num_key_value_heads": {"num_key_value_heads": 3},
    "num_labels": {"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "a", "1": "b"}},
    "quantization_config": {"quantization_config": {"quant_method": "gptq"}},
    "layer_types": {"layer_types": ["chunked_attention"] * 4},
    "intermediate_size": {"intermediate_size": None},
}


@pytest.mark.parametrize("field", list(REFUSALS))
def test_unsupported_config_fields_are_refused_by_name(tmp_path, field):
    directory = write_config(tmp_path, **REFUSALS[field])
    with pytest.raises(ConvertError) as err:
        model_config_from_hf(directory)
    assert field in str(err.value)
    assert "config.json" in str(err.value)


def test_missing_config_and_weights_are_reported(tmp_path):
    with pytest.raises(ConvertError, match="config.json"):
        model_config_from_hf(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConvertError, match="pytorch_model.bin"):
        HFWeights(tmp_path)


def test_sliding_window_limits_max_seq_length(tmp_path):
    mistral = write_config(tmp_path, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=32)
    cfg = load_config(None, hf_overrides(mistral))
    check_model_matches_hf(cfg.model, mistral)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, max_seq_length=64))
    with pytest.raises(ConvertError, match=r"model.max_seq_length=64.*sliding_window=32"):
        check_model_matches_hf(cfg.model, mistral)


def test_check_model_matches_hf_names_every_field(tmp_path):
    directory = write_config(tmp_path, rms_norm_eps=1e-6, tie_word_embeddings=True)
    cfg = load_config(None, ["model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4",
                             "model.ffn_hidden_size=128", "model.vocab_size=100"])
    with pytest.raises(ConvertError) as err:
        check_model_matches_hf(cfg.model, directory)
    message = str(err.value)
    for line in ("model.num_query_groups=4", "set model.num_query_groups=2", "model.norm_epsilon=1e-05",
                 "set model.norm_epsilon=1e-06", "set model.share_embeddings_and_output_weights=true"):
        assert line in message
    assert "model.hidden_size" not in message.split("(all")[0]  # only what differs
    fixed = load_config(None, hf_overrides(directory))
    check_model_matches_hf(fixed.model, directory)


def write_recipe(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_architecture_comes_from_the_hf_config_json(tmp_path):
    """model.init_from_hf / from_hf_config fill the architecture; fields set where the HF
    directory is named (or later) are checked, all differences at once; earlier ones replaced."""
    hf = write_config(tmp_path / "hf", tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=128,
                      rope_scaling={**LLAMA31_ROPE, "original_max_position_embeddings": 32})
    recipe = write_recipe(tmp_path / "recipe.yaml", "model: {num_layers: 2, hidden_size: 32, max_seq_length: 96}\n")
    cfg = load_config(recipe, [f"model.init_from_hf={hf}"])
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.kv_heads, m.ffn_hidden_size, m.vocab_size) == (4, 64, 2, 128, VOCAB)
    assert m.share_embeddings_and_output_weights and m.norm_epsilon == 1e-6 and m.rope_scaling.type == "llama3"
    assert m.rope_scaling.original_max_position_embeddings == 32
    assert m.max_seq_length == 96  # the run's choice, within the HF limit
    assert m.max_position_embeddings == 128  # the model's, which export-hf writes back
    notes = "\n".join(cfg.hf_notes)
    assert "model.num_layers=2 (recipe) replaced by 4" in notes and "model.hidden_size=32 (recipe)" in notes
    validate(cfg)
    from megatron_rlhf.trainers.stage_data import preflight  # what the launcher prints before workers start

    lines = preflight(cfg, "sft")
    assert lines[0].startswith("model.num_layers=2 (recipe) replaced by 4") and "tokenizer: 87 tokens" in lines[-1]
    # overrides next to the HF directory are checked: every difference in one error, none applied
    with pytest.raises(ConfigError) as err:
        load_config(recipe, [f"model.init_from_hf={hf}", "model.num_layers=3", "model.rope_scaling.type=null",
                             "model.num_query_groups=4", "model.max_seq_length=256"])
    message = str(err.value)
    for line in ("model.num_layers=3: the HF model has 4; set model.num_layers=4", "set model.num_query_groups=2",
                 "model.rope_scaling.type=llama3", "set model.max_seq_length<=128", "model.init_from_hf="):
        assert line in message, line
    assert "hidden_size" not in message  # set by the recipe, before the HF directory was named
    # named in the recipe itself: the recipe's own fields are checked, its base's replaced
    write_recipe(tmp_path / "base.yaml", "model: {num_layers: 7, ffn_hidden_size: 512}\n")
    own = write_recipe(tmp_path / "own.yaml", f"base: base.yaml\nmodel: {{from_hf_config: {hf}, hidden_size: 32}}\n")
    with pytest.raises(ConfigError, match="model.from_hf_config=.*\n  model.hidden_size=32: the HF model has 64"):
        load_config(own)
    write_recipe(tmp_path / "own.yaml", f"base: base.yaml\nmodel: {{from_hf_config: {hf}, hidden_size: 64}}\n")
    assert load_config(own).model.num_layers == 4
    with pytest.raises(ConfigError, match="config.json: not found"):
        load_config(None, [f"model.from_hf_config={tmp_path / 'nowhere'}"])


def test_hf_overrides_give_the_same_config(tmp_path):
    hf = write_config(tmp_path / "hf", model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32,
                      rope_scaling={"rope_type": "linear", "factor": 2.0})
    from_overrides = load_config(None, hf_overrides(hf)).model
    from_config = load_config(None, [f"model.from_hf_config={hf}"]).model
    assert dataclasses.replace(from_config, from_hf_config=None) == from_overrides
    check_model_matches_hf(from_overrides, hf)


def test_kv_heads_that_equal_the_default_heads_are_taken(tmp_path):
    """Qwen2.5-7B: 28 heads, 4 kv heads, and model.num_attention_heads defaults to 4. The null
    num_query_groups (one kv head per query head) resolved against the default heads looked
    equal to the HF kv heads and was kept: 28 kv heads. Resolved fields are compared last."""
    hf = write_config(tmp_path, model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=3584,
                      intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                      vocab_size=152064, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768)
    model = load_config(None, [f"model.from_hf_config={hf}"]).model
    assert (model.num_attention_heads, model.num_query_groups, model.kv_heads) == (28, 4, 4)
    check_model_matches_hf(model, hf)
    # head_dim likewise: the defaults' 64 / 4 heads = 16 = this model's head_dim (512 / 8 heads would be 64)
    hf = write_config(tmp_path / "hd", hidden_size=512, num_attention_heads=8, num_key_value_heads=8, head_dim=16)
    model = load_config(None, [f"model.from_hf_config={hf}"]).model
    assert (model.hidden_size, model.head_dim, model.kv_channels) == (512, 16, 16)
    check_model_matches_hf(model, hf)


# The architecture fields of published config.json files (copied from the model cards'
# repositories), for the recipes that name them.
PUBLISHED = {
    "llama3_70b.yaml": {  # Llama-3.3-70B-Instruct (Llama 3.1 70B: the same fields)
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 8192, "intermediate_size": 28672, "max_position_embeddings": 131072,
        "mlp_bias": False, "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                                "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256},
    "qwen3_8b.yaml": {  # Qwen3-8B
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
        "max_window_layers": 36, "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936},
}
PUBLISHED["qwen3_30b_a3b_grpo.yaml"] = {  # Qwen3-30B-A3B
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "num_attention_heads": 32, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "output_router_logits": False}
PUBLISHED["qwen3_235b_a22b_grpo.yaml"] = {**PUBLISHED["qwen3_30b_a3b_grpo.yaml"],  # Qwen3-235B-A22B
                                         "hidden_size": 4096, "intermediate_size": 12288, "max_window_layers": 94,
                                         "num_attention_heads": 64, "num_hidden_layers": 94,
                                         "moe_intermediate_size": 1536}
PUBLISHED["llama3_8b.yaml"] = {**PUBLISHED["llama3_70b.yaml"],  # Llama-3.1-8B: a smaller Llama 3.3 70B
                               "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                               "num_hidden_layers": 32}


@pytest.mark.parametrize("recipe", list(PUBLISHED))
def test_recipes_are_the_published_models(recipe, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED[recipe]))
    cfg = load_config(Path(__file__).resolve().parent.parent / "pipelines" / recipe)
    check_model_matches_hf(cfg.model, tmp_path)
    # and with the weights named on the command line, the recipe's fields are the model's
    assert load_config(Path(__file__).resolve().parent.parent / "pipelines" / recipe,
                       [f"model.init_from_hf={tmp_path}"]).model == dataclasses.replace(cfg.model, init_from_hf=str(tmp_path))


FAMILY_ERRORS = {
    "model.qkv_bias=True with model.family='llama'": ["model.qkv_bias=true"],
    "model.qkv_bias=False with model.family='qwen2'": ["model.family=qwen2"],
    "model.qk_layernorm=True with model.family='llama'": ["model.qk_layernorm=true"],
    "model.family='gemma'": ["model.family=gemma"],
    "model.rope_scaling.type='yarn'": ["model.rope_scaling.type=yarn"],
    "model.rope_scaling.factor=0.5": ["model.rope_scaling.type=linear", "model.rope_scaling.factor=0.5"],
    "model.rope_scaling: low_freq_factor=4.0": ["model.rope_scaling.type=llama3", "model.rope_scaling.low_freq_factor=4"],
    "model.head_dim=7": ["model.head_dim=7"],
    "model.max_seq_length=128: longer than model.max_position_embeddings=64": ["model.max_position_embeddings=64"],
}


@pytest.mark.parametrize("expected", list(FAMILY_ERRORS))
def test_model_features_are_validated_by_name(expected):
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, FAMILY_ERRORS[expected]))
    assert expected in str(err.value)


def test_head_dim_lifts_the_divisibility_rule():
    cfg = validate(load_config(None, ["model.hidden_size=60", "model.num_attention_heads=4", "model.head_dim=32"]))
    assert cfg.model.kv_channels == 32
    with pytest.raises(ConfigError, match="model.head_dim"):
        validate(load_config(None, ["model.hidden_size=60", "model.num_attention_heads=8"]))


@pytest.mark.parametrize("scaling", [dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=32),
                                     dict(rope_type="llama3", factor=32.0, low_freq_factor=2.0, high_freq_factor=8.0,
                                          original_max_position_embeddings=8192),
                                     dict(rope_type="linear", factor=4.0)], ids=["llama3_small", "llama3_2", "linear"])
def test_rope_scaling_frequencies_equal_transformers(scaling):
    """Our scaled RoPE frequencies (models/gpt.py) are transformers' for the same config; the
    small-window case puts frequencies in all three llama3 bands (kept, blended, divided)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_rlhf.models.gpt import scaled_inv_freq

    theta, head_dim = 10000.0, 16
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=theta, rope_scaling=dict(scaling))
    want, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
    assert attention_factor == 1.0
    m = ModelConfig(rope_scaling=RopeScalingConfig(type=scaling["rope_type"], factor=scaling["factor"],
                                                   **{k: v for k, v in scaling.items() if k not in ("rope_type", "factor")}))
    plain = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # megatron's
    got = scaled_inv_freq(plain, m)
    assert torch.allclose(got, want.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(got, plain)


# ----------------------------------------------------------------------------- fast: tensor mapping


def random_hf_layer(d: Dims, g: torch.Generator) -> dict[str, torch.Tensor]:
    h, hd, p = d.hidden, d.head_dim, "model.layers.0"
    shapes = {"q_proj": (d.heads * hd, h), "k_proj": (d.kv_heads * hd, h), "v_proj": (d.kv_heads * hd, h),
              "o_proj": (h, d.heads * hd)}
    out = {f"{p}.self_attn.{k}.weight": torch.randn(s, generator=g) for k, s in shapes.items()}
    out.update({f"{p}.mlp.{k}.weight": torch.randn(s, generator=g) for k, s in
                {"gate_proj": (d.ffn, h), "up_proj": (d.ffn, h), "down_proj": (h, d.ffn)}.items()})
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[f"{p}.{norm}.weight"] = torch.randn(h, generator=g)
    if d.qkv_bias:
        out.update({f"{p}.self_attn.{k}.bias": torch.randn(shapes[k][0], generator=g) for k in ("q_proj", "k_proj", "v_proj")})
    if d.qk_norm:
        out.update({f"{p}.self_attn.{k}.weight": torch.randn(hd, generator=g) for k in ("q_norm", "k_norm")})
    return out


LOCAL = {"input_norm": "input_layernorm.weight", "post_norm": "pre_mlp_layernorm.weight"}
TE = {"input_norm": "self_attention.linear_qkv.layer_norm_weight", "post_norm": "mlp.linear_fc1.layer_norm_weight"}
FUSED = {"qkv": "self_attention.linear_qkv.weight", "o_proj": "self_attention.linear_proj.weight",
         "fc1": "mlp.linear_fc1.weight", "down": "mlp.linear_fc2.weight"}
CAT_DIM = {"input_norm": None, "post_norm": None, "qkv": 0, "qkv_bias": 0, "q_norm": None, "k_norm": None,
           "fc1": None, "o_proj": 1, "down": 1}
# Llama (head_dim = 64 / 8), Qwen2 (q/k/v biases), Qwen3 (q/k norms, head_dim 16 != 64 / 8)
FEATURES = {"llama": dict(head_dim=8), "qwen2": dict(head_dim=8, qkv_bias=True), "qwen3": dict(head_dim=16, qk_norm=True)}


@pytest.mark.parametrize("family", list(FEATURES))
@pytest.mark.parametrize("spec", [LOCAL, TE], ids=["local", "transformer_engine"])
def test_tp_shards_reassemble_to_the_checkpoint_layout_and_back(spec, family, tmp_path):
    """Import shards at TP=1, 2 (both spec's names) -> the TP-independent layout megatron's
    checkpoints store (qkv weight and bias: TP shards concatenated; fc1: [gate; up] of all
    shards; q/k norms replicated) -> export mapping -> the original HF tensors."""
    d = Dims(num_layers=1, hidden=64, heads=8, kv_heads=2, ffn=96, vocab=100, padded_vocab=128, tied=False,
             **FEATURES[family])
    hf = random_hf_layer(d, torch.Generator().manual_seed(0))

    def read(name, rows=None, cols=None):
        t = hf[name]
        t = t[rows[0]: rows[1]] if rows else t
        return t[:, cols[0]: cols[1]] if cols else t

    names = {**spec, **FUSED}
    if d.qkv_bias:
        names["qkv_bias"] = "self_attention.linear_qkv.bias"
    if d.qk_norm:
        names.update(q_norm="self_attention.q_layernorm.weight", k_norm="self_attention.k_layernorm.weight")
    for tp in (1, 2):
        shards = {kind: [shard_for_param(f"decoder.layers.0.{names[kind]}", read, d, r, tp, lambda i: i, False,
                                         False, torch.float32) for r in range(tp)] for kind in names}
        full = {}
        for kind, parts in shards.items():
            if CAT_DIM[kind] is not None:
                full[kind] = torch.cat(parts, CAT_DIM[kind])
            elif kind == "fc1":  # the checkpoint stores all gate rows, then all up rows
                halves = [p.chunk(2) for p in parts]
                full[kind] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
            else:
                full[kind] = parts[0]
        back = hf_layer_tensors(0, full.__getitem__, d)
        assert back.keys() == hf.keys()
        for name in hf:
            assert torch.equal(back[name], hf[name]), (tp, name)
    # the fused QKV groups [q heads of group g, k_g, v_g]
    qkv = shard_for_param(f"decoder.layers.0.{FUSED['qkv']}", read, d, 0, 1, lambda i: i, False, False, torch.float32)
    hd = d.head_dim
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(qkv[: 4 * hd], q[: 4 * hd])
    assert torch.equal(qkv[4 * hd: 5 * hd], hf["model.layers.0.self_attn.k_proj.weight"][:hd])
    assert torch.equal(qkv[5 * hd: 6 * hd], hf["model.layers.0.self_attn.v_proj.weight"][:hd])
    if d.qkv_bias:
        bias = shard_for_param("decoder.layers.0.self_attention.linear_qkv.bias", read, d, 1, 2, lambda i: i, False,
                               False, torch.float32)  # TP rank 1: group 1
        assert torch.equal(bias[4 * hd: 5 * hd], hf["model.layers.0.self_attn.k_proj.bias"][hd:])


def test_vocab_shards_are_padded_with_zero_rows():
    d = Dims(num_layers=1, hidden=8, heads=2, kv_heads=2, ffn=16, vocab=100, padded_vocab=128, tied=True, head_dim=4)
    emb = torch.randn(100, 8)
    read = lambda name, rows=None, cols=None: emb[rows[0]: rows[1]]  # noqa: E731
    shards = [shard_for_param("output_layer.weight", read, d, r, 2, None, False, False, torch.float32)
              for r in range(2)]
    assert torch.equal(shards[0], emb[:64])
    assert torch.equal(shards[1][:36], emb[64:]) and not shards[1][36:].any()


def test_import_refuses_before_starting_anything(tmp_path):
    from megatron_rlhf.convert import import_hf

    hf = write_config(tmp_path / "hf")
    cfg = load_config(None, hf_overrides(hf))
    with pytest.raises(ConvertError, match="role 'reward' needs a \\*ForSequenceClassification.*rm.init_from"):
        import_hf(cfg, hf, tmp_path / "out", role="reward")
    (tmp_path / "out" / "iter_0000000").mkdir(parents=True)
    with pytest.raises(ConvertError, match="already holds checkpoints"):
        import_hf(cfg, hf, tmp_path / "out")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hidden_size=128))
    with pytest.raises(ConvertError, match="set model.hidden_size=64"):
        import_hf(cfg, hf, tmp_path / "new")


def tiny_llama_hf(directory: Path, generation: dict | None) -> Path:
    """A 1-layer random LlamaForCausalLM (bos 3, eos 1, pad 0) with `generation` as its
    generation_config.json (None: none)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         bos_token_id=3, eos_token_id=1, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(directory)
    (directory / "generation_config.json").unlink(missing_ok=True)
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


def test_the_export_carries_the_models_generation_config_not_the_runs_sampling(tmp_path):
    """import -> export writes the HF model's own generation_config.json back, with the token
    ids made right, not the run's rollout settings (sampling.json: max_new_tokens 24 would cut
    every answer of a plain generate()); a model with none gets the token ids alone. A run from
    model.init_from_hf records the model's file (record_run), which export reads the same way."""
    from transformers import GenerationConfig

    from megatron_rlhf.convert import export_hf, import_hf

    own = {"bos_token_id": 3, "eos_token_id": [1, 2], "do_sample": True, "temperature": 0.6, "top_p": 0.9,
           "repetition_penalty": 1.1, "transformers_version": "4.45.0"}
    rollouts = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 24}
    ids = {"bos_token_id": 3, "eos_token_id": 1, "pad_token_id": 0}  # config.json's: the import keeps them
    for name, generation in (("chat", own), ("bare", None)):
        hf = tiny_llama_hf(tmp_path / name, generation)
        import_hf(load_config(None, hf_overrides(hf)), hf, tmp_path / f"{name}_imported")
        (tmp_path / f"{name}_imported" / "sampling.json").write_text(json.dumps(rollouts))  # as a run records them
        out = export_hf(tmp_path / f"{name}_imported", "actor", tmp_path / f"{name}_exported")
        exported = json.loads((out / "generation_config.json").read_text())
        assert exported == {**(generation or {}), **ids}, name
        assert "max_new_tokens" not in exported and GenerationConfig.from_pretrained(out).max_new_tokens is None
    # a run from model.init_from_hf: the file it recorded, read with the checkpoint (damaged: named)
    from megatron_rlhf.convert.hf_io import _recorded_with_checkpoint
    from megatron_rlhf.trainers.stage_data import record_run, run_dir, tokenizer_for

    cfg = load_config(None, ["data.task=sentiment", f"model.init_from_hf={tmp_path / 'chat'}",
                             f"checkpoint.root={tmp_path / 'runs'}", *hf_overrides(tmp_path / "chat")])
    record_run(cfg, tokenizer_for(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer="builtin"))))
    run = run_dir(cfg)
    assert json.loads((run / "hf_generation_config.json").read_text()) == own
    shutil.copytree(tmp_path / "bare_imported" / "iter_0000000", run / "sft" / "iter_0000000")  # no generation config
    assert _recorded_with_checkpoint(run / "sft" / "iter_0000000")[2]["hf_generation_config"] == own
    (run / "hf_generation_config.json").write_text("[1, 2]")
    with pytest.raises(ConvertError, match="hf_generation_config.json: holds list .*, not a generation config.*delete"):
        _recorded_with_checkpoint(run / "sft" / "iter_0000000")


def test_sharded_safetensors_are_read_by_slices(tmp_path):
    from safetensors.torch import save_file

    a, b = torch.randn(6, 4), torch.randn(3, 5)
    save_file({"a": a}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": b}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    w = HFWeights(tmp_path)
    assert torch.equal(w.read("a", rows=(2, 4)), a[2:4])
    assert torch.equal(w.read("b", cols=(1, 3)), b[:, 1:3])
    assert torch.equal(w.read("a", rows=(1, 2), cols=(0, 2)), a[1:2, :2])
    with pytest.raises(ConvertError, match="'c'"):
        w.read("c")


# ----------------------------------------------------------------------------- slow: real models

LAYOUTS = {"tp1pp1": (1, 1, 1), "tp2pp1": (2, 1, 2), "tp1pp2": (1, 2, 2)}
POLICIES = ("untied", "tied", "llama31", "qwen2", "qwen3")
REWARD_MODELS = ("rm", "qwen2_rm", "qwen3_rm")
# Llama 3.1's RoPE scaling with a small original window, so that sequences of SEQ = 40 run
# past it and all three frequency bands (kept, blended, divided by the factor) are used.
SMALL_WINDOW_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 32}


def hf_config(family="llama", **kw):
    import transformers

    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    return cls[family](**{**base, **kw})


def hf_classes(family):
    import transformers

    prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    return getattr(transformers, f"{prefix}ForCausalLM"), getattr(transformers, f"{prefix}ForSequenceClassification")


# variant -> (family, config changes); *_rm are *ForSequenceClassification reward models
VARIANTS = {
    "untied": ("llama", dict(rms_norm_eps=1e-5)),
    "tied": ("llama", dict(tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=500000.0)),
    "llama31": ("llama", dict(rope_theta=500000.0, rope_scaling=SMALL_WINDOW_LLAMA3)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen3": ("qwen3", dict(head_dim=32, rope_theta=1000000.0)),  # 4 heads x 32 != hidden 64
    "rm": ("llama", dict(num_labels=1, pad_token_id=0)),
    "qwen2_rm": ("qwen2", dict(num_labels=1, pad_token_id=0)),
    "qwen3_rm": ("qwen3", dict(num_labels=1, pad_token_id=0, head_dim=8)),
}


def random_hf_model(cls, config, seed):
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # random norms and biases: a swapped or misplaced one must show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return model


def make_batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
    lengths = torch.tensor([SEQ, 9, 35, 5])  # two rows past the small RoPE window (32)
    tokens = tokens.masked_fill(torch.arange(SEQ) >= lengths[:, None], 0)  # right padding, pad id 0
    return {"tokens": tokens, "lengths": lengths}


def hf_logprobs(logits, tokens):
    lp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    return torch.cat([lp, torch.zeros_like(lp[:, :1])], dim=1)  # our last column is 0


def hf_policy_outputs(model, tokens):
    with torch.no_grad():
        logits = model(tokens).logits.float()
    return {"logits": logits, "logprobs": hf_logprobs(logits, tokens)}


def hf_value_outputs(model, batch):
    """(sequence scores as transformers computes them, per-token values hidden @ score)."""
    with torch.no_grad():
        valid = (torch.arange(SEQ) < batch["lengths"][:, None]).long()
        scores = model(batch["tokens"], attention_mask=valid).logits[:, 0].float()
        hidden = model.model(batch["tokens"]).last_hidden_state
        values = (hidden @ model.score.weight.T)[..., 0].float()
    return scores, values


def max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


def real_values_diff(ours, theirs, batch):
    """max |diff| of per-token values at real positions (< lengths): past them our roles'
    microbatches are trimmed (models/microbatches.py: trim_padding) and nothing reads them."""
    real = (torch.arange(SEQ) < batch["lengths"][:, None]).float()
    return max_diff(ours * real, theirs * real)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from distributed import torchrun
    from workers import layout_args

    root = tmp_path_factory.mktemp("hf_convert")
    models = {}
    for seed, (variant, (family, changes)) in enumerate(VARIANTS.items()):
        causal, classifier = hf_classes(family)
        models[variant] = random_hf_model(classifier if variant.endswith("rm") else causal,
                                          hf_config(family, **changes), seed=seed)
        # the untied Llama sharded + index
        models[variant].save_pretrained(root / "hf" / variant, **({"max_shard_size": "100KB"} if variant == "untied" else {}))
    bf16 = random_hf_model(hf_classes("llama")[0], hf_config(rms_norm_eps=1e-5), seed=0).to(torch.bfloat16)
    bf16.save_pretrained(root / "hf" / "bf16")  # imported as bfloat16 parameters
    assert (root / "hf" / "untied" / "model.safetensors.index.json").is_file()
    batch = make_batch()
    torch.save(batch, root / "batch.pt")
    worker = "tests/workers/hf_convert.py"
    by_world = {}  # one launch per world size (workers.run_layouts), TP2 importing before PP2 reloads
    for layout, (tp, pp, nproc) in LAYOUTS.items():
        by_world.setdefault(nproc, {})[layout] = (tp, pp)
    for nproc, layouts in sorted(by_world.items()):
        torchrun(nproc, worker, f"--root={root}", *layout_args(layouts), "--import-train=tp2pp1", "--reload=tp1pp2")
    results = {layout: torch.load(root / f"results_{layout}.pt") for layout in LAYOUTS}
    return root, models, batch, results


def assert_policy_matches_transformers(model, batch, ours: dict, label: str) -> None:
    """Our loaded policy's logits and log-probs equal transformers' `model`'s within ATOL."""
    want = hf_policy_outputs(model, batch["tokens"])
    diffs = {k: max_diff(ours[k], want[k]) for k in ("logits", "logprobs")}
    print(f"\n{label}: max |logit diff| {diffs['logits']:.2e}, max |logprob diff| {diffs['logprobs']:.2e}")
    assert diffs["logits"] < ATOL and diffs["logprobs"] < ATOL


def assert_reward_model_matches_transformers(model, batch, ours: dict, label: str) -> None:
    """Our loaded reward model's scores, and its values at real positions, equal transformers'."""
    scores, values = hf_value_outputs(model, batch)
    print(f"\n{label}: max |score diff| {max_diff(ours['rewards'], scores):.2e}, "
          f"max |value diff| {real_values_diff(ours['values'], values, batch):.2e}")
    assert max_diff(ours["rewards"], scores) < ATOL
    assert real_values_diff(ours["values"], values, batch) < ATOL


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("variant", POLICIES)
def test_loaded_policy_matches_transformers(runs, layout, variant):
    _, models, batch, results = runs
    assert_policy_matches_transformers(models[variant], batch, results[layout]["loaded"][variant], f"{variant} {layout}")


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("variant", REWARD_MODELS)
def test_loaded_reward_model_matches_transformers(runs, layout, variant):
    _, models, batch, results = runs
    assert_reward_model_matches_transformers(models[variant], batch, results[layout]["loaded"][variant],
                                             f"{variant} {layout}")


@pytest.mark.slow
def test_rope_scaling_matters_past_the_original_window(runs):
    """The Llama 3.1 variant without its RoPE scaling is another model: the parity above
    would fail if the scaling were ignored (a check that the test can fail)."""
    from transformers import LlamaForCausalLM

    root, models, batch, _ = runs
    unscaled = LlamaForCausalLM.from_pretrained(root / "hf" / "llama31", rope_scaling=None,
                                                rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                                                local_files_only=True).eval()
    assert max_diff(hf_policy_outputs(unscaled, batch["tokens"])["logits"],
                    hf_policy_outputs(models["llama31"], batch["tokens"])["logits"]) > 1e-3


@pytest.mark.slow
def test_imported_checkpoints_load_at_another_layout(runs):
    """import_hf at TP2-PP1, load_role at TP1-PP2."""
    _, models, batch, results = runs
    for variant in POLICIES:
        want = hf_policy_outputs(models[variant], batch["tokens"])
        ours = results["tp1pp2"]["reloaded"][variant]
        assert max_diff(ours["logits"], want["logits"]) < ATOL, variant
    for variant in REWARD_MODELS:
        scores, _ = hf_value_outputs(models[variant], batch)
        assert max_diff(results["tp1pp2"]["reloaded"][variant]["rewards"], scores) < ATOL, variant


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


@pytest.mark.slow
def test_reward_model_directory_is_refused_for_a_policy(runs):
    _, _, _, results = runs
    for layout in LAYOUTS:
        assert "LlamaForSequenceClassification" in results[layout]["refused"]
        assert "RewardModel or Critic" in results[layout]["refused"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", [*POLICIES, *REWARD_MODELS, "bf16"])
def test_import_then_export_gives_the_original_tensors(runs, variant, tmp_path):
    """Bitwise tensors, and a config.json transformers reads as the same model (family,
    RoPE scaling, biases, q/k norms, head_dim): the exported model's outputs equal the original's."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    root, models, batch, _ = runs
    value_model = variant in REWARD_MODELS
    # model_cfg omitted: import_hf checkpoints record it
    out = export_hf(root / "import" / variant, "reward" if value_model else "actor", tmp_path / "out",
                    max_shard_bytes=200_000, special_token_ids={"pad_token_id": 0})
    original, exported = hf_tensors(root / "hf" / variant), hf_tensors(out)
    assert exported.keys() == original.keys()
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original) and len(set(index["weight_map"].values())) > 1
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is (variant in ("tied", "qwen2"))
    if variant == "bf16":
        return
    family, _ = VARIANTS[variant]
    assert config["model_type"] == family
    cls = AutoModelForSequenceClassification if value_model else AutoModelForCausalLM
    reloaded = cls.from_pretrained(out, local_files_only=True).eval()
    assert type(reloaded) is type(models[variant])
    if value_model:
        assert max_diff(hf_value_outputs(reloaded, batch)[0], hf_value_outputs(models[variant], batch)[0]) == 0
    else:
        assert max_diff(hf_policy_outputs(reloaded, batch["tokens"])["logits"],
                        hf_policy_outputs(models[variant], batch["tokens"])["logits"]) == 0


@pytest.mark.slow
def test_export_of_a_pipeline_parallel_checkpoint(runs, tmp_path):
    """The tied policy saved at TP1-PP2 (the output layer of the last stage is not stored):
    exported from the iter_* directory, it is the original HF model again."""
    root, _, _, _ = runs
    out = export_hf(root / "resaved_tied" / "iter_0000000", "actor", tmp_path / "out",
                    model_cfg=trained_model_cfg(root, "tied"))
    original, exported = hf_tensors(root / "hf" / "tied"), hf_tensors(out)
    assert exported.keys() == original.keys() and "lm_head.weight" not in exported
    assert all(torch.equal(exported[k], original[k]) for k in original)
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()


def trained_model_cfg(root: Path, variant: str) -> ModelConfig:
    return load_config(None, hf_overrides(root / "hf" / variant) + ["model.max_seq_length=64"]).model


@pytest.mark.slow
def test_trained_actor_exports_to_transformers(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    root, models, batch, results = runs
    out = export_hf(root / "trained", "actor", tmp_path / "actor", model_cfg=trained_model_cfg(root, "untied"),
                    special_token_ids={"eos_token_id": 1, "pad_token_id": 0})
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    got = hf_policy_outputs(model, batch["tokens"])
    ours = results["tp2pp1"]["trained"]["actor"]
    before = hf_policy_outputs(models["untied"], batch["tokens"])
    assert max_diff(ours["logprobs"], before["logprobs"]) > 100 * ATOL, "training did not change the actor"
    print(f"\ntrained actor: max |logit diff| {max_diff(got['logits'], ours['logits']):.2e}, "
          f"max |logprob diff| {max_diff(got['logprobs'], ours['logprobs']):.2e}")
    assert max_diff(got["logprobs"], ours["logprobs"]) < ATOL
    assert max_diff(got["logits"], ours["logits"]) < ATOL
    assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": 1, "pad_token_id": 0}
    # two Adam steps of lr 1e-3 away from the HF weights it was loaded with
    original, exported = hf_tensors(root / "hf" / "untied"), hf_tensors(out)
    assert 0 < max(max_diff(exported[k], original[k]) for k in original) < 5e-3


@pytest.mark.slow
def test_trained_bf16_actor_starts_from_the_hf_weights(runs, tmp_path):
    """One Adam step (lr 1e-3) of bfloat16 parameters loaded with load_hf_weights: the
    export is the HF model moved by about a bfloat16 ulp, not the random initialisation
    the optimizer's float32 main params held before the load."""
    root, _, _, _ = runs
    out = export_hf(root / "trained_bf16", "actor", tmp_path / "out", model_cfg=trained_model_cfg(root, "bf16"))
    original, exported = hf_tensors(root / "hf" / "bf16"), hf_tensors(out)
    assert all(t.dtype == torch.bfloat16 for t in exported.values())
    assert 0 < max(max_diff(exported[k], original[k]) for k in original) < 0.03


@pytest.mark.slow
def test_trained_reward_model_exports_with_its_normalisation(runs, tmp_path):
    from transformers import AutoModelForSequenceClassification

    root, _, batch, results = runs
    out = export_hf(root / "trained", "reward", tmp_path / "rm", model_cfg=trained_model_cfg(root, "rm"),
                    special_token_ids={"pad_token_id": 0})
    model = AutoModelForSequenceClassification.from_pretrained(out, local_files_only=True).eval()
    scores, values = hf_value_outputs(model, batch)
    ours = results["tp2pp1"]["trained"]["reward"]  # normalised with reward_std = 2
    print(f"\ntrained reward model: max |score diff| {max_diff(scores, ours['rewards']):.2e}")
    assert max_diff(scores, ours["rewards"]) < ATOL
    assert real_values_diff(ours["values"], values, batch) < ATOL
    assert json.loads((out / "config.json").read_text())["megatron_rlhf_export"]["reward_std"] == 2.0


@pytest.mark.slow
def test_critic_bias_is_refused_unless_dropped(runs, tmp_path):
    from transformers import AutoModelForSequenceClassification

    root, _, batch, results = runs
    model_cfg = trained_model_cfg(root, "rm")
    with pytest.raises(ConvertError, match="output_layer.bias.*drop_score_bias=True"):
        export_hf(root / "trained", "critic", tmp_path / "refused", model_cfg=model_cfg)
    assert not (tmp_path / "refused").exists()
    out = export_hf(root / "trained", "critic", tmp_path / "critic", model_cfg=model_cfg, drop_score_bias=True,
                    special_token_ids={"pad_token_id": 0})
    offset = json.loads((out / "config.json").read_text())["megatron_rlhf_export"]["score_offset"]
    assert offset != 0.0
    model = AutoModelForSequenceClassification.from_pretrained(out, local_files_only=True).eval()
    _, values = hf_value_outputs(model, batch)
    assert max_diff(values + offset, results["tp2pp1"]["trained"]["critic"]["values"]) < ATOL


@pytest.mark.slow
def test_export_refuses_clearly(runs, tmp_path):
    root, _, _, _ = runs
    with pytest.raises(ConvertError, match=r"no role 'critic'.*\['actor'\]"):
        export_hf(root / "import" / "untied", "critic", tmp_path / "a")
    wrong = trained_model_cfg(root, "untied")
    wrong = dataclasses.replace(wrong, ffn_hidden_size=256)
    with pytest.raises(ConvertError, match="model.ffn_hidden_size"):
        export_hf(root / "trained", "actor", tmp_path / "b", model_cfg=wrong)
    # every checkpoint records its model config; one written before that needs model_cfg
    assert export_hf(root / "trained", "actor", tmp_path / "recorded").is_dir()
    shutil.copytree(root / "trained" / "iter_0000002" / "actor", tmp_path / "bare" / "actor")  # no trainer state
    with pytest.raises(ConvertError, match="pass model_cfg"):
        export_hf(tmp_path / "bare" / "actor", "actor", tmp_path / "c")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "keep.txt").write_text("x")
    with pytest.raises(ConvertError, match="not empty"):
        export_hf(root / "import" / "untied", "actor", tmp_path / "d")
