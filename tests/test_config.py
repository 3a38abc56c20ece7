"""Config loading, overrides and validation: every error names the offending field."""

import dataclasses
from pathlib import Path

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
    cfg = validate(Config(), world_size=1)
    assert cfg.model.vocab_size is None  # the tokenizer's, set when a stage loads it
    assert dataclasses.replace(cfg.model, vocab_size=87).padded_vocab_size == 128


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


def test_yaml_syntax_errors_name_the_file_line_and_column(tmp_path):
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("seed: 3\nsft:\n  steps: [1,\n  lr: 2\n")  # the list is never closed
    with pytest.raises(ConfigError) as err:
        load_config(recipe)
    message = str(err.value)
    assert message.startswith(f"{recipe}:5:1: not valid YAML: expected ',' or ']'"), message
    assert "flow sequence started at line 3, column 10" in message and "unicode string" not in message
    (tmp_path / "child.yaml").write_text("base: base.yaml\n")
    (tmp_path / "base.yaml").write_text("model:\n  hidden_size: 64\n num_layers: 2\n")  # bad indentation
    with pytest.raises(ConfigError, match=f"^{tmp_path / 'base.yaml'}:3:2: not valid YAML"):
        load_config(tmp_path / "child.yaml")  # the base recipe's own file and line


def test_yaml_syntax_error_in_an_override_names_the_override():
    with pytest.raises(ConfigError) as err:
        parse_overrides(["seed=3", "sft.steps=[1,"])
    message = str(err.value)
    assert message.startswith("override 'sft.steps=[1,': the value is not valid YAML: "), message
    assert "quotes" in message and "unicode string" not in message and "line" not in message


def test_cli_reports_a_yaml_syntax_error_as_a_config_error_with_exit_2(tmp_path, capsys, monkeypatch):
    from megatron_rlhf.__main__ import ERROR_DIR_ENV, main

    monkeypatch.delenv(ERROR_DIR_ENV, raising=False)
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("seed: 3\nrl: {steps: 4\n")
    assert main(["stages", "--config", str(recipe)]) == 2
    assert capsys.readouterr().err.startswith(f"config error: {recipe}:3:1: not valid YAML")
    assert main(["stages", "--config", "pipelines/tiny_cpu.yaml", "sft.steps=[1,"]) == 2
    assert capsys.readouterr().err.startswith("config error: override 'sft.steps=[1,'")


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


RECIPES = {"tiny_cpu.yaml": (1, 2), "hf_small_cpu.yaml": (1, 2), "tiny_cpu_grpo.yaml": (1, 2), "tiny_cpu_rloo.yaml": (1, 2),
           "tiny_cpu_reinforce_pp.yaml": (1, 2), "tiny_cpu_vllm.yaml": (1, 2), "tiny_cpu_arithmetic.yaml": (1, 2), "tiny_cpu_agent.yaml": (1, 2), "tiny_cpu_dpo.yaml": (1, 2), "tiny_cpu_dpo_ppo.yaml": (1, 2), "llama3_8b.yaml": (8,), "qwen3_8b.yaml": (8,), "qwen3_8b_grpo_long.yaml": (16, 8), "llama3_70b.yaml": (64,),
           "llama3_70b_grpo.yaml": (64,), "llama3_70b_dpo.yaml": (64,), "tiny_cpu_lora.yaml": (1, 2),
           "llama3_70b_lora.yaml": (64,), "tiny_cpu_dpo_lora.yaml": (1, 2),
           "tiny_cpu_moe.yaml": (2,), "tiny_cpu_async.yaml": (1, 2), "llama3_70b_grpo_async.yaml": (64,), "qwen3_30b_a3b_grpo.yaml": (16,), "qwen3_235b_a22b_grpo.yaml": (256,)}
PIPELINES = Path(__file__).resolve().parent.parent / "pipelines"


@pytest.mark.parametrize("recipe, world_size", [(r, w) for r, sizes in RECIPES.items() for w in sizes])
def test_every_recipe_validates_at_its_layout(recipe, world_size):
    cfg = load_config(PIPELINES / recipe)
    validate(cfg, world_size=world_size)
    assert not cfg.notes, cfg.notes  # recipes use the current key names


def test_recipes_directory_is_fully_covered():
    assert {p.name for p in PIPELINES.glob("*.yaml")} == set(RECIPES)


def test_rl_refuses_what_would_bend_its_gradient():
    # k1 in the loss: zero expected gradient (tests/test_rl_math.py shows it numerically)
    msg = assert_error_names("rl.kl_estimator", "rl.kl_in_reward=false", "rl.kl_estimator=k1")
    assert "rl.kl_estimator=k2" in msg
    validate(cfg_with("rl.kl_in_reward=false", "rl.kl_estimator=k2"), world_size=1)
    # a filtered sampler with log-probs of the full softmax: off-policy rollouts, biased KL
    assert "sampling.top_k=0 and sampling.top_p=1.0" in assert_error_names("sampling.top_k", "sampling.top_k=20")
    assert_error_names("sampling.top_p", "sampling.top_p=0.9")
    assert_error_names("rl.kl_clip", "rl.kl_clip=0")
    assert validate(cfg_with("rl.kl_clip=null"), world_size=1).rl.kl_clip is None
    assert_error_names("rl.loss_aggregation", "rl.loss_aggregation=sum")
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        validate(cfg_with(f"rl.loss_aggregation={mode}"), world_size=1)


def test_biased_kl_in_the_reward_is_warned_about():
    from megatron_rlhf.config import warnings_for

    assert warnings_for(cfg_with()) == []  # k1 in the reward: unbiased
    assert warnings_for(cfg_with("rl.kl_in_reward=false", "rl.kl_estimator=k3")) == []
    (warning,) = warnings_for(cfg_with("rl.kl_estimator=k3"))
    assert "rl.kl_estimator=k3" in warning and "biased" in warning
    (warning,) = warnings_for(cfg_with("rl.importance_ratio=sequence"))
    assert "seq_mean_token_mean" in warning
    assert warnings_for(cfg_with("rl.importance_ratio=sequence", "rl.loss_aggregation=seq_mean_token_mean")) == []
    (warning,) = warnings_for(cfg_with("rl.max_sampling_rounds=5"))
    assert "rl.dynamic_sampling=false" in warning


def test_the_old_ppo_section_is_read_as_rl_with_a_note(tmp_path):
    from megatron_rlhf.config import warnings_for

    recipe = tmp_path / "old.yaml"
    recipe.write_text("ppo:\n  steps: 7\n  ppo_epochs: 3\n")
    cfg = load_config(recipe, ["ppo.kl_coef=0.2"])
    assert (cfg.rl.steps, cfg.rl.epochs, cfg.rl.kl_coef) == (7, 3, 0.2)
    notes = " ".join(warnings_for(cfg))
    assert "ppo.ppo_epochs -> rl.epochs" in notes and "ppo.kl_coef -> rl.kl_coef" in notes
    with pytest.raises(ConfigError, match="ppo.steps and rl.steps are both set"):
        load_config(recipe, ["rl.steps=3", "ppo.steps=4"])


def test_the_sampling_settings_of_the_rl_section_are_read_as_the_sampling_section_with_a_note(tmp_path):
    from megatron_rlhf.config import warnings_for

    recipe = tmp_path / "old.yaml"
    recipe.write_text("base: " + str(PIPELINES / "tiny_cpu.yaml") + "\nppo:\n  temperature: 0.7\n"
                      "rl:\n  max_new_tokens: 8\n")
    cfg = load_config(recipe, ["rl.eval_samples_logged=5"])
    s = cfg.sampling
    assert (s.temperature, s.max_new_tokens, s.eval_samples_logged) == (0.7, 8, 5)
    notes = " ".join(warnings_for(cfg))
    for key in ("temperature", "max_new_tokens", "eval_samples_logged"):
        assert f"rl.{key} -> sampling.{key}" in notes
    with pytest.raises(ConfigError, match="rl.top_p and sampling.top_p are both set"):
        load_config(recipe, ["rl.top_p=0.9", "sampling.top_p=1.0"])
    # a DPO run samples its evaluation as the RL stage does: one section, read by both stages
    assert "sampling.max_new_tokens=200: leaves no room" in assert_error_names(
        "sampling.max_new_tokens", "sampling.max_new_tokens=200", "pipeline.stages=[sft,dpo]")


def test_critic_free_algorithms_refuse_critic_settings_and_single_samples():
    msg = assert_error_names("rl.n_samples_per_prompt", "rl.algorithm=grpo")
    assert "rl.n_samples_per_prompt >= 2" in msg
    for algorithm in ("rloo", "reinforce_pp_baseline"):
        assert_error_names("rl.n_samples_per_prompt", f"rl.algorithm={algorithm}")
    grpo = ("rl.algorithm=grpo", "rl.n_samples_per_prompt=4", "rl.rollout_batch_size=8")
    assert not validate(cfg_with(*grpo), world_size=2).rl.has_critic
    for setting in ("rl.vf_coef=0.5", "rl.critic_optimizer.lr=1e-3", "rl.lam=0.9", "rl.whiten_advantages=false"):
        field = setting.split("=")[0]
        assert "has no critic" in assert_error_names(field, *grpo, setting)
    validate(cfg_with("rl.algorithm=reinforce_pp"), world_size=1)  # no groups needed
    assert_error_names("rl.algorithm", "rl.algorithm=dpo")
    assert_error_names("rl.dynamic_sampling", "rl.dynamic_sampling=true")
    assert_error_names("rl.dual_clip", "rl.dual_clip=0.5")
    assert_error_names("rl.importance_ratio", "rl.importance_ratio=group")
    assert_error_names("rl.group_std_normalization", "rl.algorithm=rloo", "rl.n_samples_per_prompt=2",
                       "rl.group_std_normalization=false")
    validate(cfg_with(*grpo, "rl.group_std_normalization=false"), world_size=1)  # Dr.GRPO
    # every rank samples whole groups: prompts must split evenly over data-parallel ranks
    assert_error_names("rl.rollout_batch_size", *grpo[:2], "rl.rollout_batch_size=6", "rl.mini_batch_size=8",
                       world_size=4)


def test_a_critic_setting_inherited_from_a_base_recipe_is_not_an_error(tmp_path):
    (tmp_path / "base.yaml").write_text("rl:\n  vf_coef: 0.5\n  steps: 5\n")
    (tmp_path / "grpo.yaml").write_text("base: base.yaml\nrl:\n  algorithm: grpo\n  n_samples_per_prompt: 2\n")
    cfg = validate(load_config(tmp_path / "grpo.yaml"), world_size=1)
    assert (cfg.rl.steps, cfg.rl.vf_coef, cfg.rl.algorithm) == (5, 0.5, "grpo")
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "loop.yaml")


def test_pipeline_stages_are_checked_against_what_each_stage_starts_from():
    assert validate(cfg_with(), world_size=1).pipeline.stages == ["sft", "rm", "rl"]
    assert "rl.algorithm" in assert_error_names("pipeline.stages", "pipeline.stages=[sft,rm,grpo]")
    assert "rl.rm_from" in assert_error_names("pipeline.stages", "pipeline.stages=[sft,rl]")
    validate(cfg_with("pipeline.stages=[sft,rl]", "rl.rm_from=/runs/x/rm"), world_size=1)
    assert "rm.init_from" in assert_error_names("pipeline.stages", "pipeline.stages=[rm,sft]")
    assert_error_names("pipeline.stages", "pipeline.stages=[sft,sft]")
    assert_error_names("pipeline.stages", "pipeline.stages=sft")  # not a list


@pytest.mark.parametrize("overrides, field", [
    (["model.recompute_granularity=some"], "model.recompute_granularity"),
    (["model.recompute_granularity=full"], "model.recompute_granularity=full"),
    (["model.recompute_granularity=full", "model.recompute_method=uniform"], "model.recompute_granularity=full"),
    (["model.recompute_granularity=selective", "model.recompute_num_layers=1"], "model.recompute_method"),
])
def test_activation_recomputation_settings_are_checked(overrides, field):
    assert_error_names(field, *overrides)
    validate(load_config(None, ["model.recompute_granularity=full", "model.recompute_method=block",
                                "model.recompute_num_layers=1"]), world_size=1)


@pytest.mark.parametrize("overrides, field", [
    (["lora.rank=-1"], "lora.rank"),
    (["lora.rank=8", "lora.alpha=0"], "lora.alpha"),
    (["lora.rank=8", "lora.dropout=1.0"], "lora.dropout"),
    (["lora.rank=8", "lora.targets=[qkv,q_proj]"], "lora.targets"),
    (["lora.rank=8", "lora.targets=[]"], "lora.targets"),
    (["lora.rank=8", "lora.targets=[fc1,fc1]"], "lora.targets"),
    (["lora.rank=8", "lora.stages=[rm,rl]"], "lora.stages"),
    (["lora.rank=8", "lora.stages=[sft,rl]"], "sft.init_from"),  # adapters on a fresh initialisation
])
def test_lora_settings_are_checked(overrides, field):
    assert_error_names(field, *overrides)
    validate(load_config(None, ["lora.rank=8", "lora.targets=[qkv,fc2]", "lora.dropout=0.1", "lora.stages=[sft,dpo]",
                             "sft.init_from=/ckpt/base"]), world_size=1)
    validate(load_config(None, ["lora.rank=8", "lora.stages=[sft,dpo,rl]", "sft.init_from=/ckpt/base"]), world_size=1)


def test_lora_stages_write_beside_full_fine_tuning():
    from megatron_rlhf.trainers.stage_data import run_dir, stage_dir

    cfg = load_config(None, ["lora.rank=8", "lora.stages=[sft,dpo]", "sft.init_from=/ckpt/base"])
    assert [stage_dir(cfg, s).name for s in ("sft", "rm", "dpo", "rl")] == ["sft_lora", "rm", "dpo_lora", "ppo"]
    cfg = load_config(None, ["lora.rank=0", "lora.stages=[sft,dpo,rl]"])  # rank 0: LoRA off everywhere
    assert [stage_dir(cfg, s) for s in ("sft", "dpo", "rl")] == [run_dir(cfg) / n for n in ("sft", "dpo", "ppo")]


def test_an_episode_budget_without_room_for_a_prompt_and_a_turn_is_a_config_error(capsys, monkeypatch):
    """rl.max_total_tokens holds the prompt and the first policy turn (sampling.max_new_tokens):
    less than 2 prompt tokens left was a ValueError from data/encode.py when the stage started."""
    from megatron_rlhf.__main__ import ERROR_DIR_ENV, main

    monkeypatch.delenv(ERROR_DIR_ENV, raising=False)
    agent = PIPELINES / "tiny_cpu_agent.yaml"  # multi-turn: rl.max_total_tokens 56, sampling.max_new_tokens 12
    for overrides in (["rl.max_total_tokens=13"], ["sampling.max_new_tokens=55"]):
        with pytest.raises(ConfigError) as err:
            validate(load_config(agent, overrides), world_size=1)
        message = str(err.value)
        assert message.startswith("rl.max_total_tokens=") and "sampling.max_new_tokens=" in message, message
    assert message == ("rl.max_total_tokens=56 with sampling.max_new_tokens=55: an episode holds its prompt and a "
                       "whole first policy turn, which leaves the prompt 1 of the 2 tokens it needs; raise "
                       "rl.max_total_tokens to >= 57 or lower sampling.max_new_tokens to <= 54 (it is per policy turn)")
    validate(load_config(agent, ["rl.max_total_tokens=14"]), world_size=1)  # 2 prompt tokens: enough
    assert main(["stages", "--config", str(agent), "rl.max_total_tokens=12"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: rl.max_total_tokens=12 with sampling.max_new_tokens=12: ") and err.count("\n") == 1


def readme_hf_command() -> tuple[str, list[str]]:
    """The README's "your data and your Hugging Face model" command: (recipe, overrides)."""
    import shlex

    text = (PIPELINES.parent / "README.md").read_text()
    start = text.index("python -m megatron_rlhf.torchrun --nproc-per-node 1 pipeline --config")
    words = shlex.split(text[start:text.index("```", start)].replace("\\\n", " "))
    recipe = words[words.index("--config") + 1]
    return recipe, [w for w in words[words.index("--config") + 2:] if "=" in w]


def test_the_readmes_hf_command_fine_tunes_at_fine_tuning_learning_rates():
    """Before: it ran pipelines/tiny_cpu.yaml, whose SFT lr 3e-3 (training from scratch) took a
    135M instruct model's eval loss 0.79 -> 3.07 in 3 steps, silently."""
    import dataclasses

    from megatron_rlhf.config import learning_rate_warnings
    from megatron_rlhf.config.rules import FINE_TUNING_MAX_LR

    recipe, overrides = readme_hf_command()
    hf = dict(o.split("=", 1) for o in overrides)["model.init_from_hf"]
    cfg = load_config(PIPELINES.parent / recipe, [o for o in overrides if not o.startswith("model.init_from_hf=")])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from_hf=hf))  # no such directory here
    rates = [cfg.sft.optimizer.lr, cfg.rm.optimizer.lr, cfg.dpo.optimizer.lr, cfg.rl.actor_optimizer.lr,
             cfg.rl.critic_optimizer.lr]
    assert max(rates) <= FINE_TUNING_MAX_LR and learning_rate_warnings(cfg, cfg.pipeline.stages) == []
    assert cfg.data.tokenizer == "auto" and cfg.data.task is None


def test_from_scratch_learning_rates_on_a_pretrained_start_are_warned_about():
    import dataclasses

    from megatron_rlhf.config import learning_rate_warnings

    tiny = load_config(PIPELINES / "tiny_cpu.yaml")
    assert learning_rate_warnings(tiny, tiny.pipeline.stages) == []  # from scratch: its rates are right
    cfg = dataclasses.replace(tiny, model=dataclasses.replace(tiny.model, init_from_hf="/models/smol"))
    warned = learning_rate_warnings(cfg, ["sft", "rm", "rl"])
    assert [w.split(" ", 1)[0] for w in warned] == ["sft.optimizer.lr=0.003", "rm.optimizer.lr=0.001",
                                                    "rl.actor_optimizer.lr=0.0002", "rl.critic_optimizer.lr=0.001"]
    assert all("model.init_from_hf=/models/smol" in w and "pipelines/hf_small_cpu.yaml" in w for w in warned)
    lora = load_config(PIPELINES / "tiny_cpu.yaml", ["lora.rank=8", "lora.stages=[sft]", "sft.optimizer.lr=1e-3",
                                                     "sft.optimizer.min_lr=1e-4"])
    lora = dataclasses.replace(lora, model=dataclasses.replace(lora.model, init_from_hf="/models/smol"))
    assert learning_rate_warnings(lora, ["sft"]) == []  # LoRA's adapters take ~10x the rate
