"""The RL stage's named records: its prompts (Prompts), what the generate phase returns (Generation, with its Rewards),
what one iteration produced (Iteration), and the trainer state the stage carries from
iteration to iteration and into its checkpoints (RLTrainerState)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from megatron_rlhf.algorithms.kl import AdaptiveKLController, FixedKLController
from megatron_rlhf.colocation import ColocationScheduler
from megatron_rlhf.data.encode import EncodedPrompt
from megatron_rlhf.logging.reward_hacking import RewardHackingAlarm
from megatron_rlhf.rollout import Rollout
from megatron_rlhf.rollout.batch import RolloutBatch
from megatron_rlhf.trainers.policy_eval import EvalResult


@dataclass
class Prompts:
    """The stage's prompts, encoded: the train prompts (and the encoder's report) and the held-out ones."""
    train: list[EncodedPrompt]
    report: Any
    eval: list[EncodedPrompt]


class Rewards(NamedTuple):
    """A rollout's rewards: [B] the combined reward of rl.rewards (missing-EOS penalty and
    clip applied) and each source's own [B] scores."""
    total: torch.Tensor
    per_source: dict[str, torch.Tensor]


@dataclass
class Generation:
    """The generate phase's result: this rank's rollout and each row's prompt; with dynamic
    sampling also their rewards (scored while choosing the groups; None: the score phase scores
    them), {"sampling_rounds", "sampling_shortfall"} ({}: dynamic sampling off) and `kept`: the
    indices of the rows kept among all the rows its rounds generated, in order ([quota * n] long
    on the rollout's device; None: one round, every row kept)."""
    rollout: Rollout
    rows: list[EncodedPrompt]
    rewards: Rewards | None = None
    sampling: dict = field(default_factory=dict)
    kept: torch.Tensor | None = None


@dataclass
class Iteration:
    """What one iteration produced: the score phase's batch and scores, then what the train
    phase made of them; iteration_metrics (rl_metrics.py) reads it."""
    rollout: Rollout
    batch: RolloutBatch                            # old/reference log-probs, scores, values; + advantages
    kl_stats: dict = field(default_factory=dict)   # add_advantages': this rank's KL sums (+ explained variance)
    sampling: dict = field(default_factory=dict)   # Generation.sampling
    per_source: dict = field(default_factory=dict)  # each reward source's [B] scores
    holdout: torch.Tensor | None = None            # [B] the holdout reward model's (clipped) scores, if any
    old_logprobs_recomputed: bool = True           # False: the rollout's own stood in (no mismatch measured)
    kl_coef: float = 0.0                           # the KL coefficient the train phase used
    trains_actor: bool = True                      # False during the critic's warm-up
    train_stats: dict = field(default_factory=dict)  # train_on_rollout's step means
    routing: dict = field(default_factory=dict)    # an MoE actor's routing vs the rollout's (measure_routing)


@dataclass
class RLTrainerState:
    """What the RL stage carries across iterations. `saved()` is its part of every checkpoint's
    trainer state (the runner adds the step, the samples consumed, the sampler and the guards),
    under the keys checkpoints have always had; `restore` reads them back."""
    kl: FixedKLController | AdaptiveKLController  # "kl_controller"
    alarm: RewardHackingAlarm         # "reward_hacking"
    phases: ColocationScheduler       # its wall-clock totals per phase: "wall_clock_phases"
    before: dict = field(default_factory=dict)  # the starting policy's evaluation: "before"
    samples_seen: int = 0             # responses trained on: the runner saves it as consumed_samples
    latest: EvalResult | None = None  # the policy's latest evaluation
    last_mismatch: dict = field(default_factory=dict)  # the last measured rollout-vs-trainer mismatch

    def saved(self) -> dict:
        return {"kl_controller": self.kl.state_dict(), "before": self.before,
                "reward_hacking": self.alarm.state_dict(), "wall_clock_phases": self.phases.state_dict()}

    def restore(self, state: dict) -> None:
        """From a resumed checkpoint's trainer state."""
        self.kl.load_state_dict(state["kl_controller"])
        for part, key in ((self.phases, "wall_clock_phases"), (self.alarm, "reward_hacking")):
            if key in state:  # not in checkpoints of older versions
                part.load_state_dict(state[key])
        # "before" means the SFT policy: a resumed run keeps the numbers its first start measured
        self.before = with_reward_names(state["before"])
        self.samples_seen = state.get("consumed_samples", 0)


# Names of the combined reward before it was called `reward` (it was the RM's name even
# without a reward model), as checkpoints of earlier versions hold them.
LEGACY_REWARD_NAMES = {"eval_rm_score": "eval_reward", "eval_win_rate_rm": "eval_win_rate_reward"}


def with_reward_names(before: dict) -> dict:
    """A resumed checkpoint's SFT-policy evaluation under the current names."""
    return {**before, "eval": {LEGACY_REWARD_NAMES.get(k, k): v for k, v in before["eval"].items()},
            "per_prompt": {"reward" if k == "rm" else k: v for k, v in (before.get("per_prompt") or {}).items()}}
