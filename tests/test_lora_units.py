"""LoRA pieces that need no process group: the input a layernorm-fused (Transformer Engine)
linear layer multiplies, which its adapter must see too."""

from types import SimpleNamespace

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
