"""The policy's evaluation on held-out prompts, shared by the RL and DPO stages: sample a response
to every prompt (sharded over data-parallel ranks) with the sampling settings given, score them
with each judge and the task's gold scorer, and compare with the starting policy's scores.

    evaluate = PolicyEvaluation(engine, judges, tokenizer, task, prompts, sampling, cfg.seed + EVAL_SEED_OFFSET)
    start = evaluate()                                # the starting policy
    later = evaluate(sft=start.before()["per_prompt"])   # + win rates against it
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from megatron_rlhf.data.encode import EncodedPrompt
from megatron_rlhf.models.batching import data_parallel
from megatron_rlhf.parallel.collectives import dp_sum
from megatron_rlhf.rollout import Rollout, SamplingParams
from megatron_rlhf.rollout.episodes import sample_rows

# The eval's sampling seed, cfg.seed + this: the RL stage and the DPO stage's gold eval both use
# it, so both stages score the same policy with the same samples.
EVAL_SEED_OFFSET = 17

# name -> judge(rollout, rows) -> [B] scores of this rank's rows
Judge = Callable[[Rollout, list[EncodedPrompt]], torch.Tensor]


@dataclass
class EvalResult:
    """One evaluation of the policy."""
    metrics: dict[str, float]              # eval_<judge_metric>: mean scores; eval_win_rate_<judge> with `sft`;
                                           # eval_env_*: multi-turn episodes' statistics
    samples: list[str]                     # "prompt || response" of this rank's prompts
    response_tokens: int                   # this rank's response tokens
    per_prompt: dict[str, list[float]]     # each judge's score of every prompt (every rank has all)

    def before(self) -> dict:
        """The starting policy's evaluation as a stage's checkpoints keep it ("before")."""
        return {"eval": self.metrics, "samples": self.samples, "per_prompt": self.per_prompt}


def evaluate(engine, judges: dict[str, Judge], tokenizer, task, prompts: list[EncodedPrompt],
             sampling: SamplingParams, seed: int, sft: dict | None = None) -> EvalResult:
    """Responses to the held-out prompts (sharded over DP ranks), scored by each judge
    (name -> judge(rollout, rows) -> [B] scores: the reward of rl.rewards, the holdout RM if
    any) and the gold scorer if any. The mean scores; with `sft`, the SFT policy's per-prompt
    scores, the win rate against it (a tie counts half); the per-prompt scores (every rank gets
    all of them); samples; response tokens."""
    rank, size = data_parallel()
    rows = prompts[rank::size]
    rollout = sample_rows(engine, rows, sampling, seed)
    # multi-turn episodes: rl.max_failed_episodes holds for the eval too; their eval_env_* statistics
    episodes = engine.check_evaluation() if hasattr(engine, "check_evaluation") else {}
    texts = decode_responses(rollout, tokenizer)
    mine = {name: judge(rollout, rows) for name, judge in judges.items()}
    if task:
        mine["gold"] = torch.tensor([task.gold_score(p, r) for p, r in texts], device=rollout.tokens.device)
    device = rollout.tokens.device
    per_prompt = {}
    for name, scores in mine.items():  # this rank's prompts in their places, zeros elsewhere: one sum fills all
        full = torch.zeros(len(prompts), device=device, dtype=torch.float64)
        full[rank::size] = scores.to(torch.float64)
        per_prompt[name] = dp_sum(full)
    metrics = {f"eval_{judge_metric(name)}": float(v.mean()) for name, v in per_prompt.items()} | episodes
    for name, v in per_prompt.items():
        if sft and name in sft:
            before = torch.tensor(sft[name], device=device, dtype=torch.float64)
            metrics[f"eval_win_rate_{name}"] = float(((v > before).double() + 0.5 * (v == before).double()).mean())
    samples = [f"{p} || {r}" for p, r in texts]
    return EvalResult(metrics, samples, int(rollout.response_lengths().sum()),
                      {k: v.tolist() for k, v in per_prompt.items()})


@dataclass
class PolicyEvaluation:
    """`evaluate` with a stage's fixed inputs: call it for the policy's current scores."""
    engine: Any
    judges: dict[str, Judge]
    tokenizer: Any
    task: Any                      # the built-in task (its gold scorer), or None
    prompts: list[EncodedPrompt]   # the held-out prompts, all of them
    sampling: SamplingParams
    seed: int

    def __call__(self, sft: dict | None = None) -> EvalResult:
        return evaluate(self.engine, self.judges, self.tokenizer, self.task, self.prompts, self.sampling, self.seed,
                        sft=sft)


def judge_metric(judge: str) -> str:
    """The per-iteration metric whose eval_ version holds a judge's mean score: `reward` for the
    combined reward of rl.rewards (whatever its sources), <judge>_score for a single scorer."""
    return "reward" if judge == "reward" else f"{judge}_score"


def decode_responses(rollout: Rollout, tokenizer) -> list[tuple[str, str]]:
    """(prompt, response) texts of the rollout's rows."""
    prompts = [row[:p] for row, p in zip(rollout.tokens.tolist(), rollout.prompt_lengths.tolist())]  # one host copy
    return [(tokenizer.decode(p), tokenizer.decode(r)) for p, r in zip(prompts, rollout.response_ids())]
