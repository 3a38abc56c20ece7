"""LoRA pieces that need no process group (the input a layernorm-fused (Transformer Engine)
linear layer multiplies, which its adapter must see too; the config rules), and the refit of a
LoRA actor in a one-rank process."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_rlhf.models.lora import is_adapter, normalized_input


def fused_layer(normalization: str, zero_centered: bool = False):
    g = torch.Generator().manual_seed(0)
    return SimpleNamespace(
        layer_norm_weight=torch.rand(16, generator=g) + 0.5, layer_norm_bias=torch.rand(16, generator=g),
        config=SimpleNamespace(normalization=normalization, layernorm_epsilon=1e-5,
                               layernorm_zero_centered_gamma=zero_centered))


def test_adapter_of_a_fused_rmsnorm_layer_sees_the_normalised_input():
    x = torch.randn(3, 2, 16) * 4 + 1
    layer = fused_layer("RMSNorm")
    norm = torch.nn.RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(layer.layer_norm_weight)
    torch.testing.assert_close(normalized_input(layer, x), norm(x))
    assert not torch.allclose(normalized_input(layer, x), x)


def test_zero_centered_gamma_and_layernorm():
    x = torch.randn(3, 2, 16)
    layer = fused_layer("LayerNorm", zero_centered=True)
    want = torch.nn.functional.layer_norm(x, (16,), layer.layer_norm_weight + 1, layer.layer_norm_bias, 1e-5)
    torch.testing.assert_close(normalized_input(layer, x), want)


def test_plain_linear_layers_see_their_input():
    x = torch.randn(2, 16)
    assert normalized_input(SimpleNamespace(), x) is x


def test_adapter_names():
    assert is_adapter("decoder.layers.0.mlp.linear_fc1.lora_A")
    assert not is_adapter("decoder.layers.0.mlp.linear_fc1.weight")


def test_a_resumed_adapter_on_another_base_is_reported():
    from megatron_rlhf.models.roles import lora_base_warnings

    moved = SimpleNamespace(resumed_lora_base="/ckpt/sft/iter_0000060/actor", lora_base="/other/sft/iter_0000030/actor")
    same = SimpleNamespace(resumed_lora_base="/ckpt/rm/iter_0000060/reward", lora_base="/ckpt/rm/iter_0000060/reward")
    fresh = SimpleNamespace(resumed_lora_base=None, lora_base="/ckpt/sft/iter_0000060/actor")
    (warning,) = lora_base_warnings({"actor": moved, "critic": same, "fresh": fresh})
    assert warning.startswith("warning: actor:") and moved.resumed_lora_base in warning and moved.lora_base in warning


def test_adapter_dropout_is_refused_for_the_rl_stage_only():
    """PPO's old log-probs and values come from eval-mode forwards: adapter dropout in the
    training forward would make the first minibatch's ratios differ from 1."""
    from megatron_rlhf.config import ConfigError, load_config, validate

    with pytest.raises(ConfigError, match=r"lora\.dropout=0\.1.*lora\.stages"):
        validate(load_config(None, ["lora.rank=8", "lora.dropout=0.1", "lora.stages=[sft,rl]",
                                    "sft.init_from=/ckpt/base"]), world_size=1)
    validate(load_config(None, ["lora.rank=8", "lora.dropout=0.1", "lora.stages=[sft,dpo]",
                                "sft.init_from=/ckpt/base"]), world_size=1)
    validate(load_config(None, ["lora.rank=0", "lora.dropout=0.1"]), world_size=1)  # LoRA off: nothing to drop


def test_lora_refit_merges_one_group_at_a_time_and_sends_the_merged_weights(tmp_path):
    """At 70B TP8 x PP4 every adapted weight of a stage merged at once is ~4.4 GB per GPU: the
    refit merges a group (one decoder layer) as it gathers it. Measured at every bucket of a
    one-rank refit (tests/workers/lora_refit_memory.py)."""
    worker = Path(__file__).parent / "workers" / "lora_refit_memory.py"
    proc = subprocess.run([sys.executable, str(worker), str(tmp_path / "out.json")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))})
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads((tmp_path / "out.json").read_text())
    # held beyond the model and the bucket: at most the group being sent, not every merged weight
    assert 0 < out["peak_held_bytes"] <= out["largest_group_bytes"] < out["all_merged_bytes"], out
    assert out["names_equal"] and out["differ_from_folded"] == [], out  # bit for bit W + (alpha/r) B A
    assert out["changed_by_adapters"] == out["under_adapters"], out
