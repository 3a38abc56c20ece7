"""Distributed checkpoints (megatron-core dist_checkpointing, torch_dist format)."""
