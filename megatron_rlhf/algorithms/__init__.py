"""RL algorithm math as pure tensor functions (no distributed code, no I/O)."""
