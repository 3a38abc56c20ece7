"""Mixture-of-experts models (Qwen3-MoE, Mixtral) in the model section: the ModelConfig fields
and their rules, config.json read into them (written by transformers' own config classes, so
the keys and defaults are what transformers writes and reads; no weights, no hub), the MoE
architectures refused by name, the aux-loss coefficient taken from config.json, and the
exported config.json read back. Our side imports no torch (transformers' config classes do)."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from megatron_rlhf.config import ARCHITECTURE_FIELDS, ConfigError, ModelConfig, load_config, validate
from megatron_rlhf.convert import ConvertError, check_model_matches_hf, hf_overrides, model_config_from_hf
from megatron_rlhf.convert.hf_config import hf_config_dict, read_hf_config

TINY = dict(vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=64)

# Published config.json values (the model repositories' config.json; the ones these tests rely on).
# Qwen3-30B-A3B: 48 layers of 128 experts (top-8, each 768 wide), no dense layer, norm_topk_prob true;
# head_dim 128 is explicit (2048 / 32 heads would be 64).
QWEN3_30B_A3B = dict(
    hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001, vocab_size=151936, rope_theta=1e6,
    rms_norm_eps=1e-6, max_position_embeddings=40960, max_window_layers=48, use_sliding_window=False,
    sliding_window=None, tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"])
# Qwen3-235B-A22B: the same recipe, larger (94 layers, 64 heads, experts 1536 wide).
QWEN3_235B_A22B = {**QWEN3_30B_A3B, "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
                   "moe_intermediate_size": 1536, "intermediate_size": 12288, "max_window_layers": 94}
# Mixtral-8x7B-v0.1: 8 experts of intermediate_size 14336 in every layer, top-2, no sliding
# window, router_aux_loss_coef 0.02 (transformers' default is 0.001); head_dim 4096 / 32 = 128.
MIXTRAL_8X7B = dict(
    hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
    num_experts_per_tok=2, intermediate_size=14336, rope_theta=1e6, vocab_size=32000, max_position_embeddings=32768,
    sliding_window=None, router_aux_loss_coef=0.02, rms_norm_eps=1e-5, tie_word_embeddings=False,
    architectures=["MixtralForCausalLM"])


def saved(config, directory: Path) -> Path:
    """`config` (a transformers config object) saved as transformers writes it: DIR/config.json."""
    config.save_pretrained(directory)
    return directory


def qwen3_moe(directory: Path, **kw) -> Path:
    return saved(transformers.Qwen3MoeConfig(**{**TINY, "intermediate_size": 96, "num_experts": 8,
                                                "num_experts_per_tok": 2, "moe_intermediate_size": 32, **kw}), directory)


def mixtral(directory: Path, **kw) -> Path:
    return saved(transformers.MixtralConfig(**{**TINY, "intermediate_size": 32, "num_local_experts": 4, **kw}), directory)


def edited(directory: Path, drop=(), **changes) -> Path:
    """config.json of `directory` with keys dropped or changed (what a hand-edited file may hold)."""
    path = directory / "config.json"
    config = {k: v for k, v in json.loads(path.read_text()).items() if k not in drop}
    path.write_text(json.dumps({**config, **changes}))
    return directory


def moe_model(**kw) -> ModelConfig:
    return ModelConfig(**{"family": "qwen3_moe", "qk_layernorm": True, "num_experts": 4, "num_layers": 4, **kw})


# ----------------------------------------------------------------------------- reading config.json


@pytest.mark.parametrize("name, published", [("Qwen3-30B-A3B", QWEN3_30B_A3B), ("Qwen3-235B-A22B", QWEN3_235B_A22B)])
def test_published_qwen3_moe_shapes_are_read(tmp_path, name, published):
    fields = model_config_from_hf(saved(transformers.Qwen3MoeConfig(**published), tmp_path))
    p = published
    assert fields == {
        "family": "qwen3_moe", "num_layers": p["num_hidden_layers"], "hidden_size": p["hidden_size"],
        "num_attention_heads": p["num_attention_heads"], "num_query_groups": 4, "head_dim": 128,
        "ffn_hidden_size": p["intermediate_size"], "vocab_size": 151936, "max_seq_length": 40960,
        "max_position_embeddings": 40960, "rotary_base": 1e6, "rope_scaling": ModelConfig().rope_scaling,
        "norm_epsilon": 1e-6, "qkv_bias": False, "qk_layernorm": True, "share_embeddings_and_output_weights": False,
        "num_experts": 128, "moe_router_topk": 8, "moe_ffn_hidden_size": p["moe_intermediate_size"],
        "moe_router_score_function": "softmax", "moe_norm_topk_prob": True, "moe_dense_layers": []}
    model = load_config(None, [f"model.from_hf_config={tmp_path}"]).model
    model.check()
    assert model.moe_layer_pattern == [1] * p["num_hidden_layers"] and model.expert_ffn_hidden_size == p["moe_intermediate_size"]


def test_published_qwen3_moe_json_names_its_experts_num_experts(tmp_path):
    """The published config.json (transformers 4.51) says num_experts; transformers 5 writes
    num_local_experts (Qwen3MoeConfig maps one name onto the other): both read, two that differ not."""
    published = {**QWEN3_30B_A3B, "model_type": "qwen3_moe", "rope_scaling": None, "hidden_act": "silu",
                 "attention_bias": False, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(published))
    assert model_config_from_hf(tmp_path)["num_experts"] == 128
    assert transformers.Qwen3MoeConfig.from_pretrained(tmp_path).num_experts == 128
    edited(tmp_path, num_local_experts=64)
    with pytest.raises(ConvertError, match="num_experts=128 and num_local_experts=64"):
        model_config_from_hf(tmp_path)


def test_published_mixtral_shape_is_read(tmp_path):
    fields = model_config_from_hf(saved(transformers.MixtralConfig(**MIXTRAL_8X7B), tmp_path))
    assert fields == {
        "family": "mixtral", "num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": 8,
        "head_dim": None, "ffn_hidden_size": 14336, "vocab_size": 32000, "max_seq_length": 32768,
        "max_position_embeddings": 32768, "rotary_base": 1e6, "rope_scaling": ModelConfig().rope_scaling,
        "norm_epsilon": 1e-5, "qkv_bias": False, "qk_layernorm": False, "share_embeddings_and_output_weights": False,
        # intermediate_size is each expert's (and there is no dense layer); top-k always renormalised
        "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 14336, "moe_router_score_function": "softmax",
        "moe_norm_topk_prob": True, "moe_dense_layers": []}
    # Mixtral's sliding window (null here) caps the exact length when set, as Mistral's
    assert model_config_from_hf(edited(tmp_path, sliding_window=4096))["max_seq_length"] == 4096


def test_dense_layers_from_mlp_only_layers_and_decoder_sparse_step(tmp_path):
    # transformers' Qwen3MoeDecoderLayer: layer i has experts iff i not in mlp_only_layers and
    # (i + 1) % decoder_sparse_step == 0. 6 layers, step 2: experts in 1, 3, 5; 3 listed: 1 and 5.
    directory = qwen3_moe(tmp_path, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3, 9])
    fields = model_config_from_hf(directory)
    assert fields["moe_dense_layers"] == [0, 2, 3, 4]  # 9: past the last layer, as transformers ignores it
    assert fields["ffn_hidden_size"] == 96 and fields["moe_ffn_hidden_size"] == 32  # dense layers, experts
    model = load_config(None, [f"model.from_hf_config={directory}"]).model
    assert model.moe_layer_pattern == [0, 1, 0, 0, 0, 1]
    only = model_config_from_hf(qwen3_moe(tmp_path / "only", mlp_only_layers=[0, 3]))
    assert only["moe_dense_layers"] == [0, 3]
    with pytest.raises(ConvertError, match=r"mlp_only_layers=\[1\], decoder_sparse_step=2: no layer"):
        model_config_from_hf(qwen3_moe(tmp_path / "none", num_hidden_layers=2, decoder_sparse_step=2, mlp_only_layers=[1]))


def test_norm_topk_prob_both_ways(tmp_path):
    assert model_config_from_hf(qwen3_moe(tmp_path / "t", norm_topk_prob=True))["moe_norm_topk_prob"] is True
    assert model_config_from_hf(qwen3_moe(tmp_path / "f", norm_topk_prob=False))["moe_norm_topk_prob"] is False
    # Mixtral's router always renormalises, whatever the file holds
    assert model_config_from_hf(edited(mixtral(tmp_path / "m"), norm_topk_prob=False))["moe_norm_topk_prob"] is True


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_absent_keys_take_transformers_defaults(tmp_path, family):
    """A config.json without the expert keys (or head_dim) reads as transformers reads it."""
    keys = {"qwen3_moe": ["num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                          "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "head_dim"],
            "mixtral": ["num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "head_dim",
                        "sliding_window"]}[family]
    directory = edited((qwen3_moe if family == "qwen3_moe" else mixtral)(tmp_path, num_hidden_layers=2), drop=keys)
    theirs = transformers.AutoConfig.from_pretrained(directory)
    hf = read_hf_config(directory)
    assert (hf.moe.num_experts, hf.moe.top_k, hf.moe.router_aux_loss_coef) == (
        theirs.num_local_experts, theirs.num_experts_per_tok, theirs.router_aux_loss_coef)
    # the attention's head_dim as the modeling code takes it (Qwen3MoeConfig has no default of 128)
    assert hf.head_dim == (getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads)
    if family == "qwen3_moe":
        assert (hf.moe.expert_ffn, hf.moe.norm_topk_prob) == (theirs.moe_intermediate_size, theirs.norm_topk_prob)
        assert hf.moe.norm_topk_prob is False and hf.moe.dense_layers == ()  # Qwen3MoeConfig: False, step 1, []
        assert hf.sliding_window is None
    else:
        assert hf.sliding_window is None and theirs.sliding_window is None  # MixtralConfig: null (Mistral's: 4096)


def test_reading_imports_no_torch(tmp_path):
    directory = qwen3_moe(tmp_path)
    code = ("import sys; from megatron_rlhf.config import load_config; "
            f"load_config(None, ['model.from_hf_config={directory}']).model.check(); "
            "from megatron_rlhf.convert.hf_config import hf_config_dict; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)


# ----------------------------------------------------------------------------- refused


DEEPSEEK_V3 = {  # DeepSeek-V3's config.json, the fields that matter here (written by hand: transformers
    # 5's DeepseekV3Config has no topk_method / scoring_func, which the published file has)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "first_k_dense_replace": 3, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "vocab_size": 129280, "max_position_embeddings": 163840, "rope_theta": 10000, "rms_norm_eps": 1e-6}


def test_deepseek_is_refused_naming_what_we_do_not_build(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    with pytest.raises(ConvertError) as err:
        model_config_from_hf(tmp_path)
    message = str(err.value)
    for part in ("model_type='deepseek_v3'", "multi-head latent attention (kv_lora_rank=512, q_lora_rank=1536)",
                 "shared experts (n_shared_experts=1)", "group-limited routing (n_group=8, topk_group=4)",
                 "topk_method='noaux_tc', scoring_func='sigmoid'", "first_k_dense_replace=3", "config.json"):
        assert part in message, part
    (tmp_path / "config.json").write_text(json.dumps({**DEEPSEEK_V3, "model_type": "deepseek_v2"}))
    with pytest.raises(ConvertError, match="model_type='deepseek_v2': DeepSeek-V2 needs .*kv_lora_rank"):
        model_config_from_hf(tmp_path)


REFUSED = {  # the field the message must name -> a config.json that has it
    "shared_expert_intermediate_size=5632": lambda d: saved(transformers.Qwen2MoeConfig(**TINY), d),  # Qwen2-MoE
    "shared_expert_intermediate_size=64": lambda d: qwen3_moe(d, shared_expert_intermediate_size=64),
    "n_shared_experts=1": lambda d: mixtral(d, n_shared_experts=1),
    "router_jitter_noise=0.1": lambda d: mixtral(d, router_jitter_noise=0.1),
    "num_experts_per_tok=9": lambda d: qwen3_moe(d, num_experts_per_tok=9),
    "num_local_experts=1": lambda d: mixtral(d, num_local_experts=1),
    "decoder_sparse_step=0": lambda d: edited(qwen3_moe(d), decoder_sparse_step=0),
    "moe_intermediate_size=0": lambda d: edited(qwen3_moe(d), moe_intermediate_size=0),
    "router_aux_loss_coef=-1": lambda d: edited(qwen3_moe(d), router_aux_loss_coef=-1),
    "attention_bias=true": lambda d: qwen3_moe(d, attention_bias=True),
    "num_experts=8": lambda d: saved(transformers.Qwen3Config(**TINY, num_experts=8), d),  # a dense family's
    "model_type='llama4'": lambda d: edited(qwen3_moe(d), model_type="llama4", architectures=["Llama4ForCausalLM"]),
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_refusals_name_the_config_json_field(tmp_path, field):
    directory = REFUSED[field](tmp_path / "hf")
    with pytest.raises(ConvertError) as err:
        model_config_from_hf(directory)
    assert field in str(err.value) and "config.json" in str(err.value)
    # before any model is built: the recipe that names the directory stops loading
    with pytest.raises(ConfigError, match=field.split("=")[0]):
        load_config(None, [f"model.from_hf_config={directory}"])


def test_router_logits_output_is_not_refused(tmp_path):
    assert model_config_from_hf(qwen3_moe(tmp_path, output_router_logits=True))["num_experts"] == 8


# ----------------------------------------------------------------------------- the model section's rules


RULES = {  # the start of the message -> the ModelConfig fields that break the rule
    "model.num_experts=null with model.family='qwen3_moe'": dict(num_experts=None),
    "model.num_experts=4 with model.family='qwen3'": dict(family="qwen3"),
    "model.num_experts=1:": dict(num_experts=1, moe_router_topk=1),
    "model.moe_router_topk=0:": dict(moe_router_topk=0),
    "model.moe_router_topk=5:": dict(moe_router_topk=5),
    "model.moe_ffn_hidden_size=0:": dict(moe_ffn_hidden_size=0),
    "model.moe_router_score_function='relu'": dict(moe_router_score_function="relu"),
    "model.moe_norm_topk_prob=false with model.moe_router_score_function=sigmoid": dict(
        moe_router_score_function="sigmoid", moe_norm_topk_prob=False),
    "model.moe_dense_layers=[1, 1]:": dict(moe_dense_layers=[1, 1]),
    "model.moe_dense_layers=[4]:": dict(moe_dense_layers=[4]),
    "model.moe_dense_layers=[-1]:": dict(moe_dense_layers=[-1]),
    "model.moe_dense_layers=[0, 1, 2, 3]: every layer is dense": dict(moe_dense_layers=[0, 1, 2, 3]),
    "model.moe_aux_loss_coef=-0.1:": dict(moe_aux_loss_coef=-0.1),
    "model.moe_z_loss_coef=-1.0:": dict(moe_z_loss_coef=-1.0),
    "model.qk_layernorm=False with model.family='qwen3_moe'": dict(qk_layernorm=False),
    "model.qk_layernorm=True with model.family='mixtral'": dict(family="mixtral"),
    "model.qkv_bias=True with model.family='mixtral'": dict(family="mixtral", qk_layernorm=False, qkv_bias=True),
    "model.moe_dense_layers=[0] with model.num_experts=null": dict(
        family="llama", qk_layernorm=False, num_experts=None, moe_dense_layers=[0]),
    "model.moe_ffn_hidden_size=32 with model.num_experts=null": dict(
        family="llama", qk_layernorm=False, num_experts=None, moe_ffn_hidden_size=32),
    "model.moe_load_balancing_type=seq_aux_loss with model.num_experts=null": dict(
        family="llama", qk_layernorm=False, num_experts=None, moe_load_balancing_type="seq_aux_loss"),
    "model.moe_load_balancing_type=global_aux_loss: megatron-core 0.19.2 divides": dict(
        moe_load_balancing_type="global_aux_loss", moe_aux_loss_coef=0.01),
    "model.moe_load_balancing_type='sinkhorn': choose one of": dict(moe_load_balancing_type="sinkhorn"),
    "model.moe_load_balancing_type=seq_aux_loss with model.moe_aux_loss_coef=0": dict(
        moe_load_balancing_type="seq_aux_loss"),
}


@pytest.mark.parametrize("expected", list(RULES))
def test_model_rules_name_the_field(expected):
    with pytest.raises(ConfigError) as err:
        moe_model(**RULES[expected]).check()
    assert str(err.value).startswith(expected)


def test_valid_moe_models_and_their_layer_pattern():
    model = moe_model(moe_dense_layers=[2, 0], moe_ffn_hidden_size=32)
    model.check()
    assert model.moe_layer_pattern == [0, 1, 0, 1] and model.expert_ffn_hidden_size == 32
    assert moe_model().expert_ffn_hidden_size == ModelConfig().ffn_hidden_size  # null: ffn_hidden_size
    moe_model(family="mixtral", qk_layernorm=False, moe_router_score_function="sigmoid", moe_router_topk=4).check()
    moe_model(moe_load_balancing_type="seq_aux_loss", moe_aux_loss_coef=1e-4).check()  # DeepSeek-V3's sequence-wise loss
    assert ModelConfig().moe_layer_pattern is None  # dense
    ModelConfig(moe_router_topk=8).check()  # routing details of a dense model are not checked


def test_recipe_fields():
    overrides = ["model.family=qwen3_moe", "model.qk_layernorm=true", "model.num_experts=8", "model.num_layers=4",
                 "model.moe_dense_layers=[0,3]", "model.moe_router_topk=2", "model.vocab_size=100"]
    cfg = load_config(None, overrides)
    assert cfg.model.moe_dense_layers == [0, 3] and cfg.model.moe_layer_pattern == [0, 1, 1, 0]
    with pytest.raises(ConfigError, match=r"^model.moe_dense_layers: expected a list"):
        load_config(None, [*overrides, "model.moe_dense_layers=3"])
    validate(cfg)  # an expert model is a valid run now that models/ builds experts


# ----------------------------------------------------------------------------- from_hf_config, aux-loss coefficient


def write_recipe(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_aux_loss_coefficient_comes_from_config_json_unless_the_recipe_sets_it(tmp_path):
    hf = saved(transformers.MixtralConfig(**{**MIXTRAL_8X7B, "num_hidden_layers": 2}), tmp_path / "hf")
    cfg = load_config(None, [f"model.init_from_hf={hf}"])
    assert cfg.model.moe_aux_loss_coef == 0.02
    assert any(n.startswith("model.moe_aux_loss_coef=0.02: router_aux_loss_coef of ") for n in cfg.hf_notes), cfg.hf_notes
    for where in ("recipe", "override", "base"):
        write_recipe(tmp_path / "base.yaml", "model: {moe_aux_loss_coef: 0.005}\n" if where == "base" else "{}\n")
        recipe = write_recipe(tmp_path / "r.yaml", "base: base.yaml\n"
                              + ("model: {moe_aux_loss_coef: 0.005}\n" if where == "recipe" else ""))
        overrides = [f"model.init_from_hf={hf}"] + (["model.moe_aux_loss_coef=0.005"] if where == "override" else [])
        cfg = load_config(recipe, overrides)
        assert cfg.model.moe_aux_loss_coef == 0.005, where
        assert not any("moe_aux_loss_coef" in n for n in cfg.hf_notes), where
    # a dense model has no router_aux_loss_coef: the run's value stays, without a note
    dense = saved(transformers.Qwen3Config(**TINY), tmp_path / "dense")
    cfg = load_config(None, [f"model.from_hf_config={dense}"])
    assert cfg.model.moe_aux_loss_coef == 0.0 and cfg.model.num_experts is None and not cfg.hf_notes


def test_from_hf_config_checks_and_replaces_the_expert_fields(tmp_path):
    hf = qwen3_moe(tmp_path / "hf", mlp_only_layers=[0, 2], norm_topk_prob=True)
    write_recipe(tmp_path / "base.yaml", "model: {moe_router_topk: 4, moe_dense_layers: [1]}\n")
    recipe = write_recipe(tmp_path / "r.yaml", f"base: base.yaml\nmodel: {{from_hf_config: {hf}}}\n")
    cfg = load_config(recipe)
    assert (cfg.model.moe_router_topk, cfg.model.moe_dense_layers) == (2, [0, 2])
    notes = "\n".join(cfg.hf_notes)
    assert "model.moe_router_topk=4 (recipe) replaced by 2" in notes and "model.moe_dense_layers=[1] (recipe)" in notes
    # set next to the directory: checked, all at once; a list compares as a set of layers
    assert load_config(recipe, ["model.moe_dense_layers=[2,0]"]).model.moe_dense_layers == [2, 0]
    with pytest.raises(ConfigError) as err:
        load_config(recipe, ["model.moe_dense_layers=[1]", "model.num_experts=16", "model.moe_norm_topk_prob=false",
                             "model.moe_ffn_hidden_size=64"])
    message = str(err.value)
    for line in ("model.moe_dense_layers=[1]: the HF model has [0, 2]; set model.moe_dense_layers=[0, 2]",
                 "set model.num_experts=8", "set model.moe_norm_topk_prob=true", "set model.moe_ffn_hidden_size=32"):
        assert line in message, line
    # Mixtral: moe_ffn_hidden_size null (= ffn_hidden_size) is the same model as the explicit size
    mix = mixtral(tmp_path / "mix")
    model = load_config(None, [*hf_overrides(mix), "model.moe_ffn_hidden_size=null"]).model
    check_model_matches_hf(model, mix)
    with pytest.raises(ConvertError, match="model.num_experts=null: the HF model has 4; set model.num_experts=4"):
        check_model_matches_hf(dataclasses.replace(model, family="llama", num_experts=None), mix)


@pytest.mark.parametrize("make", [qwen3_moe, mixtral], ids=["qwen3_moe", "mixtral"])
def test_hf_overrides_give_the_same_model(tmp_path, make):
    hf = make(tmp_path)
    from_overrides = load_config(None, hf_overrides(hf)).model
    from_config = load_config(None, [f"model.from_hf_config={hf}"]).model
    # from_hf_config keeps a null moe_ffn_hidden_size that means the HF size (Mixtral's experts
    # are intermediate_size wide: ffn_hidden_size); the overrides spell it out
    assert from_config.expert_ffn_hidden_size == from_overrides.expert_ffn_hidden_size
    assert dataclasses.replace(from_config, from_hf_config=None, moe_aux_loss_coef=0.0,
                               moe_ffn_hidden_size=from_overrides.moe_ffn_hidden_size) == from_overrides
    check_model_matches_hf(from_overrides, hf)
    check_model_matches_hf(from_config, hf)


# ----------------------------------------------------------------------------- export


def architecture(model: ModelConfig) -> dict:
    return {f: getattr(model, f) for f in ARCHITECTURE_FIELDS}


EXPORTED = {
    "qwen3_moe": moe_model(num_layers=5, hidden_size=64, num_attention_heads=4, num_query_groups=2, head_dim=32,
                           ffn_hidden_size=96, vocab_size=100, num_experts=6, moe_router_topk=3, moe_ffn_hidden_size=24,
                           moe_norm_topk_prob=False, moe_dense_layers=[1, 4], moe_aux_loss_coef=0.01,
                           max_seq_length=256, max_position_embeddings=256, rotary_base=1e6, norm_epsilon=1e-6),
    "mixtral": moe_model(family="mixtral", qk_layernorm=False, num_layers=3, num_query_groups=4, ffn_hidden_size=48,
                         moe_ffn_hidden_size=48,
                         vocab_size=100, num_experts=4, moe_router_topk=2, moe_aux_loss_coef=0.02,
                         max_position_embeddings=128),
}


@pytest.mark.parametrize("family", list(EXPORTED))
def test_export_reads_back_to_the_same_architecture(tmp_path, family):
    model = EXPORTED[family]
    model.check()
    config = hf_config_dict(model, value_model=False, dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_config_from_hf(tmp_path) == architecture(model)
    assert read_hf_config(tmp_path).moe.router_aux_loss_coef == model.moe_aux_loss_coef
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)  # and transformers reads what we meant
    assert (type(theirs).__name__, theirs.num_local_experts, theirs.num_experts_per_tok) == (
        {"qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig"}[family], model.num_experts, model.moe_router_topk)
    if family == "qwen3_moe":
        assert (theirs.moe_intermediate_size, theirs.intermediate_size, theirs.norm_topk_prob, theirs.mlp_only_layers,
                theirs.decoder_sparse_step) == (24, 96, False, [1, 4], 1)
    else:
        assert (theirs.intermediate_size, theirs.router_jitter_noise, theirs.sliding_window) == (48, 0.0, None)
    # a value model: the family's *ForSequenceClassification, same experts
    value = hf_config_dict(model, value_model=True, dtype="bfloat16")
    assert value["architectures"][0].endswith("ForSequenceClassification") and value["num_experts_per_tok"] == 2 + (
        family == "qwen3_moe")


def test_published_models_export_unchanged(tmp_path):
    for name, (cls, published) in {"qwen": (transformers.Qwen3MoeConfig, QWEN3_30B_A3B),
                                   "mixtral": (transformers.MixtralConfig, MIXTRAL_8X7B)}.items():
        hf = saved(cls(**published), tmp_path / name)
        model = load_config(None, [f"model.from_hf_config={hf}"]).model
        out = tmp_path / f"{name}_out"
        out.mkdir()
        (out / "config.json").write_text(json.dumps(hf_config_dict(model, False, "bfloat16")))
        assert model_config_from_hf(out) == model_config_from_hf(hf)
        assert json.loads((out / "config.json").read_text())["router_aux_loss_coef"] == published["router_aux_loss_coef"]


EXPORT_REFUSALS = {  # the field the message names -> a model the HF class cannot express
    "model.moe_router_score_function=sigmoid": EXPORTED["qwen3_moe"],
    "model.moe_dense_layers=[1]": dataclasses.replace(EXPORTED["mixtral"], moe_dense_layers=[1]),
    "model.moe_ffn_hidden_size=24 with model.ffn_hidden_size=48": dataclasses.replace(EXPORTED["mixtral"],
                                                                                      moe_ffn_hidden_size=24),
    "model.moe_norm_topk_prob=false": dataclasses.replace(EXPORTED["mixtral"], moe_norm_topk_prob=False),
}


@pytest.mark.parametrize("field", list(EXPORT_REFUSALS))
def test_export_refuses_what_the_hf_class_cannot_express(field):
    model = EXPORT_REFUSALS[field]
    if "sigmoid" in field:
        model = dataclasses.replace(model, moe_router_score_function="sigmoid", moe_norm_topk_prob=True)
    with pytest.raises(ConvertError) as err:
        hf_config_dict(model, value_model=False, dtype="bfloat16")
    assert str(err.value).startswith(field)
    if "sigmoid" in field:  # Mixtral's too
        with pytest.raises(ConvertError, match="MixtralForCausalLM routes by softmax"):
            hf_config_dict(dataclasses.replace(EXPORTED["mixtral"], moe_router_score_function="sigmoid"), False, "bfloat16")
