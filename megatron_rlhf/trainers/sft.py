"""Supervised fine-tuning: next-token loss on response tokens only.

    python -m megatron_rlhf sft --config pipelines/tiny_cpu.yaml [key=value ...]

Writes <run>/sft/: iter_*/actor (megatron dist checkpoint), metrics.jsonl, tensorboard/,
summary.json. Resumes from the stage's latest complete checkpoint.
"""

from __future__ import annotations

import time

import torch

from megatron_rlhf import parallel
from megatron_rlhf.checkpoint.manager import CheckpointManager
from megatron_rlhf.config import Config
from megatron_rlhf.data.encode import collate_sft, encode_sft
from megatron_rlhf.data.sampler import EpochSampler
from megatron_rlhf.logging import MetricsLogger
from megatron_rlhf.resilience.faults import FAULTS
from megatron_rlhf.resilience.heartbeat import Heartbeat
from megatron_rlhf.resilience.preemption import PreemptionHandler
from megatron_rlhf.models.roles import Actor
from megatron_rlhf.trainers.common import (
    all_reduce_sum, checkpoint_if_due, data_parallel, dp_slice, load_stage_data, padded_forward, resume,
    skipped_steps, stage_dir, trainer_state, write_summary,
)


def sft_loss(outputs: dict, microbatch: dict) -> torch.Tensor:
    """Mean negative log-likelihood of the response tokens in the microbatch."""
    mask = microbatch["loss_mask"]
    return -(outputs["logprobs"] * mask).sum() / mask.sum().clamp(min=1)


def evaluate(actor: Actor, examples: list, pad_id: int, seq_len: int, micro_batch_size: int) -> float:
    """Token-weighted response NLL over the eval set (sharded over data-parallel ranks)."""
    rank, size = data_parallel()
    shard = examples[rank::size]
    batch = collate_sft(shard, pad_id, seq_len)
    logprobs = padded_forward(actor, {"tokens": batch["tokens"]}, micro_batch_size)["logprobs"]
    nll, tokens = all_reduce_sum(-(logprobs * batch["loss_mask"]).sum().item(), batch["loss_mask"].sum().item())
    return nll / max(tokens, 1.0)


def train(cfg: Config) -> dict:
    start = time.perf_counter()
    preemption = PreemptionHandler()
    parallel.initialize(cfg)
    heartbeat = Heartbeat.from_env()
    st, out = cfg.sft, stage_dir(cfg, "sft")
    data = load_stage_data(cfg, ("sft_train", "sft_eval"))
    pad = data.tokenizer.pad_id
    train_set, train_report = encode_sft(data.splits["sft_train"], data.tokenizer, st.seq_length, cfg.data.overflow)
    eval_set, eval_report = encode_sft(data.splits["sft_eval"], data.tokenizer, st.seq_length, cfg.data.overflow)

    actor = Actor(cfg, trainable=True, optimizer=st.optimizer, total_steps=st.steps)
    roles = {"actor": actor}
    sampler = EpochSampler(len(train_set), seed=cfg.seed)
    ckpt = CheckpointManager(out, cfg.checkpoint.keep_last, cfg.checkpoint.async_save)
    step, resumed, _ = resume(cfg, ckpt, roles, sampler)
    if resumed is None and cfg.model.init_from_hf:
        from megatron_rlhf.convert import check_model_matches_hf, load_hf_weights

        check_model_matches_hf(cfg, cfg.model.init_from_hf)
        load_hf_weights(actor, cfg.model.init_from_hf)
    log = MetricsLogger(out, "sft", st.steps, resume_step=step, tensorboard=cfg.logging.tensorboard)
    log.info(f"train data: {train_report}; eval data: {eval_report}")
    if resumed:
        log.info(resumed)
    elif cfg.model.init_from_hf:
        log.info(f"initialised from the Hugging Face checkpoint {cfg.model.init_from_hf}")
    eval_args = (data.tokenizer.pad_id, st.seq_length, st.micro_batch_size)
    eval_loss_start = evaluate(actor, eval_set, *eval_args)
    dp_rank, dp_size = data_parallel()

    metrics = {}
    while step < st.steps:
        t0 = time.perf_counter()
        FAULTS.begin_step(step + 1)
        indices = dp_slice(sampler.next_indices(st.global_batch_size), dp_rank, dp_size)
        batch = collate_sft([train_set[i] for i in indices], pad, st.seq_length)
        result = actor.train_step(batch, st.micro_batch_size, sft_loss)
        step += 1
        (tokens,) = all_reduce_sum(batch["lengths"].sum().item())
        metrics = {"loss": result["loss"], "lr": result["lr"], "grad_norm": result["grad_norm"],
                   **skipped_steps(roles), "tokens_per_s": tokens / (time.perf_counter() - t0)}
        if step % st.eval_interval == 0 or step == st.steps:
            metrics["eval_loss"] = evaluate(actor, eval_set, *eval_args)
        if step % st.log_interval == 0 or "eval_loss" in metrics:
            log.log(step, metrics)
        checkpoint_if_due(ckpt, log, preemption, step, st.steps, st.save_interval, roles,
                          trainer_state(step, step * st.global_batch_size, sampler, roles))
        heartbeat.beat()

    ckpt.wait()

    summary = {
        "stage": "sft", "steps": step,
        "final_train_loss": metrics.get("loss"),
        "eval_loss_start": eval_loss_start,
        "eval_loss": metrics.get("eval_loss", evaluate(actor, eval_set, *eval_args)),
        "train_data": vars(train_report), "eval_data": vars(eval_report),
        "wall_seconds": time.perf_counter() - start,
        "checkpoint": str(ckpt.latest()),
    }
    write_summary(out, summary)
    log.info(f"done: eval loss {summary['eval_loss_start']:.4f} -> {summary['eval_loss']:.4f}")
    heartbeat.close()
    log.close()
    return summary
