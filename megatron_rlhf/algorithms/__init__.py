"""RL math as pure tensor functions (torch only, no megatron): stats.py (masked moments,
whitening), kl.py (KL estimators and controllers), advantages.py (one estimator per
algorithm), losses.py (policy and value losses, global-batch aggregation)."""
