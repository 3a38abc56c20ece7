"""Export of LoRA checkpoints (convert/lora_export.py) against transformers and peft: the
merged export and the base export + PEFT adapter both give the LoRA actor's own log-probs, the
merged critic our critic's values; a LoRA checkpoint whose base checkpoint is gone is refused
naming the path. Uses the LoRA runs (tests/conftest.py: lora_runs; rank 4, alpha 8, all four
targets, random nonzero B)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_rlhf.config import load_config
from megatron_rlhf.convert import ConvertError, export_hf
from megatron_rlhf.convert.lora_export import export_peft_adapter
from test_lora import BASE, LAYOUTS, OVERRIDES
from workers.role_layouts import make_batch

pytestmark = pytest.mark.slow

ATOL = 1e-5


def model_cfg():
    return load_config(None, OVERRIDES).model  # the LoRA checkpoints record no model config


def hf_logprobs(model) -> torch.Tensor:
    """Our Actor's log-probs from a transformers model: [:, t] = log p(tokens[t+1] | tokens[:t+1]),
    zero from lengths - 1 on (right padding; the causal model needs no attention mask there)."""
    batch = make_batch(seed=1)
    tokens, lengths = batch["tokens"], batch["lengths"]
    with torch.no_grad():
        logits = model(tokens).logits.float()
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    lp = torch.cat([lp, torch.zeros_like(lp[:, :1])], dim=1)
    return lp * (torch.arange(tokens.shape[1]) < lengths[:, None] - 1)


def max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def test_merged_export_gives_the_adapted_logprobs(lora_runs, tmp_path):
    from transformers import AutoModelForCausalLM

    root, results = lora_runs
    out = export_hf(root / "init" / "actor_adapters", "actor", tmp_path / "merged", model_cfg=model_cfg())
    got = hf_logprobs(AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval())
    ours = results[BASE]["outputs"]["actor"]
    base = results[BASE]["outputs"]["base"]
    assert max_diff(ours["logprobs"], base["logprobs"]) > 0.1, "the adapters must change the actor"
    print(f"\nmerged LoRA export: max |logprob diff| {max_diff(got, ours['logprobs']):.2e}")
    assert max_diff(got, ours["logprobs"]) < ATOL
    info = json.loads((out / "config.json").read_text())["megatron_rlhf_export"]
    assert info["lora_merged_onto"] == str(root / "init" / "actor_base")


@pytest.mark.parametrize("layout", [BASE, *LAYOUTS])
def test_refit_sends_the_merged_weights(lora_runs, tmp_path, layout):
    """What a rollout engine (vLLM) receives from the LoRA actor at TP1, TP2 and PP2: the merged
    export's tensors, gathered over TP and PP."""
    root, results = lora_runs
    out = export_hf(root / "init" / "actor_adapters", "actor", tmp_path / "merged", model_cfg=model_cfg())
    want = {}
    for f in sorted(out.glob("*.safetensors")):
        want.update(load_file(f))
    refit = results[layout]["refit"]
    assert refit.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(refit[name].float(), tensor.float(), atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")
    base = export_hf(root / "init" / "actor_base", "actor", tmp_path / "base", model_cfg=model_cfg())
    base_q = load_file(next(base.glob("*.safetensors")))["model.layers.0.self_attn.q_proj.weight"]
    assert max_diff(refit["model.layers.0.self_attn.q_proj.weight"], base_q) > 1e-3, "adapters not merged"


def test_merged_critic_gives_our_values(lora_runs, tmp_path):
    from transformers import AutoModelForSequenceClassification

    root, results = lora_runs
    batch = make_batch(seed=1)
    real = torch.arange(batch["tokens"].shape[1]) < batch["lengths"][:, None]
    values = {}
    for name in ("critic_adapters", "critic_base"):
        out = export_hf(root / "init" / name, "critic", tmp_path / name, model_cfg=model_cfg())
        model = AutoModelForSequenceClassification.from_pretrained(out, local_files_only=True).eval()
        with torch.no_grad():  # per-token values: hidden @ score (our value head's bias is 0 here)
            values[name] = (model.model(batch["tokens"]).last_hidden_state @ model.score.weight.T)[..., 0] * real
    ours = results[BASE]["outputs"]["critic"]["values"] * real
    assert max_diff(ours, values["critic_base"]) > 0.1, "the adapters must change the critic"
    print(f"\nmerged LoRA critic: max |value diff| {max_diff(values['critic_adapters'], ours):.2e}")
    assert max_diff(values["critic_adapters"], ours) < ATOL


def test_peft_adapter_on_the_base_export_gives_the_adapted_logprobs(lora_runs, tmp_path):
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    root, results = lora_runs
    base_dir = export_hf(root / "init" / "actor_base", "actor", tmp_path / "base", model_cfg=model_cfg())
    peft_dir = export_peft_adapter(root / "init" / "actor_adapters", "actor", tmp_path / "peft",
                                   model_cfg=model_cfg(), base_model=base_dir)
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, str(base_dir))
    assert sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj", "lm_head"])
    base = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True).eval()
    outputs = results[BASE]["outputs"]
    assert max_diff(hf_logprobs(base), outputs["base"]["logprobs"]) < ATOL
    model = PeftModel.from_pretrained(base, peft_dir).eval()
    # every exported tensor went into the model (peft only warns about keys it does not use)
    saved, loaded = load_file(peft_dir / "adapter_model.safetensors"), get_peft_model_state_dict(model)
    # (peft's state dict also lists lm_head's base weight once lm_head is a target: not an adapter)
    loaded = {k: v for k, v in loaded.items() if ".lora_" in k}
    assert saved.keys() == loaded.keys() and len(saved) == (4 * 7 + 1) * 2  # 4 layers x 7 modules + lm_head
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    got = hf_logprobs(model)
    print(f"\nbase export + PEFT adapter: max |logprob diff| {max_diff(got, outputs['actor']['logprobs']):.2e}")
    assert max_diff(got, outputs["actor"]["logprobs"]) < ATOL


def test_lora_export_refusals(lora_runs, tmp_path):
    root, _ = lora_runs
    adapters, base = root / "init" / "actor_adapters", root / "init" / "actor_base"
    moved = tmp_path / "moved_base"
    base.rename(moved)  # the base checkpoint the adapters record is gone
    try:
        with pytest.raises(ConvertError) as err:
            export_hf(adapters, "actor", tmp_path / "out", model_cfg=model_cfg())
        assert str(base) in str(err.value) and "does not exist" in str(err.value)
        assert "--lora-base" in str(err.value)
        assert not (tmp_path / "out").exists()
        relocated = export_hf(adapters, "actor", tmp_path / "relocated", model_cfg=model_cfg(), lora_base=moved)
    finally:
        moved.rename(base)
    merged = export_hf(adapters, "actor", tmp_path / "merged", model_cfg=model_cfg())
    want, got = load_file(merged / "model.safetensors"), load_file(relocated / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    # PEFT adapters: LoRA policies only
    with pytest.raises(ConvertError, match="export-hf"):
        export_peft_adapter(root / "init" / "critic_adapters", "critic", tmp_path / "critic", model_cfg=model_cfg())
    with pytest.raises(ConvertError, match="not a LoRA adapter checkpoint"):
        export_peft_adapter(base, "actor", tmp_path / "full", model_cfg=model_cfg())
