"""Hugging Face import/export of mixture-of-experts models (Qwen3-MoE, Mixtral) against transformers.

Fast tests: the expert mapping (convert/hf_moe_weights.py) in both specs' parameter names
(SequentialMLP's local_experts.<j>.linear_fc1/2, Transformer Engine's experts.linear_fc1.weight<j>)
at EP 1/2 x ETP 1/2 reassembles to megatron's checkpoint layout and back to the HF tensors; the
HF names and shapes we expect are what transformers' save_pretrained writes (per-expert names,
although transformers 5 fuses the experts in memory).
Slow tests (one torchrun launch per world size: 2, 1, 4 processes): tiny random models
(hidden 64, 4 experts, top-2; Qwen3-MoE: 4 layers, layer 2 dense, head_dim 32; Mixtral: 2 layers)
loaded at EP1, EP2, TP2 with ETP1, TP2 x EP2 (ETP2) and PP2 give transformers' logits within 1e-5;
the reward models (*ForSequenceClassification, the Qwen3-MoE one without top-k renormalisation)
their scores and values; checkpoints import_hf wrote at EP2 load at EP1 and at TP2; import ->
export returns every original tensor bit for bit and transformers loads the export; broken HF
directories and checkpoints exported as another family are refused by name.
"""

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from megatron_rlhf.config import load_config
from megatron_rlhf.convert import ConvertError, export_hf, hf_overrides
from megatron_rlhf.convert.hf_weights import Dims, hf_expected_shapes, hf_layer_tensors, layer_kinds, shard_for_param
from megatron_rlhf.convert.hf_moe_weights import ExpertRanks, MoEDims
from megatron_rlhf.convert.torch_dist_reader import TorchDistCheckpoint
from test_hf_convert import (  # the dense conversion tests' batch, transformers' outputs and parity checks
    ATOL, VOCAB, assert_policy_matches_transformers, assert_reward_model_matches_transformers,
    hf_policy_outputs, make_batch, max_diff,
)

BASE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            initializer_range=0.1, rope_theta=1e6)
# variant -> (family, config); *_rm: *ForSequenceClassification reward models
VARIANTS = {
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=4, head_dim=32, intermediate_size=96, num_experts=4,
                                    num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                    mlp_only_layers=[2])),
    "mixtral": ("mixtral", dict(num_hidden_layers=2, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe_rm": ("qwen3_moe", dict(num_hidden_layers=2, head_dim=16, intermediate_size=96, num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
                                       mlp_only_layers=[0], num_labels=1, pad_token_id=0)),
    "mixtral_rm": ("mixtral", dict(num_hidden_layers=2, intermediate_size=48, num_local_experts=4,
                                   num_experts_per_tok=2, num_labels=1, pad_token_id=0)),
}
POLICIES = ("qwen3_moe", "mixtral")
REWARD_MODELS = ("qwen3_moe_rm", "mixtral_rm")
# layout -> (TP, PP, processes, overrides); one launch per world size, EP2 first (it imports)
LAYOUTS = {
    "ep2": (1, 1, 2, ["parallel.expert_parallel=2"]),
    "tp2_etp1": (2, 1, 2, ["parallel.expert_tensor_parallel=1"]),
    "pp2": (1, 2, 2, []),
    "ep1": (1, 1, 1, []),
    "tp2_ep2": (2, 1, 4, ["parallel.expert_parallel=2"]),  # expert tensor parallel = TP = 2
}
RELOAD = ("tp2_etp1", "ep1")  # load the checkpoints written at EP2


def hf_classes(family):
    import transformers

    prefix = {"qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral"}[family]
    config = getattr(transformers, f"{prefix}Config")
    return config, getattr(transformers, f"{prefix}ForCausalLM"), getattr(transformers, f"{prefix}ForSequenceClassification")


def random_hf_model(variant, seed):
    family, changes = VARIANTS[variant]
    config_cls, causal, classifier = hf_classes(family)
    torch.manual_seed(seed)
    model = (classifier if variant.endswith("_rm") else causal)(config_cls(**{**BASE, **changes})).eval()
    with torch.no_grad():  # random norms: a swapped or misplaced one must show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def model_cfg_of(hf_dir: Path):
    return load_config(None, hf_overrides(hf_dir) + ["model.max_seq_length=64"]).model


# ----------------------------------------------------------------------------- fast: the mapping


TE_NAMES = {"fc1": "mlp.experts.linear_fc1.weight{j}", "fc2": "mlp.experts.linear_fc2.weight{j}"}
LOCAL_NAMES = {"fc1": "mlp.experts.local_experts.{j}.linear_fc1.weight",
               "fc2": "mlp.experts.local_experts.{j}.linear_fc2.weight"}


@pytest.mark.parametrize("family", POLICIES)
@pytest.mark.parametrize("spec", [LOCAL_NAMES, TE_NAMES], ids=["local", "transformer_engine"])
def test_expert_shards_reassemble_to_the_checkpoint_layout_and_back(spec, family):
    """Each (EP rank, ETP rank)'s expert shards in `spec`'s names -> the EP/ETP-independent
    layout megatron's checkpoints store (experts stacked; fc1 per expert [all gate rows; all up
    rows]) -> export mapping -> the original HF tensors, at EP 1/2 x ETP 1/2."""
    e, f, h = 4, 24, 16
    moe = MoEDims(family, e, f, ())
    d = Dims(num_layers=2, hidden=h, heads=2, kv_heads=2, ffn=32, vocab=10, padded_vocab=16, tied=False, head_dim=8,
             moe=moe, family=family)
    g = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(s, generator=g) for n, s in hf_expected_shapes(d, False).items() if n.startswith("model.layers.1.")}

    def read(name, rows=None, cols=None):
        t = hf[name]
        t = t[rows[0]: rows[1]] if rows else t
        return t[:, cols[0]: cols[1]] if cols else t

    def shard(suffix, ranks):
        return shard_for_param(f"decoder.layers.0.{suffix}", read, d, 0, 1, lambda i: i + 1, False, False,
                               torch.float32, ranks)  # local layer 0 = global layer 1 (a later PP stage)

    for ep in (1, 2):
        for etp in (1, 2):
            fc1 = torch.empty(e, 2 * f, h)
            fc2 = torch.empty(e, h, f)
            for ep_rank in range(ep):
                for etp_rank in range(etp):
                    ranks = ExpertRanks(ep_rank, ep, etp_rank, etp)
                    for j in range(e // ep):
                        expert, rows = ep_rank * (e // ep) + j, slice(etp_rank * f // etp, (etp_rank + 1) * f // etp)
                        part = shard(spec["fc1"].format(j=j), ranks)
                        assert part.shape == (2 * f // etp, h)
                        fc1[expert, rows], fc1[expert, f:][rows] = part.chunk(2)
                        fc2[expert, :, rows] = shard(spec["fc2"].format(j=j), ranks)
            full = {"router": shard("mlp.router.weight", ExpertRanks(0, ep, 0, etp)), "experts_fc1": fc1,
                    "experts_fc2": fc2}
            attention = torch.zeros((d.heads + 2 * d.kv_heads) * d.head_dim, h)  # not under test here
            back = hf_layer_tensors(1, lambda kind: full.get(kind, attention), d)
            moe_back = {n: t for n, t in back.items() if n in hf and "self_attn" not in n and "layernorm" not in n}
            assert moe_back.keys() == {n for n in hf if "self_attn" not in n and "layernorm" not in n}
            for name, t in moe_back.items():
                assert torch.equal(t, hf[name]), (ep, etp, name)
    # EP rank 1's local expert 0 is global expert E/EP = 2; fc1 = [gate; up] (Mixtral: w1, w3)
    gate, up = ("gate_proj", "up_proj") if family == "qwen3_moe" else ("w1", "w3")
    block = "mlp" if family == "qwen3_moe" else "block_sparse_moe"
    got = shard(spec["fc1"].format(j=0), ExpertRanks(1, 2, 0, 1))
    assert torch.equal(got, torch.cat([hf[f"model.layers.1.{block}.experts.2.{gate}.weight"],
                                       hf[f"model.layers.1.{block}.experts.2.{up}.weight"]]))
    assert set(layer_kinds(d, 1)) >= {"router", "experts_fc1", "experts_fc2"} and "fc1" not in layer_kinds(d, 1)


def test_a_dense_parameter_in_an_expert_layer_is_refused():
    moe = MoEDims("qwen3_moe", 4, 8, (1,))
    d = Dims(num_layers=2, hidden=8, heads=2, kv_heads=2, ffn=16, vocab=10, padded_vocab=16, tied=False, head_dim=4,
             moe=moe, family="qwen3_moe")
    read = lambda name, rows=None, cols=None: torch.zeros(1)  # noqa: E731
    with pytest.raises(ConvertError, match="model.moe_dense_layers"):
        shard_for_param("decoder.layers.0.mlp.linear_fc1.weight", read, d, 0, 1, lambda i: i, False, False, torch.float32)
    with pytest.raises(ConvertError, match="model.num_experts / model.moe_dense_layers"):
        shard_for_param("decoder.layers.1.mlp.router.weight", read, d, 0, 1, lambda i: i, False, False, torch.float32)
    with pytest.raises(ConvertError, match="expert_parallel=2 gives each rank 2"):
        shard_for_param("decoder.layers.0.mlp.experts.linear_fc2.weight2", read, d, 0, 1, lambda i: i, False, False,
                        torch.float32, ExpertRanks(0, 2, 0, 1))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_expected_names_are_what_transformers_writes(variant, tmp_path):
    """save_pretrained writes the per-expert names the hub uses (transformers 5 holds the experts
    fused in memory: experts.gate_up_proj [E, 2F, h]); hf_expected_shapes lists exactly those."""
    model = random_hf_model(variant, 0)
    assert any(n.endswith("experts.gate_up_proj") for n in model.state_dict())
    model.save_pretrained(tmp_path)
    saved = {n: tuple(t.shape) for n, t in hf_tensors(tmp_path).items()}
    m = model_cfg_of(tmp_path)
    value_model = variant.endswith("_rm")
    expected = hf_expected_shapes(dataclasses.replace(Dims.of(m), tied=False), value_model)
    assert saved == expected


# ----------------------------------------------------------------------------- slow: real models


def write_broken(root: Path, source: Path) -> None:
    """Copies of `source` (qwen3_moe) missing an expert tensor, with one of the wrong shape, and
    in transformers' fused in-memory layout."""
    from safetensors.torch import save_file

    tensors = hf_tensors(source)
    missing = "model.layers.3.mlp.experts.1.up_proj.weight"
    wrong = "model.layers.1.mlp.experts.3.down_proj.weight"
    for name, changed in {"missing_expert": {k: v for k, v in tensors.items() if k != missing},
                          "wrong_shape": {**tensors, wrong: tensors[wrong][:, :-1].contiguous()}}.items():
        (root / name).mkdir()
        shutil.copy(source / "config.json", root / name / "config.json")
        save_file(changed, str(root / name / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from distributed import torchrun
    from workers import layout_args

    root = tmp_path_factory.mktemp("hf_moe")
    models = {}
    for seed, variant in enumerate(VARIANTS):
        models[variant] = random_hf_model(variant, seed)
        models[variant].save_pretrained(root / "hf" / variant, **({"max_shard_size": "100KB"} if variant == "mixtral"
                                                                   else {}))
    assert (root / "hf" / "mixtral" / "model.safetensors.index.json").is_file()  # sharded + index
    write_broken(root / "hf", root / "hf" / "qwen3_moe")
    models["qwen3_moe"].save_pretrained(root / "hf" / "fused", save_original_format=False)
    batch = make_batch()
    torch.save(batch, root / "batch.pt")
    by_world = {}
    for layout, (tp, pp, nproc, overrides) in LAYOUTS.items():
        by_world.setdefault(nproc, {})[layout] = (tp, pp, overrides)
    model_args = hf_overrides(root / "hf" / "qwen3_moe") + ["model.max_seq_length=64"]
    for nproc, layouts in by_world.items():  # 2 (imports at EP2), then 1 and 4 processes
        torchrun(nproc, "tests/workers/hf_moe.py", f"--root={root}", *layout_args(layouts), "--import-at=ep2",
                 *[f"--reload={r}" for r in RELOAD], *model_args)
    results = {layout: torch.load(root / f"results_{layout}.pt") for layout in LAYOUTS}
    return root, models, batch, results


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("variant", POLICIES)
def test_loaded_policy_matches_transformers(runs, layout, variant):
    _, models, batch, results = runs
    assert_policy_matches_transformers(models[variant], batch, results[layout]["loaded"][variant], f"{variant} {layout}")


@pytest.mark.slow
@pytest.mark.parametrize("variant", REWARD_MODELS)
def test_loaded_reward_model_matches_transformers(runs, variant):
    _, models, batch, results = runs
    assert_reward_model_matches_transformers(models[variant], batch, results["ep2"]["loaded"][variant], f"{variant} ep2")


@pytest.mark.slow
@pytest.mark.parametrize("layout", RELOAD)
def test_checkpoint_written_at_ep2_loads_at_another_layout(runs, layout):
    """import_hf at EP2 (2 experts per rank), load_role at EP1 and at TP2: the logits of the
    weights loaded from HF at that layout, exactly."""
    _, models, batch, results = runs
    for variant in POLICIES:
        ours = results[layout]["reloaded"][variant]
        assert torch.equal(ours["logits"], results[layout]["loaded"][variant]["logits"]), variant
        assert max_diff(ours["logits"], hf_policy_outputs(models[variant], batch["tokens"])["logits"]) < ATOL


@pytest.mark.slow
@pytest.mark.parametrize("variant", [*POLICIES, *REWARD_MODELS])
def test_import_then_export_gives_the_original_tensors(runs, variant, tmp_path):
    """Every tensor bit for bit under the on-disk per-expert names, read from the checkpoint
    written at EP2; transformers loads the export as the same model."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    root, models, batch, _ = runs
    value_model = variant in REWARD_MODELS
    out = export_hf(root / "import" / variant, "reward" if value_model else "actor", tmp_path / "out",
                    max_shard_bytes=100_000, special_token_ids={"pad_token_id": 0})
    original, exported = hf_tensors(root / "hf" / variant), hf_tensors(out)
    assert exported.keys() == original.keys()
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    # the checkpoint (written at EP2) holds all experts of a layer in one global tensor
    ck = TorchDistCheckpoint(root / "import" / variant / "iter_0000000" / ("reward" if value_model else "actor"))
    f = VARIANTS[variant][1].get("moe_intermediate_size", VARIANTS[variant][1]["intermediate_size"])
    assert ck.shape("decoder.layers.1.mlp.experts.experts.linear_fc1.weight") == (4, 2 * f, 64)
    assert ck.shape("decoder.layers.1.mlp.experts.experts.linear_fc2.weight") == (4, 64, f)
    assert len(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    config = json.loads((out / "config.json").read_text())
    family, changes = VARIANTS[variant]
    assert config["model_type"] == family and config["num_experts_per_tok"] == 2
    cls = AutoModelForSequenceClassification if value_model else AutoModelForCausalLM
    reloaded = cls.from_pretrained(out, local_files_only=True).eval()
    assert type(reloaded) is type(models[variant])
    for name, t in models[variant].state_dict().items():  # nothing left at a fresh initialisation
        assert torch.equal(reloaded.state_dict()[name], t), name
    if not value_model:
        assert max_diff(hf_policy_outputs(reloaded, batch["tokens"])["logits"],
                        hf_policy_outputs(models[variant], batch["tokens"])["logits"]) == 0


@pytest.mark.slow
def test_broken_hf_directories_are_refused_by_tensor(runs):
    _, _, _, results = runs
    refused = results["ep2"]["refused"]
    assert "tensor 'model.layers.3.mlp.experts.1.up_proj.weight' is missing (expected shape [32, 64])" \
        in refused["missing_expert"]
    assert "'model.layers.1.mlp.experts.3.down_proj.weight' has shape [64, 31], expected [64, 32]" in refused["wrong_shape"]
    assert re.search(r"it holds 'model.layers.\d+.mlp.experts.(gate_up|down)_proj'.*save_original_format=False",
                     refused["fused"])


@pytest.mark.slow
def test_export_as_the_wrong_family_is_refused_by_field(runs, tmp_path):
    root, _, _, _ = runs
    qwen = model_cfg_of(root / "hf" / "qwen3_moe")
    mixtral = model_cfg_of(root / "hf" / "mixtral")
    wrong = {
        # a Qwen3-MoE checkpoint as Mixtral (no q/k norms, no dense layer)
        "qwen3_moe as mixtral": (
            "qwen3_moe", dataclasses.replace(qwen, family="mixtral", qk_layernorm=False, moe_dense_layers=[],
                                             ffn_hidden_size=qwen.expert_ffn_hidden_size, moe_ffn_hidden_size=None),
            r"dense MLPs in layers \[2\], but model.family='mixtral' with model.moe_dense_layers=\[\]"),
        # a Qwen3-MoE checkpoint as dense Qwen3
        "qwen3_moe as qwen3": (
            "qwen3_moe", dataclasses.replace(qwen, family="qwen3", num_experts=None, moe_dense_layers=[],
                                             moe_ffn_hidden_size=None),
            r"mixture-of-experts layers \(experts in layers \[0, 1, 3\]\), but model.family='qwen3' with "
            r"model.num_experts=null is dense"),
        # a Mixtral checkpoint as Qwen3-MoE
        "mixtral as qwen3_moe": (
            "mixtral", dataclasses.replace(mixtral, family="qwen3_moe", qk_layernorm=True),
            r"has no qk norm tensors, but model.qk_layernorm=True \(model.family='qwen3_moe'\)"),
        "experts": ("mixtral", dataclasses.replace(mixtral, num_experts=8), r"mlp.router.weight is \[4, 64\], "
                    r"model.num_experts give \[8, 64\]"),
        "expert size": ("qwen3_moe", dataclasses.replace(qwen, moe_ffn_hidden_size=64),
                        r"linear_fc1.weight is \[4, 64, 64\], model.num_experts / model.moe_ffn_hidden_size give "
                        r"\[4, 128, 64\]"),
    }
    for what, (variant, model_cfg, message) in wrong.items():
        with pytest.raises(ConvertError, match=message):
            export_hf(root / "import" / variant, "actor", tmp_path / what.replace(" ", "_"), model_cfg=model_cfg)
        assert not (tmp_path / what.replace(" ", "_")).exists(), what
