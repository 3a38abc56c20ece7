"""Rollout engines: generate responses to prompts with the actor's current weights."""

from megatron_rlhf.rollout.base import Rollout, RolloutEngine, SamplingParams, sample_next
from megatron_rlhf.rollout.megatron_engine import MegatronRolloutEngine

__all__ = ["Rollout", "RolloutEngine", "SamplingParams", "MegatronRolloutEngine", "sample_next"]
