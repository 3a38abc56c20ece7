"""Config loading, overrides and validation: every error names the offending field."""

import pytest

from megatron_rlhf.config import Config, ConfigError, load_config, parse_overrides, validate


def cfg_with(*overrides: str) -> Config:
    return load_config(None, list(overrides))


def assert_error_names(field: str, *overrides: str, world_size: int | None = None):
    with pytest.raises(ConfigError) as err:
        validate(cfg_with(*overrides), world_size=world_size)
    assert field in str(err.value)
    return str(err.value)


def test_defaults_are_valid():
    assert validate(Config(), world_size=1).model.padded_vocab_size == 128


def test_yaml_and_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("seed: 3\nmodel:\n  hidden_size: 128\n  num_layers: 4\noptimizer:\n  lr: 1e-4\n")
    cfg = load_config(recipe, ["model.num_layers=2", "parallel.tensor_parallel=2"])
    assert (cfg.seed, cfg.model.hidden_size, cfg.model.num_layers) == (3, 128, 2)
    assert cfg.parallel.tensor_parallel == 2
    assert cfg.optimizer.lr == 1e-4 and isinstance(cfg.optimizer.lr, float)  # YAML's "1e-4" string


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(ConfigError, match=r"model.hiden_size: unknown key; did you mean 'model.hidden_size'"):
        cfg_with("model.hiden_size=64")
    with pytest.raises(ConfigError, match="paralel: unknown key"):
        cfg_with("paralel.tensor_parallel=2")


@pytest.mark.parametrize("override, field", [
    ("model.hidden_size=abc", "model.hidden_size"),
    ("model.num_layers=2.5", "model.num_layers"),
    ("optimizer.use_distributed_optimizer=3", "optimizer.use_distributed_optimizer"),
    ("parallel.tensor_parallel=true", "parallel.tensor_parallel"),
    ("model=3", "model"),
])
def test_wrong_types_name_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        cfg_with(override)
    assert str(err.value).startswith(field)


def test_override_needs_key_value():
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_overrides(["model.hidden_size"])


def test_tp_must_divide_heads():
    msg = assert_error_names("parallel.tensor_parallel", "model.num_attention_heads=6",
                             "model.hidden_size=96", "parallel.tensor_parallel=4")
    assert "model.num_attention_heads=6" in msg


def test_tp_must_divide_kv_heads():
    assert_error_names("model.num_query_groups", "model.num_query_groups=1", "parallel.tensor_parallel=2")


def test_pp_larger_than_layers():
    msg = assert_error_names("parallel.pipeline_parallel", "model.num_layers=2", "parallel.pipeline_parallel=4")
    assert "larger than model.num_layers=2" in msg


def test_pp_must_divide_layers():
    assert_error_names("parallel.pipeline_parallel", "model.num_layers=3", "parallel.pipeline_parallel=2")


def test_world_size_divisible_by_tp_pp():
    msg = assert_error_names("parallel.tensor_parallel", "parallel.tensor_parallel=2",
                             "parallel.pipeline_parallel=2", world_size=6)
    assert "world size 6" in msg


def test_other_cross_field_rules():
    assert_error_names("model.hidden_size", "model.hidden_size=66")
    assert_error_names("model.num_query_groups", "model.num_query_groups=3")
    assert_error_names("model.params_dtype", "model.params_dtype=float8")
    assert_error_names("model.make_vocab_size_divisible_by", "model.make_vocab_size_divisible_by=3",
                       "parallel.tensor_parallel=2")
    assert_error_names("model.num_layers", "model.num_layers=0")
    assert_error_names("parallel.backend", "parallel.backend=mpi")
    assert_error_names("resilience.max_consecutive_nonfinite", "resilience.max_consecutive_nonfinite=-1")
    assert_error_names("checkpoint.keep_last", "checkpoint.keep_last=0")


def test_task_sizes_are_checked_with_the_field():
    with pytest.raises(ConfigError, match=r"^data.task_sizes: .*sft_eval"):
        cfg_with("data.task_sizes.sft_eval=0")
    assert cfg_with("data.task_sizes.sft_eval=7").data.task_sizes.sft_eval == 7


@pytest.mark.parametrize("recipe, world_size", [
    ("tiny_cpu.yaml", 1), ("tiny_cpu.yaml", 2), ("llama3_8b.yaml", 8), ("llama3_70b.yaml", 64),
])
def test_every_recipe_validates_at_its_layout(recipe, world_size):
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parent.parent / "pipelines" / recipe)
    validate(cfg, world_size=world_size)


def test_recipes_directory_is_fully_covered():
    from pathlib import Path

    recipes = {p.name for p in (Path(__file__).resolve().parent.parent / "pipelines").glob("*.yaml")}
    assert recipes == {"tiny_cpu.yaml", "llama3_8b.yaml", "llama3_70b.yaml"}


def test_ppo_refuses_what_would_bend_its_gradient():
    # k1 in the loss: zero expected gradient (tests/test_ppo_math.py shows it numerically)
    msg = assert_error_names("ppo.kl_estimator", "ppo.kl_in_reward=false", "ppo.kl_estimator=k1")
    assert "ppo.kl_estimator=k2" in msg
    validate(cfg_with("ppo.kl_in_reward=false", "ppo.kl_estimator=k2"), world_size=1)
    # a filtered sampler with log-probs of the full softmax: off-policy rollouts, biased KL
    assert "ppo.top_k=0 and ppo.top_p=1.0" in assert_error_names("ppo.top_k", "ppo.top_k=20")
    assert_error_names("ppo.top_p", "ppo.top_p=0.9")
    assert_error_names("ppo.kl_clip", "ppo.kl_clip=0")
    assert validate(cfg_with("ppo.kl_clip=null"), world_size=1).ppo.kl_clip is None
    assert_error_names("ppo.loss_aggregation", "ppo.loss_aggregation=sum")
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        validate(cfg_with(f"ppo.loss_aggregation={mode}"), world_size=1)


def test_biased_kl_in_the_reward_is_warned_about():
    from megatron_rlhf.config import warnings_for

    assert warnings_for(cfg_with()) == []  # k1 in the reward: unbiased
    assert warnings_for(cfg_with("ppo.kl_in_reward=false", "ppo.kl_estimator=k3")) == []
    (warning,) = warnings_for(cfg_with("ppo.kl_estimator=k3"))
    assert "ppo.kl_estimator=k3" in warning and "biased" in warning
