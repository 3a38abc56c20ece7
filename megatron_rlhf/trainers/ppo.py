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
from megatron_rlhf.config import Config, PPOConfig
from megatron_rlhf.data.encode import encode_prompts
from megatron_rlhf.data.sampler import EpochSampler
from megatron_rlhf.logging import MetricsLogger
from megatron_rlhf.models.roles import Actor, Critic, Reference, RewardModel
from megatron_rlhf.resilience.faults import FAULTS
from megatron_rlhf.resilience.heartbeat import Heartbeat
from megatron_rlhf.resilience.preemption import PreemptionHandler
from megatron_rlhf.rollout import MegatronRolloutEngine, Rollout, SamplingParams
from megatron_rlhf.trainers.common import (
    all_reduce_sum, checkpoint_if_due, data_parallel, dp_slice, load_stage_data, padded_forward, resume,
    skipped_steps, stage_dir, trainer_state, write_summary,
)


# ----------------------------------------------------------------------------- layout
def response_slice(x: torch.Tensor, prompt_lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B, S] in sequence layout (position t predicts token t+1) -> [B, width] response layout
    (column j is response token j)."""
    idx = (prompt_lengths[:, None] - 1 + torch.arange(width)).clamp(max=x.size(1) - 1)
    return x.gather(1, idx)


def response_unslice(y: torch.Tensor, prompt_lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    out = torch.zeros(y.size(0), seq_len + y.size(1), dtype=y.dtype)
    idx = prompt_lengths[:, None] - 1 + torch.arange(y.size(1))
    return out.scatter(1, idx, y)[:, :seq_len]


# ----------------------------------------------------------------------------- phases
def score(rollout: Rollout, roles: dict, ppo: PPOConfig, micro: int) -> dict[str, torch.Tensor]:
    """Everything the train phase needs, in sequence layout, from one forward of each role."""
    seqs = {"tokens": rollout.tokens, "lengths": rollout.lengths}
    actor_out = padded_forward(roles["actor"], seqs, micro)
    scores = padded_forward(roles["reward"], seqs, micro)["rewards"]
    if ppo.missing_eos_penalty is not None:
        scores = torch.where(rollout.finished, scores, torch.full_like(scores, ppo.missing_eos_penalty))
    mask = rollout.response_mask()
    return {
        **seqs, "prompt_lengths": rollout.prompt_lengths, "mask": mask,
        "old_logprobs": actor_out["logprobs"] * mask, "entropy": actor_out["entropy"],
        "ref_logprobs": padded_forward(roles["reference"], seqs, micro)["logprobs"] * mask,
        "old_values": padded_forward(roles["critic"], seqs, micro)["values"] * mask,
        "scores": scores.clamp(-ppo.reward_clip, ppo.reward_clip),
    }


def add_advantages(batch: dict, ppo: PPOConfig, kl_coef: float) -> dict[str, float]:
    """Token rewards -> GAE -> (whitened) advantages and returns, added to `batch`."""
    plen, seq_len = batch["prompt_lengths"], batch["tokens"].size(1)
    width = int((batch["lengths"] - plen).max())
    mask = (torch.arange(width) < (batch["lengths"] - plen)[:, None]).float()
    resp = partial(response_slice, prompt_lengths=plen, width=width)
    kl = alg.kl_estimate(resp(batch["old_logprobs"]), resp(batch["ref_logprobs"]), ppo.kl_estimator) * mask
    rewards = alg.token_rewards(kl if ppo.kl_in_reward else torch.zeros_like(kl), batch["scores"], mask, kl_coef)
    values = resp(batch["old_values"]) * mask
    advantages, returns = alg.gae(rewards, values, mask, ppo.gamma, ppo.lam)
    if ppo.whiten_advantages:
        advantages = whiten_over_data_parallel(advantages, mask)
    batch["advantages"] = response_unslice(advantages, plen, seq_len)
    batch["returns"] = response_unslice(returns, plen, seq_len)
    return {"kl_per_token": alg.masked_mean(kl, mask).item(), "kl_mean": (kl.sum(1)).mean().item(),
            "explained_variance": alg.explained_variance(values, returns, mask)}


def whiten_over_data_parallel(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """alg.masked_whiten over the global batch: moments summed over data-parallel ranks."""
    n, total, total_sq = all_reduce_sum(mask.sum().item(), (x * mask).sum().item(), (x * x * mask).sum().item())
    mean = total / n
    var = (total_sq / n - mean * mean) * n / max(n - 1, 1)  # unbiased, as alg.masked_var
    return (x - mean) * torch.rsqrt(torch.tensor(var + 1e-8)) * mask


def actor_loss(outputs: dict, mb: dict, ppo: PPOConfig, kl_coef: float):
    mask = mb["mask"]
    loss, stats = alg.policy_loss(outputs["logprobs"], mb["old_logprobs"], mb["advantages"], mask, ppo.clip_eps)
    entropy = alg.entropy_bonus(outputs["entropy"], mask)
    loss = loss - ppo.entropy_coef * entropy
    if not ppo.kl_in_reward:
        loss = loss + kl_coef * alg.kl_penalty_loss(outputs["logprobs"], mb["ref_logprobs"], mask, ppo.kl_estimator)
    return loss, {**stats, "entropy": entropy.detach()}


def critic_loss(outputs: dict, mb: dict, ppo: PPOConfig):
    loss, stats = alg.value_loss(outputs["values"], mb["old_values"], mb["returns"], mb["mask"], ppo.value_clip)
    return ppo.vf_coef * loss, stats


def train_on_rollout(actor, critic, batch: dict, ppo: PPOConfig, kl_coef: float, train_actor: bool,
                     seed: int) -> dict[str, float]:
    """PPO epochs x minibatches, reshuffled every epoch; returns the mean of each statistic."""
    _, dp = data_parallel()
    rows, mini = batch["tokens"].size(0), ppo.mini_batch_size // dp
    generator = torch.Generator().manual_seed(seed)
    trained: dict[str, list[float]] = {}
    for _ in range(ppo.ppo_epochs):
        order = torch.randperm(rows, generator=generator)
        for start in range(0, rows, mini):
            mb = {k: v[order[start : start + mini]] for k, v in batch.items()}
            results = {}
            if train_actor:
                results["actor"] = actor.train_step(mb, ppo.micro_batch_size, partial(actor_loss, ppo=ppo, kl_coef=kl_coef))
            results["critic"] = critic.train_step(mb, ppo.micro_batch_size, partial(critic_loss, ppo=ppo))
            for role, r in results.items():
                for k, v in r.items():
                    name = {"loss": f"{'policy' if role == 'actor' else 'value'}_loss"}.get(k, k)
                    if k in ("grad_norm", "lr"):
                        name = f"{role}_{k}"
                    if k not in ("update_ok", "skipped"):
                        trained.setdefault(name, []).append(float(v))
    return {k: sum(v) / len(v) for k, v in trained.items()}


# ----------------------------------------------------------------------------- evaluation
def evaluate(engine, reward, tokenizer, task, prompts, sampling, micro, seed) -> tuple[dict, list[str], int]:
    """Gold and RM scores of responses to held-out prompts (sharded over DP ranks)."""
    rank, size = data_parallel()
    rollout = engine.generate(prompts[rank::size], sampling, seed)
    rm = padded_forward(reward, {"tokens": rollout.tokens, "lengths": rollout.lengths}, micro)["rewards"]
    texts = decode_responses(rollout, tokenizer)
    gold = [task.gold_score(p, r) for p, r in texts] if task else []
    n, rm_sum, gold_sum = all_reduce_sum(len(texts), rm.sum().item(), sum(gold))
    samples = [f"{p} || {r}" for p, r in texts]
    scores = {"eval_rm_score": rm_sum / n, "eval_gold_score": gold_sum / n if task else float("nan")}
    return scores, samples, int(rollout.response_lengths().sum())


def decode_responses(rollout: Rollout, tokenizer) -> list[tuple[str, str]]:
    prompts = [row[: int(p)] for row, p in zip(rollout.tokens.tolist(), rollout.prompt_lengths)]
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
        kl_stats = add_advantages(batch, ppo, kl_ctl.value)
        train_stats = train_on_rollout(actor, critic, batch, ppo, kl_ctl.value,
                                       train_actor=step > ppo.critic_warmup_steps, seed=seed)
        sched.exit(tokens=int(rollout.lengths.sum()) * ppo.ppo_epochs)

        texts = decode_responses(rollout, tok)
        n, rm_sum, gold_sum, len_sum, kl_sum, mismatch_sum, tokens_sum, rep_sum = all_reduce_sum(
            len(texts), batch["scores"].sum().item(),
            sum(data.task.gold_score(p, r) for p, r in texts) if data.task else 0.0,
            rollout.response_lengths().sum().item(), kl_stats["kl_mean"] * len(texts),
            ((rollout.logprobs - batch["old_logprobs"]).abs() * batch["mask"]).sum().item(), batch["mask"].sum().item(),
            alg.response_repetition_rate(rollout.response_ids()) * len(texts),
        )
        samples_seen += int(n)
        kl_ctl.update(kl_sum / n, int(n))
        metrics = {
            "rm_score": rm_sum / n, "gold_score": gold_sum / n if data.task else float("nan"),
            "kl_mean": kl_sum / n, "kl_per_token": kl_stats["kl_per_token"], "kl_coef": kl_ctl.value,
            "response_length": len_sum / n, "repetition_rate": rep_sum / n,
            "logprob_mismatch": mismatch_sum / max(tokens_sum, 1.0),
            "explained_variance": kl_stats["explained_variance"], **train_stats, **skipped_steps(trained),
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
        if step % ppo.log_interval == 0 or "eval_gold_score" in metrics:
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
        "gold_score_eval_before": eval_before["eval_gold_score"], "gold_score_eval_after": eval_metrics["eval_gold_score"],
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
    log.info(f"done: gold {summary['gold_score_eval_before']:.3f} -> {summary['gold_score_eval_after']:.3f}, "
             f"RM {summary['rm_score_eval_before']:.3f} -> {summary['rm_score_eval_after']:.3f}")
    heartbeat.close()
    log.close()
    return summary
