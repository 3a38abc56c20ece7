"""Surviving preemption and failures: signal-driven checkpoint-and-exit for requeue."""
