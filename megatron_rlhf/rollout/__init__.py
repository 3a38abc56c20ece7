"""Rollout engines: generate responses to prompts with the actor's current weights."""

from megatron_rlhf.config import ModelConfig, RolloutConfig
from megatron_rlhf.rollout.base import Rollout, RolloutEngine, SamplingParams, sample_next
from megatron_rlhf.rollout.megatron_engine import MegatronRolloutEngine

__all__ = ["Rollout", "RolloutEngine", "SamplingParams", "MegatronRolloutEngine", "make_engine", "sample_next"]


def make_engine(rollout: RolloutConfig, model: ModelConfig, actor, eos_id: int, pad_id: int, workdir, *, seed: int,
                verbose: bool = False, routes: bool | None = None) -> RolloutEngine:
    """The engine `rollout.engine` names for `actor` (a model of section `model`): in place
    (megatron) or vLLM (rollout/vllm_engine.py; seeded with the run's `seed`, its log shown
    when `verbose`; `routes`: whether it returns an MoE actor's routes, None: whenever it can)."""
    if rollout.engine == "megatron":
        return MegatronRolloutEngine(model, actor, eos_id=eos_id, pad_id=pad_id)
    from megatron_rlhf.rollout.vllm_engine import VLLMRolloutEngine  # imports vLLM: only when asked for

    return VLLMRolloutEngine(rollout, model, actor, eos_id, pad_id, workdir, seed=seed, verbose=verbose, routes=routes)
