"""Metrics out of a run: TensorBoard event files, metrics.jsonl, console progress."""

from megatron_rlhf.logging.metrics import MetricsLogger

__all__ = ["MetricsLogger"]
