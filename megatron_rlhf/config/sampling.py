"""How the policy samples: the RL stage's rollouts and the evaluation generations of the RL and
DPO stages (one section, so that DPO's eval samples as the RL stage does and both compare)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rlhf.config.errors import ConfigError
from megatron_rlhf.config.model import ModelConfig

# The fields that lived in the rl section before this one (still read there, with a note).
MOVED_FROM_RL = ("max_new_tokens", "temperature", "top_k", "top_p", "eval_samples_logged")


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 12         # longest generated response (tokens)
    # Also the temperature of the RL stage's recomputed log-probs (actor and reference).
    temperature: float = 1.0
    # Must stay 0 / 1.0: every log-prob of the RL stage (rollout, old, new, reference) is computed
    # under the full softmax, so a filtered sampler would make the rollout off-policy.
    top_k: int = 0
    top_p: float = 1.0               # nucleus sampling: must stay 1.0 (see top_k)
    # Sampled responses written to the log and the summary at each evaluation.
    eval_samples_logged: int = 3

    def check(self, m: ModelConfig) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"sampling.max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.max_new_tokens > m.max_seq_length - 2:  # encode_prompts needs room for >= 2 prompt tokens
            raise ConfigError(f"sampling.max_new_tokens={self.max_new_tokens}: leaves no room for a prompt in "
                              f"model.max_seq_length={m.max_seq_length}; at most {m.max_seq_length - 2}")
        if self.temperature <= 0:
            raise ConfigError(f"sampling.temperature={self.temperature}: must be > 0")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ConfigError(f"sampling.top_p={self.top_p}, sampling.top_k={self.top_k}: need 0 < top_p <= 1 and "
                              "top_k >= 0")
        if self.top_k != 0 or self.top_p != 1.0:
            raise ConfigError(
                f"sampling.top_k={self.top_k}, sampling.top_p={self.top_p}: The RL stage computes every log-prob "
                "(rollout, old, new, reference) under the full softmax, so sampling from a top-k/top-p filtered "
                "distribution would make the rollout off-policy and bias the KL; set sampling.top_k=0 and "
                "sampling.top_p=1.0 (use sampling.temperature to sharpen or flatten sampling)")
        if self.eval_samples_logged < 0:
            raise ConfigError(f"sampling.eval_samples_logged={self.eval_samples_logged}: must be >= 0")
