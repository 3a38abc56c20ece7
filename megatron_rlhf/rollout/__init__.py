"""Rollout engines: generate responses to prompts with the actor's current weights."""

from megatron_rlhf.rollout.base import Rollout, RolloutEngine, SamplingParams, sample_next
from megatron_rlhf.rollout.megatron_engine import MegatronRolloutEngine

__all__ = ["Rollout", "RolloutEngine", "SamplingParams", "MegatronRolloutEngine", "make_engine", "sample_next"]


def make_engine(cfg, actor, eos_id: int, pad_id: int, workdir) -> RolloutEngine:
    """The engine rollout.engine names: in place (megatron) or vLLM (rollout/vllm_engine.py)."""
    if cfg.rollout.engine == "megatron":
        return MegatronRolloutEngine(actor, eos_id=eos_id, pad_id=pad_id)
    from megatron_rlhf.rollout.vllm_engine import VLLMRolloutEngine  # imports vLLM: only when asked for

    return VLLMRolloutEngine(actor, cfg, eos_id, pad_id, workdir)
