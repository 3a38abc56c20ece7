"""Typed run configuration: dataclasses are the single source of defaults, and each section's
rules sit beside its fields (a `check(...)` taking the sections and facts it needs).

    errors.py           ConfigError
    model.py            model: the architecture (ModelConfig, RopeScalingConfig), experts included
    hf_architecture.py  a Hugging Face config.json read into the model section (no torch)
    hf_moe.py           its mixture-of-experts fields, and the MoE architectures refused
    training.py         parallel, optimizer, lora, and the sft / rm / dpo stages
    rl.py               rl and its reward sources
    rollout.py          rollout: which engine generates
    sampling.py         sampling: how the policy samples (RL rollouts, RL and DPO evaluations)
    run.py              data, pipeline, checkpoint, resilience, logging, and the root Config
    recipe.py           load_config: YAML, `base:`, overrides, renamed keys, type checks, where each value came from
    resolved.py         the resolved config as YAML (print-config, <stage_dir>/config.yaml)
    reference.py        docs/config_reference.md generated from these dataclasses and their comments
    rules.py            validate: every section's check, then the rules across sections

`load_config(path, overrides)` returns a frozen Config (a variant is `dataclasses.replace`);
what a stage derives later (the vocabulary from its tokenizer, the architecture its start
checkpoint recorded) is returned beside it (trainers/stage_data.py: RunContext).
`validate(cfg, world_size)` runs before any model is built or process group made.
"""

from megatron_rlhf.config.errors import ConfigError
from megatron_rlhf.config.model import (
    ARCHITECTURE_FIELDS, DTYPES, MODEL_FAMILIES, MOE_ARCHITECTURE_FIELDS, MOE_FAMILIES, MOE_SCORE_FUNCTIONS,
    ROPE_SCALING_TYPES, ModelConfig, RopeScalingConfig,
)
from megatron_rlhf.config.recipe import from_dict, load_config, parse_overrides, read_recipe, rename_legacy_keys, yaml_problem
from megatron_rlhf.config.rl import (
    CRITIC_FIELDS, CRITIC_FREE, GROUP_BASELINES, IMPORTANCE_RATIOS, KL_CONTROLLERS, KL_ESTIMATORS, LOSS_AGGREGATIONS,
    REWARD_SOURCE_FIELDS, REWARD_SOURCE_TYPES, RL_ALGORITHMS, RewardSourceConfig, RLConfig, engine_returns_routes,
)
from megatron_rlhf.config.rollout import ROLLOUT_ENGINES, VLLM_CPU_HEAD_DIMS, RolloutConfig, check_vllm_cpu_model
from megatron_rlhf.config.resolved import config_yaml, write_resolved_config
from megatron_rlhf.config.rules import learning_rate_warnings, policy_start, validate, warnings_for
from megatron_rlhf.config.sampling import SamplingConfig
from megatron_rlhf.config.run import (
    DEFAULT_STAGES, OVERFLOW_POLICIES, STAGE_INPUTS, STAGES, CheckpointConfig, Config, DataConfig, LoggingConfig,
    PipelineConfig, RecipeFacts, ResilienceConfig,
)
from megatron_rlhf.config.training import (
    DPO_LOSSES, LORA_STAGES, LORA_TARGETS, LR_DECAY_STYLES, DPOConfig, LoRAConfig, OptimizerConfig, ParallelConfig,
    RMConfig, SFTConfig, StageConfig,
)

__all__ = [
    "ARCHITECTURE_FIELDS", "CRITIC_FIELDS", "CRITIC_FREE", "CheckpointConfig", "Config", "ConfigError", "DEFAULT_STAGES",
    "DPOConfig", "DPO_LOSSES", "DTYPES", "DataConfig", "GROUP_BASELINES", "IMPORTANCE_RATIOS", "KL_CONTROLLERS",
    "KL_ESTIMATORS", "LORA_STAGES", "LORA_TARGETS", "LOSS_AGGREGATIONS", "LR_DECAY_STYLES", "LoRAConfig",
    "LoggingConfig", "MODEL_FAMILIES", "MOE_ARCHITECTURE_FIELDS", "MOE_FAMILIES", "MOE_SCORE_FUNCTIONS", "ModelConfig",
    "OVERFLOW_POLICIES", "OptimizerConfig", "ParallelConfig", "PipelineConfig", "REWARD_SOURCE_FIELDS",
    "REWARD_SOURCE_TYPES", "RLConfig", "RL_ALGORITHMS", "RMConfig", "ROLLOUT_ENGINES", "ROPE_SCALING_TYPES", "RecipeFacts", "ResilienceConfig", "RewardSourceConfig", "RolloutConfig",
    "RopeScalingConfig", "SFTConfig", "STAGES", "SamplingConfig", "STAGE_INPUTS", "StageConfig", "VLLM_CPU_HEAD_DIMS",
    "check_vllm_cpu_model", "config_yaml", "engine_returns_routes", "from_dict", "load_config", "parse_overrides", "policy_start", "read_recipe",
    "rename_legacy_keys", "validate", "warnings_for", "learning_rate_warnings", "write_resolved_config", "yaml_problem",
]
