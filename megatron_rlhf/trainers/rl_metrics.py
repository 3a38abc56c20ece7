"""The RL stage's numbers: each iteration's metrics (from its Iteration record, one collective
over the data-parallel ranks), the stage's summary.json fields and its closing line."""

from __future__ import annotations

import torch

from megatron_rlhf import parallel
from megatron_rlhf.algorithms.stats import response_repetition_rate
from megatron_rlhf.config import Config, RLConfig
from megatron_rlhf.models.batching import data_parallel, padded_forward, padding_sums
from megatron_rlhf.models.roles import lora_summary
from megatron_rlhf.models.routing import expert_load, stage_summary
from megatron_rlhf.parallel.collectives import all_reduce, dp_group, dp_sum, dp_sums
from megatron_rlhf.trainers.policy_eval import decode_responses
from megatron_rlhf.trainers.rl_records import Iteration, RLTrainerState


# ----------------------------------------------------------------------------- per iteration
def iteration_sums(it: Iteration, gold: float, repetition: float, micro_batch_size: int = 1,
                   token_budget: int = 0, packed: bool = False) -> dict:
    """This rank's sums of the per-iteration metrics (device tensors, host numbers for the
    text-based ones: the gold scores and repetition rates of its responses); `dp_sums` adds
    them over data-parallel ranks. micro_batch_size, token_budget: the score phase's
    microbatches (packed: rl.packing), whose padding is measured."""
    rollout, batch, n = it.rollout, it.batch, len(it.rollout)
    return {
        "responses": n, "reward": batch.scores.sum(), "gold_score": gold,
        "response_length": rollout.response_lengths().sum(), "kl": it.kl_stats["kl"], "kl_tokens": it.kl_stats["kl_tokens"],
        **padding_sums(rollout.lengths, rollout.tokens.size(1), micro_batch_size, token_budget, packed),
        **({"logprob_mismatch": ((rollout.logprobs - batch.old_logprobs).abs() * batch.mask).sum()}
           if it.old_logprobs_recomputed else {}),
        **({"logprob_mismatch_without_replay": ((rollout.logprobs - it.routing["free_logprobs"]).abs() * batch.mask).sum()}
           if it.routing.get("free_logprobs") is not None else {}),
        "scored_tokens": batch.mask.sum(), "repetition_rate": repetition * n, **it.sampling,
        **({"holdout_rm_score": it.holdout.sum()} if it.holdout is not None else {}),
        **{f"reward_{name}": scores.sum() for name, scores in it.per_source.items()},
    }


def iteration_metrics(it: Iteration, tokenizer, task, rl: RLConfig) -> dict[str, float]:
    """The per-iteration means over every data-parallel rank (one collective); the dynamic
    sampling shortfall summed over ranks. reward: the combined reward (rl.rewards, clipped),
    whatever its sources; reward_<name>: each source's own mean score (reward_rm: the reward
    model's). The rollout-vs-trainer mismatch only when the old log-probs were recomputed."""
    rollout, batch = it.rollout, it.batch
    gold = sum(task.gold_score(p, r) for p, r in decode_responses(rollout, tokenizer)) if task else 0.0
    repetition = response_repetition_rate(rollout.response_ids())
    sums = dp_sums(iteration_sums(it, gold, repetition, rl.micro_batch_size, rl.micro_batch_tokens, rl.packing), parallel.device())
    n = sums["responses"]
    return {
        "responses": n, "reward": sums["reward"] / n, **({"gold_score": sums["gold_score"] / n} if task else {}),
        **{name: sums[name] / n for name in sorted(sums) if name.startswith("reward_")},
        **({"holdout_rm_score": sums["holdout_rm_score"] / n} if it.holdout is not None else {}),
        "kl_mean": sums["kl"] / n, "kl_per_token": sums["kl"] / max(sums["kl_tokens"], 1.0),
        "kl_coef": it.kl_coef,  # the coefficient this iteration used
        "response_length": sums["response_length"] / n, "repetition_rate": sums["repetition_rate"] / n,
        # rollout engine vs trainer: mean |log pi_rollout - log pi_old| per token, and the largest
        # token probability ratio between them, max(pi_old / pi_rollout, pi_rollout / pi_old)
        **({"logprob_mismatch_without_replay": sums["logprob_mismatch_without_replay"] / max(sums["scored_tokens"], 1.0)}
           if "logprob_mismatch_without_replay" in sums else {}),
        **routing_metrics(it),
        **({"logprob_mismatch": sums["logprob_mismatch"] / max(sums["scored_tokens"], 1.0),
            "mismatch_max_ratio": float(torch.exp(all_reduce(
                ((rollout.logprobs - batch.old_logprobs).abs() * batch.mask).max().reshape(1),
                op=torch.distributed.ReduceOp.MAX, group=dp_group())))} if it.old_logprobs_recomputed else {}),
        # padding: of the batch at its width, and of what the score phase's microbatches compute
        "padding_fraction": 1.0 - sums["real_tokens"] / sums["batch_slots"],
        "padding_fraction_computed": 1.0 - sums["real_tokens"] / sums["microbatch_slots"],
        **({"explained_variance": float(it.kl_stats["explained_variance"])} if "explained_variance" in it.kl_stats else {}),
        **({"sampling_rounds": sums["sampling_rounds"] / data_parallel()[1],  # every rank runs as many
            "sampling_shortfall": sums["sampling_shortfall"]} if it.sampling else {}),
    }


def measure_routing(rollout, actor, rl: RLConfig, replayed: bool) -> dict:
    """How the actor routes the rollout's tokens by itself: per layer, the tokens whose top-k
    set differs from the rollout's (counted by score's actor forward when it routed freely);
    with replay, one more forward that routes freely, whose log-probs measure the mismatch
    replay removed. Read by routing_metrics."""
    free = None
    if replayed:
        seqs = {"tokens": rollout.tokens, "lengths": rollout.lengths, "routes": rollout.routes}
        free = padded_forward(actor, seqs, rl.micro_batch_size, rl.micro_batch_tokens, compare_routes=True)["logprobs"]
    return {**actor.routes.take_disagreement(actor.module.config.sequence_parallel), "free_logprobs": free,
            "num_experts": actor.routes.num_experts, "replayed": replayed}


def routing_metrics(it: Iteration) -> dict[str, float]:
    """An MoE actor's routing this iteration (every data-parallel rank, every MoE layer of
    every pipeline stage; collective): routing_disagreement_mean / _max, over layers, of the
    fraction of the rollout's tokens whose top-k expert set the trainer's own routing changes
    (what routing replay removes); expert_load_imbalance_mean / _max, over layers, of the
    busiest expert's tokens over the mean expert's in the rollout's routes (1 = balanced;
    with replay, the train phase's load too). {} without routes."""
    routing = it.routing
    if not routing:
        return {}
    differing = routing["differing"] / routing["compared"].clamp(min=1)
    disagreement_mean, disagreement_max = stage_summary(differing)
    load = dp_sum(expert_load(it.rollout.routes, routing["num_experts"]))  # [layers, experts]
    imbalance = load.max(dim=1).values / load.mean(dim=1).clamp(min=1e-9) if load.numel() else load.sum(1)
    imbalance_mean, imbalance_max = stage_summary(imbalance)
    return {"routing_replay": float(routing["replayed"]), "routing_disagreement_mean": disagreement_mean,
            "routing_disagreement_max": disagreement_max, "expert_load_imbalance_mean": imbalance_mean,
            "expert_load_imbalance_max": imbalance_max}


# ----------------------------------------------------------------------------- the stage's end
def rl_summary(cfg: Config, state: RLTrainerState, metrics: dict, roles: dict, data_sources) -> dict:
    """summary.json's RL fields: `metrics` the last iteration's (its mismatch the last measured)."""
    rl, before, eval_metrics, samples_logged = cfg.rl, state.before, state.latest.metrics, cfg.sampling.eval_samples_logged
    phases = state.phases.summary()
    return {
        "algorithm": rl.algorithm, "roles": sorted(roles), "data_sources": data_sources,
        # LoRA: which roles train adapters (rank, alpha, targets) and on which base checkpoint
        "lora": lora_summary(roles),
        # what the reward is made of, and each source's mean score in the last iteration
        "reward_sources": [{"name": src.label, "type": src.type, "weight": src.weight,
                            "source": {"model": rl.rm_from or "<run>/rm", "function": src.function, "http": src.url,
                                       "environment": rl.environment.class_path or rl.environment.url}[src.type],
                            "score_final": metrics.get(f"reward_{src.label}")} for src in rl.rewards],
        # the final policy against the SFT policy on the held-out prompts (null: not measured)
        **{f"win_rate_{judge}_final": eval_metrics.get(f"eval_win_rate_{judge}")
           for judge in ("reward", "gold", "holdout_rm")},
        "reward_hacking_alarms": state.alarm.alarms,
        # null without a gold scorer (data.task: null)
        "gold_score_eval_before": before["eval"].get("eval_gold_score"),
        "gold_score_eval_after": eval_metrics.get("eval_gold_score"),
        # the combined reward of rl.rewards (rm_* names are the reward model's alone)
        "reward_eval_before": before["eval"]["eval_reward"], "reward_eval_after": eval_metrics["eval_reward"],
        "kl_mean_final": metrics.get("kl_mean"), "kl_coef_final": state.kl.value,
        "samples_per_second": state.samples_seen / max(sum(v["seconds"] for p, v in phases.items() if p != "eval"), 1e-9),
        # the rollout engine: in place (megatron) or separate (vllm: refit each iteration, "sync" phase)
        "rollout_engine": cfg.rollout.engine, "logprob_mismatch_final": metrics.get("logprob_mismatch"),
        "mismatch_max_ratio_final": metrics.get("mismatch_max_ratio"),
        "refit_seconds_final": metrics.get("refit_seconds"), "refit_bytes_per_s_final": metrics.get("refit_bytes_per_s"),
        # the whole run, across restarts (the totals travel in the checkpoint)
        "phase_seconds": {p: v["seconds"] for p, v in phases.items()},
        "phase_calls": {p: v["calls"] for p, v in phases.items()},
        "phase_peak_memory_bytes": {p: v["peak_memory_bytes"] for p, v in phases.items()},
        "phase_tokens_per_s": {p: v["tokens_per_s"] for p, v in phases.items()},
        "samples_before": before["samples"][:samples_logged],
        "samples_after": state.latest.samples[:samples_logged],
    }


def format_scores(metrics: dict) -> str:
    return ", ".join(f"{k.removeprefix('eval_')} {v:.3f}" for k, v in metrics.items())


def done_message(before: dict, after: dict) -> str:
    gold = ("no gold scorer" if after.get("eval_gold_score") is None else
            f"gold {before['eval_gold_score']:.3f} -> {after['eval_gold_score']:.3f}")
    wins = ", ".join(f"{k.removeprefix('eval_win_rate_')} {v:.2f}" for k, v in after.items() if k.startswith("eval_win_rate_"))
    return (f"done: {gold}, reward {before['eval_reward']:.3f} -> {after['eval_reward']:.3f}"
            + (f"; win rate against the SFT policy: {wins}" if wins else ""))
