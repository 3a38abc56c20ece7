"""megatron_rlhf: PPO-RLHF (SFT -> reward model -> PPO) on megatron-core."""

__version__ = "0.1.0"
