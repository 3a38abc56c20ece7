"""The parallel section's rules for sequence and expert parallelism (torch-free): each bad
setting is refused naming its field, before any process group exists."""

import pytest

from megatron_rlhf.config import ConfigError, ModelConfig, ParallelConfig

DENSE = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=100)


@pytest.mark.parametrize("tp, setting, on", [(1, "auto", False), (2, "auto", True), (2, False, False), (4, True, True)])
def test_sequence_parallel_auto_is_on_exactly_with_tensor_parallelism(tp, setting, on):
    p = ParallelConfig(tensor_parallel=tp, sequence_parallel=setting)
    p.check(DENSE, world_size=tp)
    assert p.sequence_parallel_on is on


@pytest.mark.parametrize("p, field", [
    (ParallelConfig(tensor_parallel=1, sequence_parallel=True), "parallel.sequence_parallel=true"),
    (ParallelConfig(tensor_parallel=2, sequence_parallel="yes"), "parallel.sequence_parallel='yes'"),
    (ParallelConfig(expert_parallel=2), "parallel.expert_parallel=2"),
    (ParallelConfig(expert_parallel=0), "parallel.expert_parallel=0"),
])
def test_bad_sequence_or_expert_settings_name_their_field(p, field):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(")):
        p.check(DENSE, world_size=4)


def test_sequence_parallel_is_read_from_a_recipe_as_a_bool_or_auto():
    from megatron_rlhf.config import load_config

    assert load_config(None, ["parallel.sequence_parallel=false"]).parallel.sequence_parallel is False
    assert load_config(None, []).parallel.sequence_parallel == "auto"
    with pytest.raises(ConfigError, match="parallel.sequence_parallel"):
        load_config(None, ["parallel.sequence_parallel=3"])


MOE = ["model.family=mixtral", "model.num_experts=4", "model.moe_router_topk=2", "model.vocab_size=100"]


@pytest.mark.parametrize("overrides, field", [
    (["parallel.expert_parallel=3"], "parallel.expert_parallel=3: does not divide model.num_experts=4"),
    (["parallel.tensor_parallel=2", "parallel.sequence_parallel=false"], "parallel.sequence_parallel=false"),
    (["parallel.expert_tensor_parallel=3"], "parallel.expert_tensor_parallel=3"),
    (["lora.rank=4"], "lora.targets="),
])
def test_expert_model_settings_we_cannot_run_are_refused_by_name(overrides, field):
    from megatron_rlhf.config import load_config, validate

    with pytest.raises(ConfigError, match=field.replace("(", r"\(").replace("[", r"\[")):
        validate(load_config(None, [*MOE, *overrides]), world_size=2)


def test_an_expert_model_may_generate_with_vllm():
    """The refit streams experts under their HF names (tests/test_refit_moe.py, tests/test_vllm.py)."""
    from megatron_rlhf.config import load_config, validate

    cfg = validate(load_config(None, [*MOE, "rollout.engine=vllm", "parallel.expert_parallel=2"]), world_size=2)
    assert cfg.rollout.engine == "vllm"


def test_an_expert_layout_takes_megatrons_expert_groups():
    from megatron_rlhf.config import load_config, validate

    cfg = validate(load_config(None, [*MOE, "parallel.expert_parallel=2", "parallel.tensor_parallel=2",
                                      "parallel.expert_tensor_parallel=1"]), world_size=4)
    assert cfg.parallel.expert_tensor_parallel_size == 1 and cfg.parallel.sequence_parallel_on
    with pytest.raises(ConfigError, match="does not divide the world size 2"):
        validate(load_config(None, [*MOE, "parallel.expert_parallel=4"]), world_size=2)
