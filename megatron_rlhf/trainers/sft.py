"""Supervised fine-tuning: next-token loss on response tokens only.

    python -m megatron_rlhf sft --config pipelines/tiny_cpu.yaml [key=value ...]

Starts from sft.init_from (a checkpoint's actor), else model.init_from_hf, else a fresh
initialisation. Writes <run>/sft/ (with LoRA <run>/sft_lora/: adapters on that start, frozen):
iter_*/actor (megatron dist checkpoint), metrics.jsonl, tensorboard/, summary.json. Resumes
from the stage's latest complete checkpoint.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from megatron_rlhf import parallel
from megatron_rlhf.checkpoint.manager import resolve_checkpoint
from megatron_rlhf.config import Config
from megatron_rlhf.data.encode import collate_sft, encode_sft
from megatron_rlhf.data.sampler import EpochSampler
from megatron_rlhf.models.batching import data_parallel, dp_slice, padded_forward
from megatron_rlhf.models.roles import Actor, lora_base_warnings, lora_summary
from megatron_rlhf.parallel.collectives import dp_sums
from megatron_rlhf.trainers.runner import StageRunner, skipped_steps
from megatron_rlhf.trainers.stage_data import load_stage_data
from megatron_rlhf.trainers.start_weights import load_start


def response_nll(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed NLL of the response tokens, their count) on the device of `logprobs`."""
    valid = loss_mask.to(logprobs.device) != 0
    return torch.where(valid, -logprobs, torch.zeros_like(logprobs)).sum(), valid.sum()


def sft_loss(outputs: dict, microbatch: dict):
    """Response-token NLL: the step divides the global batch's sum by its token count."""
    nll, tokens = response_nll(outputs["logprobs"], microbatch["loss_mask"])
    return nll, tokens, {}


def eval_sums(actor: Actor, examples: list, pad_id: int, seq_len: int, micro_batch_size: int) -> dict:
    """This rank's share of the eval set: summed response NLL and token count (device tensors)."""
    rank, size = data_parallel()
    batch = collate_sft(examples[rank::size], pad_id, seq_len)
    logprobs = padded_forward(actor, {"tokens": batch["tokens"]}, micro_batch_size)["logprobs"]
    nll, tokens = response_nll(logprobs, batch["loss_mask"])
    return {"nll": nll, "tokens": tokens}


def evaluate(actor: Actor, examples: list, pad_id: int, seq_len: int, micro_batch_size: int) -> float:
    """Token-weighted response NLL over the eval set (sharded over data-parallel ranks)."""
    sums = dp_sums(eval_sums(actor, examples, pad_id, seq_len, micro_batch_size), parallel.device())
    return sums["nll"] / max(sums["tokens"], 1.0)


def start_checkpoint(cfg: Config) -> tuple[str, str] | None:
    """("ckpt", dir) for sft.init_from, ("hf", dir) for model.init_from_hf, None: fresh."""
    if cfg.sft.init_from:
        return "ckpt", str(resolve_checkpoint(cfg.sft.init_from, "sft.init_from"))
    return ("hf", cfg.model.init_from_hf) if cfg.model.init_from_hf else None


def train(cfg: Config) -> dict:
    st = cfg.sft
    runner = StageRunner(cfg, "sft", st.steps, st.log_interval, st.save_interval)
    data = load_stage_data(cfg, ("sft_train", "sft_eval"), stage="sft")
    cfg = data.config  # the run's vocabulary and start architecture resolved (stage_data.RunContext)
    pad = data.tokenizer.pad_id
    encode = partial(encode_sft, tokenizer=data.tokenizer, max_len=st.seq_length, overflow=cfg.data.overflow,
                     max_len_field="sft.seq_length")
    train_set, train_report = encode(data.splits["sft_train"])
    eval_set, eval_report = encode(data.splits["sft_eval"])

    lora = cfg.lora if cfg.lora.applies_to("sft") else None
    actor = Actor(cfg.model, trainable=True, optimizer=st.optimizer, total_steps=st.steps, lora=lora, seed=cfg.seed,
                  max_consecutive_nonfinite=cfg.resilience.max_consecutive_nonfinite)
    roles = {"actor": actor}
    sampler = EpochSampler(len(train_set), seed=cfg.seed)
    runner.resume(roles, sampler)
    start = start_checkpoint(cfg)
    # a LoRA actor's frozen base also on resume: its checkpoints hold only the adapters
    loaded = load_start(cfg, actor, start) if start and (lora or runner.resumed is None) else None
    log = runner.log
    log.info(f"train data: {train_report}; eval data: {eval_report}")
    if runner.resumed:
        log.info(runner.resumed)
    if loaded:
        where = f"the Hugging Face checkpoint {loaded}" if start[0] == "hf" and not lora else loaded
        log.info(f"LoRA adapters on the frozen base {where}" if lora else f"initialised from {where}")
    for line in lora_base_warnings(roles):
        log.info(line)
    eval_args = (data.tokenizer.pad_id, st.seq_length, st.micro_batch_size)
    eval_loss_start = evaluate(actor, eval_set, *eval_args)
    dp_rank, dp_size = data_parallel()

    metrics = {}
    for step in runner.steps():
        t0 = time.perf_counter()
        indices = dp_slice(sampler.next_indices(st.global_batch_size), dp_rank, dp_size)
        batch = collate_sft([train_set[i] for i in indices], pad, st.seq_length)
        result = actor.train_step(batch, st.micro_batch_size, sft_loss)
        tokens = dp_sums({"tokens": int(batch["lengths"].sum())}, parallel.device())["tokens"]
        metrics = {"loss": result["loss"], "lr": result["lr"], "grad_norm": result["grad_norm"],
                   **skipped_steps(roles), "tokens_per_s": tokens / (time.perf_counter() - t0)}
        evaluated = runner.due(st.eval_interval)
        if evaluated:
            metrics["eval_loss"] = evaluate(actor, eval_set, *eval_args)
        runner.end_step(metrics, step * st.global_batch_size, evaluated)

    eval_loss = metrics.get("eval_loss", evaluate(actor, eval_set, *eval_args))
    return runner.finish({
        "final_train_loss": metrics.get("loss"), "eval_loss_start": eval_loss_start, "eval_loss": eval_loss,
        "train_data": vars(train_report), "eval_data": vars(eval_report), "data_sources": data.sources,
        "started_from": start and start[1], "lora": lora_summary(roles),
    }, f"done: eval loss {eval_loss_start:.4f} -> {eval_loss:.4f}")
