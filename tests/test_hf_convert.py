"""Hugging Face Llama import/export (megatron_rlhf/convert) against transformers itself.

Fast tests: config refusals, the model-config check, the tensor mapping (TE and local spec
names, TP shards) and slice reading. Slow tests (torchrun, world size <= 2): tiny random
Llamas (GQA 4 heads / 2 kv heads, 4 layers, vocabulary 100 padded to 128; untied and sharded,
tied, and a LlamaForSequenceClassification reward model) loaded at TP1-PP1, TP2-PP1 and
TP1-PP2 give transformers' logits and log-probs within 1e-5; import -> export returns the
original tensors exactly; trained roles export to directories transformers loads and that
score like our roles.
"""

import json
from pathlib import Path

import pytest
import torch

from megatron_rlhf.config import ModelConfig, load_config
from megatron_rlhf.convert import (
    ConvertError, check_model_matches_hf, export_hf, model_config_from_hf,
)
from megatron_rlhf.convert.hf_weights import Dims, hf_layer_tensors, shard_for_param
from megatron_rlhf.convert.safetensors_io import HFWeights

ATOL = 1e-5
VOCAB, SEQ, BATCH = 100, 16, 4
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


def test_model_config_from_hf_reads_both_config_styles(tmp_path):
    old = model_config_from_hf(write_config(tmp_path / "old"))
    assert old == {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
                   "ffn_hidden_size": 128, "vocab_size": VOCAB, "max_seq_length": 64, "rotary_base": 10000.0,
                   "norm_epsilon": 1e-5, "share_embeddings_and_output_weights": False}
    new = write_config(tmp_path / "new", rope_theta="<drop>", rope_scaling="<drop>",
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=True)
    got = model_config_from_hf(new)
    assert got["rotary_base"] == 500000.0 and got["share_embeddings_and_output_weights"] is True
    # Mistral: sliding-window attention equals full attention up to the window
    mistral = write_config(tmp_path / "mistral", model_type="mistral", architectures=["MistralForCausalLM"],
                           max_position_embeddings=4096, sliding_window=32)
    assert model_config_from_hf(mistral)["max_seq_length"] == 32


REFUSALS = {
    "model_type": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
    "architectures": {"architectures": ["LlamaForTokenClassification"]},
    "rope_scaling.rope_type='llama3'": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
    "rope_scaling.rope_type='linear'": {"rope_scaling": {"type": "linear", "factor": 2.0}},
    "rope_scaling.rope_type='dynamic'": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    "rope_parameters.rope_type='yarn'": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
    "partial_rotary_factor": {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
    "rope_theta": {"rope_theta": 10000.5},
    "attention_bias": {"attention_bias": True},
    "mlp_bias": {"mlp_bias": True},
    "hidden_act": {"hidden_act": "gelu"},
    "head_dim": {"head_dim": 32},
    "num_key_value_heads": {"num_key_value_heads": 3},
    "num_labels": {"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "a", "1": "b"}},
    "quantization_config": {"quantization_config": {"quant_method": "gptq"}},
    "layer_types": {"layer_types": ["sliding_attention"] * 4},
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
    cfg = load_config(None, [f"model.{k}={v}" for k, v in model_config_from_hf(mistral).items()])
    check_model_matches_hf(cfg, mistral)
    cfg.model.max_seq_length = 64
    with pytest.raises(ConvertError, match=r"model.max_seq_length=64.*sliding_window=32"):
        check_model_matches_hf(cfg, mistral)


def test_check_model_matches_hf_names_every_field(tmp_path):
    directory = write_config(tmp_path, rms_norm_eps=1e-6, tie_word_embeddings=True)
    cfg = load_config(None, ["model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4",
                             "model.ffn_hidden_size=128", "model.vocab_size=100"])
    with pytest.raises(ConvertError) as err:
        check_model_matches_hf(cfg, directory)
    message = str(err.value)
    for line in ("model.num_query_groups=4", "set model.num_query_groups=2", "model.norm_epsilon=1e-05",
                 "set model.norm_epsilon=1e-06", "set model.share_embeddings_and_output_weights=True"):
        assert line in message
    assert "model.hidden_size" not in message.split("(all")[0]  # only what differs
    fixed = load_config(None, [f"model.{k}={v}" for k, v in model_config_from_hf(directory).items()])
    check_model_matches_hf(fixed, directory)


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
    return out


LOCAL = {"input_norm": "input_layernorm.weight", "post_norm": "pre_mlp_layernorm.weight"}
TE = {"input_norm": "self_attention.linear_qkv.layer_norm_weight", "post_norm": "mlp.linear_fc1.layer_norm_weight"}
FUSED = {"qkv": "self_attention.linear_qkv.weight", "o_proj": "self_attention.linear_proj.weight",
         "fc1": "mlp.linear_fc1.weight", "down": "mlp.linear_fc2.weight"}
CAT_DIM = {"input_norm": None, "post_norm": None, "qkv": 0, "fc1": None, "o_proj": 1, "down": 1}


@pytest.mark.parametrize("spec", [LOCAL, TE], ids=["local", "transformer_engine"])
def test_tp_shards_reassemble_to_the_checkpoint_layout_and_back(spec, tmp_path):
    """Import shards at TP=1, 2 (both spec's names) -> the TP-independent layout megatron's
    checkpoints store (qkv: TP shards concatenated; fc1: [gate; up] of all shards) ->
    export mapping -> the original HF tensors."""
    d = Dims(num_layers=1, hidden=64, heads=8, kv_heads=2, ffn=96, vocab=100, padded_vocab=128, tied=False)
    hf = random_hf_layer(d, torch.Generator().manual_seed(0))

    def read(name, rows=None, cols=None):
        t = hf[name]
        t = t[rows[0]: rows[1]] if rows else t
        return t[:, cols[0]: cols[1]] if cols else t

    names = {kind: suffix for kind, suffix in {**spec, **FUSED}.items()}
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


def test_vocab_shards_are_padded_with_zero_rows():
    d = Dims(num_layers=1, hidden=8, heads=2, kv_heads=2, ffn=16, vocab=100, padded_vocab=128, tied=True)
    emb = torch.randn(100, 8)
    read = lambda name, rows=None, cols=None: emb[rows[0]: rows[1]]  # noqa: E731
    shards = [shard_for_param("output_layer.weight", read, d, r, 2, None, False, False, torch.float32)
              for r in range(2)]
    assert torch.equal(shards[0], emb[:64])
    assert torch.equal(shards[1][:36], emb[64:]) and not shards[1][36:].any()


def test_import_refuses_before_starting_anything(tmp_path):
    from megatron_rlhf.convert import import_hf

    hf = write_config(tmp_path / "hf")
    cfg = load_config(None, [f"model.{k}={v}" for k, v in model_config_from_hf(hf).items()])
    with pytest.raises(ConvertError, match="role 'reward' needs a \\*ForSequenceClassification.*rm.init_from"):
        import_hf(cfg, hf, tmp_path / "out", role="reward")
    (tmp_path / "out" / "iter_0000000").mkdir(parents=True)
    with pytest.raises(ConvertError, match="already holds checkpoints"):
        import_hf(cfg, hf, tmp_path / "out")
    cfg.model.hidden_size = 128
    with pytest.raises(ConvertError, match="set model.hidden_size=64"):
        import_hf(cfg, hf, tmp_path / "new")


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
POLICIES = ("untied", "tied")


def hf_config(**kw):
    from transformers import LlamaConfig

    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1)
    return LlamaConfig(**{**base, **kw})


def random_hf_model(cls, config, seed):
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # random norms: a swapped or misplaced norm must show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def make_batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
    lengths = torch.tensor([SEQ, 9, 12, 5])
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


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from distributed import torchrun

    root = tmp_path_factory.mktemp("hf_convert")
    models = {
        "untied": random_hf_model(LlamaForCausalLM, hf_config(rms_norm_eps=1e-5), seed=0),
        "tied": random_hf_model(LlamaForCausalLM, hf_config(tie_word_embeddings=True, rms_norm_eps=1e-6,
                                                            rope_theta=500000.0), seed=1),
        "rm": random_hf_model(LlamaForSequenceClassification, hf_config(num_labels=1, pad_token_id=0), seed=2),
    }
    models["untied"].save_pretrained(root / "hf" / "untied", max_shard_size="100KB")  # sharded + index
    for name in ("tied", "rm"):
        models[name].save_pretrained(root / "hf" / name)
    bf16 = random_hf_model(LlamaForCausalLM, hf_config(rms_norm_eps=1e-5), seed=0).to(torch.bfloat16)
    bf16.save_pretrained(root / "hf" / "bf16")  # imported as bfloat16 parameters
    assert (root / "hf" / "untied" / "model.safetensors.index.json").is_file()
    batch = make_batch()
    torch.save(batch, root / "batch.pt")
    worker = "tests/workers/hf_convert.py"
    for layout, (tp, pp, nproc) in LAYOUTS.items():
        flags = {"tp2pp1": ["--import-train"], "tp1pp2": ["--reload"]}.get(layout, [])
        torchrun(nproc, worker, f"--root={root}", f"--layout={layout}", *flags,
                 f"parallel.tensor_parallel={tp}", f"parallel.pipeline_parallel={pp}")
    results = {layout: torch.load(root / f"results_{layout}.pt") for layout in LAYOUTS}
    return root, models, batch, results


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("variant", POLICIES)
def test_loaded_policy_matches_transformers(runs, layout, variant):
    _, models, batch, results = runs
    want = hf_policy_outputs(models[variant], batch["tokens"])
    ours = results[layout]["loaded"][variant]
    diffs = {k: max_diff(ours[k], want[k]) for k in ("logits", "logprobs")}
    print(f"\n{variant} {layout}: max |logit diff| {diffs['logits']:.2e}, max |logprob diff| {diffs['logprobs']:.2e}")
    assert diffs["logits"] < ATOL and diffs["logprobs"] < ATOL


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loaded_reward_model_matches_transformers(runs, layout):
    _, models, batch, results = runs
    scores, values = hf_value_outputs(models["rm"], batch)
    ours = results[layout]["loaded"]["rm"]
    print(f"\nrm {layout}: max |score diff| {max_diff(ours['rewards'], scores):.2e}, "
          f"max |value diff| {max_diff(ours['values'], values):.2e}")
    assert max_diff(ours["rewards"], scores) < ATOL
    assert max_diff(ours["values"], values) < ATOL


@pytest.mark.slow
def test_imported_checkpoints_load_at_another_layout(runs):
    """import_hf at TP2-PP1, load_role at TP1-PP2."""
    _, models, batch, results = runs
    for variant in POLICIES:
        want = hf_policy_outputs(models[variant], batch["tokens"])
        ours = results["tp1pp2"]["reloaded"][variant]
        assert max_diff(ours["logits"], want["logits"]) < ATOL, variant
    scores, _ = hf_value_outputs(models["rm"], batch)
    assert max_diff(results["tp1pp2"]["reloaded"]["rm"]["rewards"], scores) < ATOL


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
@pytest.mark.parametrize("variant", [*POLICIES, "rm", "bf16"])
def test_import_then_export_gives_the_original_tensors(runs, variant, tmp_path):
    root, _, _, _ = runs
    role = "reward" if variant == "rm" else "actor"
    # model_cfg omitted: import_hf checkpoints record it
    out = export_hf(root / "import" / variant, role, tmp_path / "out", max_shard_bytes=200_000)
    original, exported = hf_tensors(root / "hf" / variant), hf_tensors(out)
    assert exported.keys() == original.keys()
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original) and len(set(index["weight_map"].values())) > 1
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is (variant == "tied")


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
    fields = model_config_from_hf(root / "hf" / variant)
    return load_config(None, [f"model.{k}={v}" for k, v in fields.items()] + ["model.max_seq_length=64"]).model


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
    assert max_diff(values, ours["values"]) < ATOL
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
    wrong.ffn_hidden_size = 256
    with pytest.raises(ConvertError, match="model.ffn_hidden_size"):
        export_hf(root / "trained", "actor", tmp_path / "b", model_cfg=wrong)
    with pytest.raises(ConvertError, match="pass model_cfg"):
        export_hf(root / "trained", "actor", tmp_path / "c")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "keep.txt").write_text("x")
    with pytest.raises(ConvertError, match="not empty"):
        export_hf(root / "import" / "untied", "actor", tmp_path / "d")
