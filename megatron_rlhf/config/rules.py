"""The rules that involve more than one section, and `validate(cfg, world_size)`, which runs
every section's own `check` and then these, before any model is built or process group made."""

from __future__ import annotations

from typing import Any

from megatron_rlhf.config.errors import ConfigError
from megatron_rlhf.config.rl import RL_ALGORITHMS, engine_returns_routes
from megatron_rlhf.config.run import STAGE_INPUTS, STAGES, Config


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Every section's own rules, then those across sections; `world_size`: the processes the
    run is launched with (None: one data-parallel replica). Raises ConfigError naming the field."""
    m = cfg.model
    m.check()
    dp = cfg.parallel.check(m, world_size)
    cfg.data.check()
    for name in ("sft", "rm", "dpo"):
        getattr(cfg, name).check(name, m, dp)
    cfg.dpo.check_loss()
    for name in ("optimizer", "sft.optimizer", "rm.optimizer", "dpo.optimizer", "rl.actor_optimizer",
                 "rl.critic_optimizer"):
        _get_dotted(cfg, name).check(name)
    cfg.sampling.check(m)
    cfg.rl.check(m, dp, cfg.given, cfg.sampling)
    cfg.rollout.check(m, cfg.parallel)
    cfg.lora.check()
    if cfg.lora.applies_to("sft") and not (cfg.sft.init_from or m.init_from_hf):
        raise ConfigError("lora.stages has sft: adapters train on a pretrained model, and sft would start from a "
                          "fresh initialisation; set sft.init_from=<a checkpoint with an actor: an earlier stage, "
                          "import-hf's output> or model.init_from_hf=<a Hugging Face directory>, or remove sft")
    if cfg.lora.rank > 0 and m.num_experts is not None and {"fc1", "fc2"} & set(cfg.lora.targets):
        raise ConfigError(f"lora.targets={cfg.lora.targets} with model.num_experts={m.num_experts}: adapters on the "
                          "expert MLPs are not built yet; keep lora.targets to qkv, proj and output for an MoE model")
    if cfg.lora.rank > 0 and "output" in cfg.lora.targets and m.share_embeddings_and_output_weights:
        raise ConfigError("lora.targets has output with model.share_embeddings_and_output_weights=true: an adapter on "
                          "a tied LM head would change the input embedding's twin only; remove output from lora.targets")
    if cfg.rl.reuse_rollout_logprobs and cfg.rollout.engine != "megatron":
        raise ConfigError(f"rl.reuse_rollout_logprobs=true with rollout.engine={cfg.rollout.engine}: only the in-place "
                          "megatron engine samples with the actor's own weights and softmax; a separate engine's "
                          "log-probs are not pi_old. Set rl.reuse_rollout_logprobs=false or rollout.engine=megatron")
    if cfg.rl.max_staleness and cfg.rollout.engine != "vllm":
        raise ConfigError(f"rl.max_staleness={cfg.rl.max_staleness} with rollout.engine={cfg.rollout.engine}: the "
                          "in-place engine samples with the actor's own weights in the trainer's process, so it "
                          "cannot run ahead of training; set rollout.engine=vllm or rl.max_staleness=0")
    if cfg.rollout.engine_cpus and cfg.rollout.engine != "vllm":
        raise ConfigError(f"rollout.engine_cpus={list(cfg.rollout.engine_cpus)} with rollout.engine="
                          f"{cfg.rollout.engine}: only the vLLM engine runs in a process of its own to pin; "
                          "remove rollout.engine_cpus or set rollout.engine=vllm")
    if cfg.parallel.context_parallel > 1 and cfg.rollout.engine == "megatron" and "rl" in cfg.pipeline.stages:
        raise ConfigError(f"parallel.context_parallel={cfg.parallel.context_parallel} with rollout.engine=megatron: "
                          "the in-place engine decodes on the training layout, and megatron's inference has no "
                          "context parallelism; set rollout.engine=vllm for context-parallel RL")
    # rl.routing_replay=rollout with vLLM on a machine without CUDA: refused when the engine starts
    # (VLLMRolloutEngine), not here, where a GPU job is often validated on a login node without one
    check_pipeline(cfg)
    cfg.checkpoint.check()
    cfg.resilience.check()
    cfg.logging.check()
    return cfg


def _get_dotted(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def policy_start(cfg: Config) -> tuple[str, str | None]:
    """Where the RL stage's actor and reference start: (stage name, rl.sft_from or None for
    <run>/<stage>): dpo when pipeline.stages runs dpo before rl, else sft."""
    stages = cfg.pipeline.stages
    after_dpo = "dpo" in stages and "rl" in stages and stages.index("dpo") < stages.index("rl")
    return ("dpo" if after_dpo else "sft"), cfg.rl.sft_from


def check_pipeline(cfg: Config) -> None:
    """pipeline.stages and pipeline.rerun against what each stage starts from."""
    stages = cfg.pipeline.stages
    for name in stages:
        if name not in STAGES:
            hint = " (the RL stage is rl; its algorithm is rl.algorithm)" if name in RL_ALGORITHMS else ""
            raise ConfigError(f"pipeline.stages: unknown stage {name!r}{hint}; choose from {STAGES}")
    if len(set(stages)) != len(stages) or not stages:
        raise ConfigError(f"pipeline.stages={stages}: list each stage once, at least one")
    for i, name in enumerate(stages):
        for needed, field_name in STAGE_INPUTS.get(name, {}).items():
            if name == "rl" and needed == "rm" and not cfg.rl.needs_rm_checkpoint:
                continue  # no reward model source and the critic does not start from one
            if name == "dpo" and cfg.model.init_from_hf:
                continue  # starts from the Hugging Face weights
            if needed not in stages[:i] and _get_dotted(cfg, field_name) is None:
                raise ConfigError(f"pipeline.stages={stages}: {name} starts from a {needed} checkpoint; put {needed} "
                                  f"before {name} or set {field_name} to an existing {needed} stage directory")
    if stray := [name for name in cfg.pipeline.rerun if name not in stages]:
        hint = " (the RL stage is rl)" if any(name in RL_ALGORITHMS for name in stray) else ""
        raise ConfigError(f"pipeline.rerun={cfg.pipeline.rerun}: {stray} not in pipeline.stages={stages}{hint}; "
                          "name stages of this pipeline, e.g. pipeline.rerun=[" + ",".join(stages[:1]) + "]")


# The highest learning rate a pretrained model is usually fine-tuned with: full fine-tuning of small
# chat models runs at 1e-6 (RL, DPO) to 5e-5 (SFT); LoRA's adapters take ~10x. Training from
# scratch, as the tiny recipes do, runs at 1e-3 and more, which wrecks pretrained weights in steps.
FINE_TUNING_MAX_LR = 1e-4
LORA_FINE_TUNING_MAX_LR = 2e-3


def learning_rate_warnings(cfg: Config, stages) -> list[str]:
    """Learning rates of `stages` meant for training from scratch in a run that starts from a
    pretrained model (model.init_from_hf): said at the launcher's pre-flight and at each stage's
    start, since the run itself goes on without complaint while the loss climbs."""
    if not cfg.model.init_from_hf:
        return []
    optimizers = {"sft": [("sft.optimizer", cfg.sft.optimizer)], "rm": [("rm.optimizer", cfg.rm.optimizer)],
                  "dpo": [("dpo.optimizer", cfg.dpo.optimizer)],
                  "rl": [("rl.actor_optimizer", cfg.rl.actor_optimizer), ("rl.critic_optimizer", cfg.rl.critic_optimizer)]}
    notes = []
    for stage in stages:
        bound = LORA_FINE_TUNING_MAX_LR if cfg.lora.applies_to(stage) else FINE_TUNING_MAX_LR
        for name, optimizer in optimizers.get(stage, []):
            if optimizer.lr > bound:
                notes.append(f"{name}.lr={optimizer.lr:g} with model.init_from_hf={cfg.model.init_from_hf}: a learning "
                             f"rate for training from scratch; fine-tuning a pretrained model takes <= {bound:g} "
                             "(typically 1e-6 to 5e-5: pipelines/hf_small_cpu.yaml), a higher one can wreck it in a "
                             "few steps; lower it unless you mean to")
    return notes


def warnings_for(cfg: Config) -> list[str]:
    """Settings that run but are probably not what the user wants; stages log them at start-up."""
    notes = list(cfg.notes)
    p = cfg.rl
    if p.max_staleness and not p.corrects_mismatch:
        notes.append(f"rl.max_staleness={p.max_staleness} without rl.tis_cap or rl.mismatch_mask_threshold: batches "
                     "generated by an older policy are trained without an importance weight for the gap (the PPO "
                     "ratio is against the recomputed policy only); set rl.tis_cap=2 (decoupled PPO)")
    if p.kl_in_reward and p.kl_estimator in ("k2", "k3"):
        notes.append(
            f"rl.kl_estimator={p.kl_estimator} with rl.kl_in_reward=true: a reward cannot carry the gradient of "
            f"an estimator that depends on the policy, so the policy gradient of the KL penalty is biased; k1 is "
            f"the unbiased choice in the reward ({p.kl_estimator} belongs in the loss: rl.kl_in_reward=false)")
    if p.importance_ratio == "sequence" and p.loss_aggregation != "seq_mean_token_mean":
        notes.append(
            f"rl.importance_ratio=sequence with rl.loss_aggregation={p.loss_aggregation}: GSPO's objective weighs "
            "every sequence the same (rl.loss_aggregation=seq_mean_token_mean); here tokens of long responses "
            "weigh more")
    if "rl.max_sampling_rounds" in cfg.given and not p.dynamic_sampling:
        notes.append("rl.max_sampling_rounds is set but rl.dynamic_sampling=false: one generation round per iteration")
    if cfg.model.num_experts is not None and not engine_returns_routes(cfg.rollout.engine) and \
            p.routing_replay_mode == "auto":
        notes.append(f"rollout.engine={cfg.rollout.engine} with an MoE model on vLLM's CPU platform: no routing replay "
                     "(vLLM returns its routes only through its V2 model runner, which needs CUDA), so the trainer "
                     "routes for itself; the routing metrics are not logged either. rollout.engine=megatron records "
                     "and replays them, and so does vLLM on GPU (docs/routing_replay.md)")
    return notes
