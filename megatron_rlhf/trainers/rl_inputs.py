"""The RL stage's start weights: the reference and reward model from their stages, and on a
fresh start the actor (SFT, or DPO) and the critic (rl.critic_from)."""

from __future__ import annotations

import torch

from megatron_rlhf.checkpoint.dist import load_extra_state, load_model_weights, load_role
from megatron_rlhf.checkpoint.manager import resolve_checkpoint
from megatron_rlhf.config import Config, ConfigError, RLConfig, policy_start
from megatron_rlhf.trainers.stage_data import stage_dir


def load_inputs(cfg: Config, roles: dict, fresh_start: bool) -> str:
    """Reference from SFT and reward model (if any) from RM; on a fresh start also the actor
    (from SFT) and the critic (rl.critic_from); a resumed run has them from its own checkpoint."""
    rl = cfg.rl
    policy_stage, given = policy_start(cfg)  # sft, or dpo when the pipeline runs it before rl
    sft = resolve_checkpoint(given or stage_dir(cfg, policy_stage), "rl.sft_from")
    rm = resolve_checkpoint(rl.rm_from or stage_dir(cfg, "rm"), "rl.rm_from") if rl.needs_rm_checkpoint else None
    if roles["reference"].shares_weights_of:  # LoRA: the actor's base, also on resume (the checkpoint holds adapters)
        load_model_weights(roles["actor"], sft / "actor")
    else:
        load_role(roles["reference"], sft / "actor", with_optimizer=False)
    if "reward" in roles:
        load_role(roles["reward"], rm / "reward", with_optimizer=False)
    if "holdout_reward" in roles:
        load_role(roles["holdout_reward"], resolve_checkpoint(stage_dir(cfg, "rm_holdout")) / "reward", with_optimizer=False)
    notes = [f"reference from {sft}", *([f"reward model from {rm}"] if "reward" in roles else [])]
    if fresh_start:
        if not roles["reference"].shares_weights_of:
            load_model_weights(roles["actor"], sft / "actor")
        notes[0] = f"actor/reference from {sft}"
        notes.append(load_critic(rl, roles, sft, rm) if "critic" in roles else f"no critic: rl.algorithm={rl.algorithm}")
    elif "critic" in roles and roles["critic"].lora is not None:  # its frozen base; the resumed checkpoint has the rest
        notes.append(load_critic(rl, roles, sft, rm, base_only=True))
    return ", ".join(notes)


def load_critic(rl: RLConfig, roles: dict, sft, rm, base_only: bool = False) -> str:
    """The critic's starting weights (rl.critic_from): the reward model with its normalisation
    folded into the value head, the SFT actor with a fresh value head, or a checkpoint's critic.
    base_only: a resumed LoRA critic's frozen weights only (its adapters and head are resumed)."""
    critic, start = roles["critic"], rl.critic_start
    what = "critic base" if base_only else "critic"
    if start == "rm":  # with or without a reward model role (a served RM: rl.rm_from, no model source)
        load_model_weights(critic, rm / "reward", base_only=base_only)  # value head starts as the reward head
        if not base_only:  # (a resumed head has the normalisation folded in already)
            normalization = load_extra_state(rm / "reward")
            fold_reward_normalization(critic, normalization.get("reward_mean", 0.0), normalization.get("reward_std", 1.0))
        return f"{what} from {rm}"
    if start == "sft":
        load_model_weights(critic, sft / "actor", skip_prefixes=("output_layer.",), base_only=base_only)
        return f"{what} from {sft}" + ("" if base_only else " (fresh value head)")
    source = resolve_checkpoint(start, "rl.critic_from")
    if not (source / "critic").is_dir():
        raise ConfigError(f"rl.critic_from={start}: {source} has no critic role (a ppo stage checkpoint has one); "
                          "for a reward model use rl.critic_from=rm (with rl.rm_from), for the SFT actor rl.critic_from=sft")
    load_model_weights(critic, source / "critic", base_only=base_only)
    return f"{what} from {source}"


@torch.no_grad()
def fold_reward_normalization(critic, reward_mean: float = 0.0, reward_std: float = 1.0) -> None:
    """The critic predicts returns in normalised reward units: fold the RM's (mean, std) into
    the value head it starts from, w' = w/std, b' = (b - mean)/std."""
    head = critic.module.output_layer if hasattr(critic.module, "output_layer") else None
    if head is not None:  # only the last pipeline stage holds the head
        head.weight.div_(reward_std)
        head.bias.sub_(reward_mean).div_(reward_std)
    critic.optimizer.reload_model_params()
