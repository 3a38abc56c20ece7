"""PPO-RLHF: four colocated Megatron roles, time-shared phase by phase.

    python -m megatron_rlhf ppo --config pipelines/tiny_cpu.yaml [key=value ...]

Actor and reference start from the SFT checkpoint, reward model and critic from the RM
checkpoint. Each iteration: generate (actor samples) -> score (old/ref log-probs, RM score,
values) -> advantages (token rewards, GAE) -> train (PPO epochs x minibatches for actor and
critic). The math is in algorithms/ppo.py; this file only wires it. Writes <run>/ppo/.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from megatron_rlhf import parallel
from megatron_rlhf.algorithms import ppo as alg
from megatron_rlhf.checkpoint.dist import load_model_weights, load_role
from megatron_rlhf.checkpoint.manager import CheckpointManager, resolve_checkpoint
from megatron_rlhf.colocation import ColocationScheduler
from megatron_rlhf.config import Config, PPOConfig, warnings_for
from megatron_rlhf.data.encode import encode_prompts
from megatron_rlhf.data.sampler import EpochSampler
from megatron_rlhf.logging import MetricsLogger
from megatron_rlhf.models.roles import Actor, Critic, Reference, RewardModel
from megatron_rlhf.parallel.collectives import dp_sums, masked_moments
from megatron_rlhf.resilience.faults import FAULTS
from megatron_rlhf.resilience.heartbeat import Heartbeat
from megatron_rlhf.resilience.preemption import PreemptionHandler
from megatron_rlhf.rollout import MegatronRolloutEngine, Rollout, SamplingParams
from megatron_rlhf.trainers.common import (
    checkpoint_if_due, data_parallel, dp_slice, load_stage_data, padded_forward, resume,
    skipped_steps, stage_dir, trainer_state, write_summary,
)


# ----------------------------------------------------------------------------- layout
def response_slice(x: torch.Tensor, prompt_lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B, S] in sequence layout (position t predicts token t+1) -> [B, width] response layout
    (column j is response token j)."""
    idx = (prompt_lengths[:, None] - 1 + torch.arange(width, device=x.device)).clamp(max=x.size(1) - 1)
    return x.gather(1, idx)


def response_unslice(y: torch.Tensor, prompt_lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    out = torch.zeros(y.size(0), seq_len + y.size(1), dtype=y.dtype, device=y.device)
    idx = prompt_lengths[:, None] - 1 + torch.arange(y.size(1), device=y.device)
    return out.scatter(1, idx, y)[:, :seq_len]


# ----------------------------------------------------------------------------- phases
def score(rollout: Rollout, roles: dict, ppo: PPOConfig, micro: int) -> dict[str, torch.Tensor]:
    """Everything the train phase needs, in sequence layout, from one forward of each role."""
    seqs = {"tokens": rollout.tokens, "lengths": rollout.lengths}
    return assemble_batch(
        rollout, padded_forward(roles["actor"], seqs, micro),
        ref_logprobs=padded_forward(roles["reference"], seqs, micro)["logprobs"],
        values=padded_forward(roles["critic"], seqs, micro)["values"],
        scores=padded_forward(roles["reward"], seqs, micro)["rewards"], ppo=ppo)


def assemble_batch(rollout: Rollout, actor_out: dict, ref_logprobs: torch.Tensor, values: torch.Tensor,
                   scores: torch.Tensor, ppo: PPOConfig) -> dict[str, torch.Tensor]:
    """The role outputs and the rollout as the train phase's batch (all on the roles' device)."""
    mask = rollout.response_mask()
    if ppo.missing_eos_penalty is not None:
        scores = torch.where(rollout.finished, scores, torch.full_like(scores, ppo.missing_eos_penalty))
    return {
        "tokens": rollout.tokens, "lengths": rollout.lengths, "prompt_lengths": rollout.prompt_lengths,
        "mask": mask, "old_logprobs": actor_out["logprobs"] * mask, "entropy": actor_out["entropy"],
        "ref_logprobs": ref_logprobs * mask, "old_values": values * mask,
        "scores": scores.clamp(-ppo.reward_clip, ppo.reward_clip),
    }


def add_advantages(batch: dict, ppo: PPOConfig, kl_coef: float) -> dict[str, torch.Tensor]:
    """Token rewards -> GAE -> (whitened) advantages and returns, added to `batch`. Returns
    this rank's KL sums and the explained variance of the values over all data-parallel ranks."""
    plen, seq_len = batch["prompt_lengths"], batch["tokens"].size(1)
    width = ppo.max_new_tokens  # the longest response possible: no host sync for the real one
    mask = (torch.arange(width, device=plen.device) < (batch["lengths"] - plen)[:, None]).float()
    resp = partial(response_slice, prompt_lengths=plen, width=width)
    kl = alg.kl_estimate(resp(batch["old_logprobs"]), resp(batch["ref_logprobs"]), ppo.kl_estimator, ppo.kl_clip) * mask
    rewards = alg.token_rewards(kl if ppo.kl_in_reward else torch.zeros_like(kl), batch["scores"], mask, kl_coef)
    values = resp(batch["old_values"]) * mask
    advantages, returns = alg.gae(rewards, values, mask, ppo.gamma, ppo.lam)
    if ppo.whiten_advantages:  # over the global batch: moments of every data-parallel rank
        _, mean, var = masked_moments(advantages, mask)
        advantages = alg.whiten(advantages, mask, mean, var)
    batch["advantages"] = response_unslice(advantages, plen, seq_len)
    batch["returns"] = response_unslice(returns, plen, seq_len)
    _, _, var_returns = masked_moments(returns, mask)
    _, _, var_residual = masked_moments(returns - values, mask)
    return {"kl": kl.sum(), "kl_tokens": mask.sum(),
            "explained_variance": alg.explained_variance(var_residual, var_returns)}


def actor_loss(outputs: dict, mb: dict, ppo: PPOConfig, kl_coef: float):
    """Clipped policy loss - c2 * entropy (+ kl_coef * KL when the KL is in the loss), as
    (sum, units, stats) over ppo.loss_aggregation's unit (see models/roles.py: LossFn)."""
    mask, logprobs = mb["mask"], outputs["logprobs"]
    agg = partial(alg.aggregate, mask=mask, mode=ppo.loss_aggregation)
    policy, clipped = alg.policy_loss(logprobs, mb["old_logprobs"], mb["advantages"], ppo.clip_eps)
    objective = policy - ppo.entropy_coef * outputs["entropy"]
    if not ppo.kl_in_reward:
        objective = objective + kl_coef * alg.kl_estimate(logprobs, mb["ref_logprobs"], ppo.kl_estimator, ppo.kl_clip)
    loss, units = agg(objective)
    log_ratio = (logprobs - mb["old_logprobs"]).detach()
    stats = {"policy_loss": agg(policy.detach())[0], "entropy": agg(outputs["entropy"].detach())[0],
             "clip_fraction": agg(clipped.float())[0], "approx_kl": agg(0.5 * log_ratio**2)[0],
             "ratio_mean": agg(log_ratio.exp())[0]}
    return loss, units, stats


def critic_loss(outputs: dict, mb: dict, ppo: PPOConfig):
    per_token, clipped = alg.value_loss(outputs["values"], mb["old_values"], mb["returns"], ppo.value_clip)
    agg = partial(alg.aggregate, mask=mb["mask"], mode=ppo.loss_aggregation)
    loss, units = agg(ppo.vf_coef * per_token)
    return loss, units, {"value_loss": agg(per_token.detach())[0], "value_clip_fraction": agg(clipped.float())[0]}


def train_on_rollout(actor, critic, batch: dict, ppo: PPOConfig, kl_coef: float, train_actor: bool,
                     seed: int) -> dict[str, float]:
    """PPO epochs x minibatches, reshuffled every epoch; returns the mean of each statistic."""
    _, dp = data_parallel()
    rows, mini = batch["tokens"].size(0), ppo.mini_batch_size // dp
    generator = torch.Generator().manual_seed(seed)
    trained: dict[str, list[float]] = {}
    for _ in range(ppo.ppo_epochs):
        order = torch.randperm(rows, generator=generator).to(batch["tokens"].device)
        for start in range(0, rows, mini):
            mb = {k: v[order[start : start + mini]] for k, v in batch.items()}
            results = {}
            if train_actor:
                results["actor"] = actor.train_step(mb, ppo.micro_batch_size, partial(actor_loss, ppo=ppo, kl_coef=kl_coef))
            results["critic"] = critic.train_step(mb, ppo.micro_batch_size, partial(critic_loss, ppo=ppo))
            for role, r in results.items():
                for k, v in r.items():
                    name = f"{role}_{k}" if k in ("loss", "grad_norm", "lr") else k
                    if k not in ("update_ok", "skipped"):
                        trained.setdefault(name, []).append(float(v))
    return {k: sum(v) / len(v) for k, v in trained.items()}


def iteration_sums(rollout: Rollout, batch: dict, kl_stats: dict, gold: float, repetition: float) -> dict:
    """This rank's sums of the per-iteration metrics (device tensors, host numbers for the
    text-based ones); `dp_sums` adds them over data-parallel ranks."""
    n = rollout.tokens.size(0)
    return {
        "responses": n, "rm_score": batch["scores"].sum(), "gold_score": gold,
        "response_length": rollout.response_lengths().sum(), "kl": kl_stats["kl"], "kl_tokens": kl_stats["kl_tokens"],
        "logprob_mismatch": ((rollout.logprobs - batch["old_logprobs"]).abs() * batch["mask"]).sum(),
        "scored_tokens": batch["mask"].sum(), "repetition_rate": repetition * n,
    }


# ----------------------------------------------------------------------------- evaluation
def evaluate(engine, reward, tokenizer, task, prompts, sampling, micro, seed) -> tuple[dict, list[str], int]:
    """Gold and RM scores of responses to held-out prompts (sharded over DP ranks)."""
    rank, size = data_parallel()
    rollout = engine.generate(prompts[rank::size], sampling, seed)
    rm = padded_forward(reward, {"tokens": rollout.tokens, "lengths": rollout.lengths}, micro)["rewards"]
    texts = decode_responses(rollout, tokenizer)
    gold = [task.gold_score(p, r) for p, r in texts] if task else []
    sums = dp_sums({"n": len(texts), "rm": rm.sum(), "gold": sum(gold)}, rm.device)
    samples = [f"{p} || {r}" for p, r in texts]
    scores = {"eval_rm_score": sums["rm"] / sums["n"], **({"eval_gold_score": sums["gold"] / sums["n"]} if task else {})}
    return scores, samples, int(rollout.response_lengths().sum())


def decode_responses(rollout: Rollout, tokenizer) -> list[tuple[str, str]]:
    prompts = [row[:p] for row, p in zip(rollout.tokens.tolist(), rollout.prompt_lengths.tolist())]  # one host copy
    return [(tokenizer.decode(p), tokenizer.decode(r)) for p, r in zip(prompts, rollout.response_ids())]


# ----------------------------------------------------------------------------- the stage
def build_roles(cfg: Config) -> dict:
    ppo = cfg.ppo
    # LR schedules run over every optimizer step: epochs x minibatches per iteration
    total_steps = ppo.steps * ppo.ppo_epochs * (ppo.rollout_batch_size // ppo.mini_batch_size)
    return {
        "actor": Actor(cfg, trainable=True, temperature=ppo.temperature,
                       optimizer=ppo.actor_optimizer, total_steps=total_steps),
        "reference": Reference(cfg, temperature=ppo.temperature),
        "reward": RewardModel(cfg),
        "critic": Critic(cfg, trainable=True, optimizer=ppo.critic_optimizer, total_steps=total_steps),
    }


def load_inputs(cfg: Config, roles: dict, fresh_start: bool) -> str:
    """Reference from SFT and reward model from RM; on a fresh start also the actor (from
    SFT) and the critic (from RM); a resumed run has them from its own checkpoint."""
    sft = resolve_checkpoint(cfg.ppo.sft_from or stage_dir(cfg, "sft"))
    rm = resolve_checkpoint(cfg.ppo.rm_from or stage_dir(cfg, "rm"))
    load_role(roles["reference"], sft / "actor", with_optimizer=False)
    load_role(roles["reward"], rm / "reward", with_optimizer=False)
    if not fresh_start:
        return f"reference from {sft}, reward model from {rm}"
    load_model_weights(roles["actor"], sft / "actor")
    load_model_weights(roles["critic"], rm / "reward")  # value head starts as the reward head
    fold_reward_normalization(roles["critic"], roles["reward"])
    return f"actor/reference from {sft}, reward model/critic from {rm}"


@torch.no_grad()
def fold_reward_normalization(critic, reward) -> None:
    """The critic predicts returns in normalised reward units: fold the RM's (mean, std) into
    the value head it starts from, w' = w/std, b' = (b - mean)/std."""
    head = critic.module.output_layer if hasattr(critic.module, "output_layer") else None
    if head is not None:  # only the last pipeline stage holds the head
        head.weight.div_(reward.reward_std)
        head.bias.sub_(reward.reward_mean).div_(reward.reward_std)
    critic.optimizer.reload_model_params()


def train(cfg: Config) -> dict:
    start_time = time.perf_counter()
    preemption = PreemptionHandler()
    parallel.initialize(cfg)
    heartbeat = Heartbeat.from_env()
    ppo, out = cfg.ppo, stage_dir(cfg, "ppo")
    data = load_stage_data(cfg, ("prompts_train", "prompts_eval"))
    tok = data.tokenizer
    max_prompt = cfg.model.max_seq_length - ppo.max_new_tokens
    train_prompts, train_report = encode_prompts(data.splits["prompts_train"], tok, max_prompt)
    eval_prompts, _ = encode_prompts(data.splits["prompts_eval"], tok, max_prompt)

    roles = build_roles(cfg)
    actor, critic, reward = roles["actor"], roles["critic"], roles["reward"]
    engine = MegatronRolloutEngine(actor, eos_id=tok.eos_id, pad_id=tok.pad_id)
    sched = ColocationScheduler(roles)
    kl_ctl = alg.make_kl_controller(ppo.kl_controller, ppo.kl_coef, ppo.kl_target, ppo.kl_horizon)
    sampler = EpochSampler(len(train_prompts), seed=cfg.seed)
    ckpt = CheckpointManager(out, cfg.checkpoint.keep_last, cfg.checkpoint.async_save)
    trained = {"actor": actor, "critic": critic}
    step, resumed, state = resume(cfg, ckpt, trained, sampler)
    if resumed:
        kl_ctl.load_state_dict(state["kl_controller"])
    inputs = load_inputs(cfg, roles, fresh_start=not resumed)
    log = MetricsLogger(out, "ppo", ppo.steps, resume_step=step, tensorboard=cfg.logging.tensorboard)
    log.info(inputs)
    if resumed:
        log.info(resumed)
    log.info(f"prompts: {train_report}")
    for warning in warnings_for(cfg):
        log.info(f"warning: {warning}")
    sampling = SamplingParams(ppo.temperature, ppo.top_k, ppo.top_p, ppo.max_new_tokens)
    dp_rank, dp = data_parallel()
    run_eval = partial(evaluate, engine, reward, tok, data.task, eval_prompts, sampling, ppo.micro_batch_size,
                       cfg.seed + 17)
    sched.enter("eval")
    eval_metrics, samples, eval_tokens = run_eval()
    sched.exit(tokens=eval_tokens)
    log.info(f"eval at step {step}: {eval_metrics}; e.g. {samples[: ppo.eval_samples_logged]}")
    # "before" means the SFT policy: a resumed run keeps the numbers its first start measured
    before = state["before"] if resumed else {"eval": eval_metrics, "samples": samples}
    if not resumed:
        log.log(0, eval_metrics)  # the SFT policy: the eval curves start here
    eval_before, samples_before = before["eval"], before["samples"][: ppo.eval_samples_logged]

    samples_seen, metrics = state.get("consumed_samples", 0), {}
    while step < ppo.steps:
        step += 1
        FAULTS.begin_step(step)
        seed = cfg.seed * 100_003 + step * 1_009 + dp_rank

        sched.enter("generate")
        prompts = [train_prompts[i] for i in dp_slice(sampler.next_indices(ppo.rollout_batch_size), dp_rank, dp)]
        rollout = engine.generate(prompts, sampling, seed)
        sched.exit(tokens=int(rollout.response_lengths().sum()))
        heartbeat.beat()

        sched.enter("score")
        batch = score(rollout, roles, ppo, ppo.micro_batch_size)
        sched.exit(tokens=int(rollout.lengths.sum()))
        heartbeat.beat()

        sched.enter("train")
        kl_coef, train_actor = kl_ctl.value, step > ppo.critic_warmup_steps
        kl_stats = add_advantages(batch, ppo, kl_coef)
        train_stats = train_on_rollout(actor, critic, batch, ppo, kl_coef, train_actor, seed=seed)
        sched.exit(tokens=int(rollout.lengths.sum()) * ppo.ppo_epochs)

        texts = decode_responses(rollout, tok)
        gold = sum(data.task.gold_score(p, r) for p, r in texts) if data.task else 0.0
        repetition = alg.response_repetition_rate(rollout.response_ids())
        sums = dp_sums(iteration_sums(rollout, batch, kl_stats, gold, repetition), parallel.device())
        n = sums["responses"]
        samples_seen += int(n)
        if train_actor:  # the actor does not move during critic warm-up: nothing to steer yet
            kl_ctl.update(sums["kl"] / n, int(n))
        metrics = {
            "rm_score": sums["rm_score"] / n, **({"gold_score": sums["gold_score"] / n} if data.task else {}),
            "kl_mean": sums["kl"] / n, "kl_per_token": sums["kl"] / max(sums["kl_tokens"], 1.0),
            "kl_coef": kl_coef,  # the coefficient this iteration used
            "response_length": sums["response_length"] / n, "repetition_rate": sums["repetition_rate"] / n,
            "logprob_mismatch": sums["logprob_mismatch"] / max(sums["scored_tokens"], 1.0),
            "explained_variance": float(kl_stats["explained_variance"]), **train_stats, **skipped_steps(trained),
            **{f"{p}_seconds": s.seconds / s.calls for p, s in sched.stats.items()},
            **{f"{p}_tokens_per_s": v["tokens_per_s"] for p, v in sched.summary().items()},
            **{f"{p}_peak_memory_bytes": s.peak_memory_bytes for p, s in sched.stats.items()},
        }
        if step % ppo.eval_interval == 0 or step == ppo.steps:
            sched.enter("eval")
            eval_metrics, samples, eval_tokens = run_eval()
            sched.exit(tokens=eval_tokens)
            metrics.update(eval_metrics)
            log.info(f"step {step} samples: {samples[: ppo.eval_samples_logged]}")
        if step % ppo.log_interval == 0 or "eval_rm_score" in metrics:
            log.log(step, metrics)
        checkpoint_if_due(ckpt, log, preemption, step, ppo.steps, ppo.save_interval, trained,
                          trainer_state(step, samples_seen, sampler, trained, kl_controller=kl_ctl.state_dict(),
                                        before=before))
        heartbeat.beat()

    ckpt.wait()

    wall = time.perf_counter() - start_time
    phases = sched.summary()
    summary = {
        "stage": "ppo", "steps": step,
        # null without a gold scorer (data.task: null)
        "gold_score_eval_before": eval_before.get("eval_gold_score"),
        "gold_score_eval_after": eval_metrics.get("eval_gold_score"),
        "rm_score_eval_before": eval_before["eval_rm_score"], "rm_score_eval_after": eval_metrics["eval_rm_score"],
        "kl_mean_final": metrics.get("kl_mean"), "kl_coef_final": kl_ctl.value,
        "samples_per_second": samples_seen / max(sum(v["seconds"] for p, v in phases.items() if p != "eval"), 1e-9),
        "phase_seconds": {p: v["seconds"] for p, v in phases.items()},
        "phase_peak_memory_bytes": {p: v["peak_memory_bytes"] for p, v in phases.items()},
        "phase_tokens_per_s": {p: v["tokens_per_s"] for p, v in phases.items()},
        "wall_seconds": wall, "checkpoint": str(ckpt.latest()),
        "samples_before": samples_before, "samples_after": samples[: ppo.eval_samples_logged],
    }
    write_summary(out, summary)
    gold = ("no gold scorer" if summary["gold_score_eval_after"] is None else
            f"gold {summary['gold_score_eval_before']:.3f} -> {summary['gold_score_eval_after']:.3f}")
    log.info(f"done: {gold}, RM {summary['rm_score_eval_before']:.3f} -> {summary['rm_score_eval_after']:.3f}")
    heartbeat.close()
    log.close()
    return summary
