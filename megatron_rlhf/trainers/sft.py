"""Supervised fine-tuning: next-token loss on response tokens only.

    python -m megatron_rlhf sft --config pipelines/tiny_cpu.yaml [key=value ...]

Starts from sft.init_from (a checkpoint's actor), else model.init_from_hf, else a fresh
initialisation. Writes <run>/sft/ (with LoRA <run>/sft_lora/: adapters on that start, frozen):
iter_*/actor (megatron dist checkpoint), metrics.jsonl, tensorboard/, summary.json. Resumes
from the stage's latest complete checkpoint.
"""

from __future__ import annotations

import torch

from megatron_rlhf import parallel
from megatron_rlhf.checkpoint.manager import resolve_checkpoint
from megatron_rlhf.config import Config
from megatron_rlhf.data.encode import collate_sft, encode_sft
from megatron_rlhf.models.batching import data_parallel, padded_forward
from megatron_rlhf.models.roles import Actor, lora_base_warnings, lora_summary
from megatron_rlhf.parallel.collectives import dp_sums
from megatron_rlhf.trainers.runner import StageRunner
from megatron_rlhf.trainers.stage_data import load_stage_data
from megatron_rlhf.trainers.start_weights import load_start
from megatron_rlhf.trainers.supervised import SupervisedSteps, encode_splits, fit, log_lines, resume, run_steps


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


def train_metrics(result: dict) -> dict:
    """The logged train metrics of a step's train_step result."""
    return {k: result[k] for k in ("loss", "lr", "grad_norm")}


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
    examples = encode_splits(encode_sft, data.splits["sft_train"], data.splits["sft_eval"],
                             fit(data, st.seq_length, "sft.seq_length"))

    lora = cfg.lora if cfg.lora.applies_to("sft") else None
    actor = Actor(cfg.model, trainable=True, optimizer=st.optimizer, total_steps=st.steps, lora=lora, seed=cfg.seed,
                  max_consecutive_nonfinite=cfg.resilience.max_consecutive_nonfinite)
    roles = {"actor": actor}
    resume(runner, roles, len(examples.train), cfg.seed)
    start = start_checkpoint(cfg)
    # a LoRA actor's frozen base also on resume: its checkpoints hold only the adapters
    loaded = load_start(cfg, actor, start) if start and (lora or runner.resumed is None) else None
    where = f"the Hugging Face checkpoint {loaded}" if loaded and start[0] == "hf" and not lora else loaded
    log_lines(runner, f"train data: {examples.train_report}; eval data: {examples.eval_report}", runner.resumed,
              loaded and (f"LoRA adapters on the frozen base {where}" if lora else f"initialised from {where}"),
              *lora_base_warnings(roles))
    eval_args = (data.tokenizer.pad_id, st.seq_length, st.micro_batch_size)
    eval_loss_start = evaluate(actor, examples.eval, *eval_args)
    if runner.resumed is None:
        runner.log.log(0, {"eval_loss": eval_loss_start})  # the starting policy: the eval curve starts here

    def collate(indices: list[int]) -> dict:
        return collate_sft([examples.train[i] for i in indices], pad, st.seq_length)

    def eval_metrics() -> dict:
        return {"eval_loss": evaluate(actor, examples.eval, *eval_args)}

    metrics = run_steps(runner, SupervisedSteps(
        actor, collate, sft_loss, micro_rows=st.micro_batch_size, global_batch_size=st.global_batch_size,
        eval_interval=st.eval_interval, step_metrics=train_metrics, evaluate=eval_metrics))

    eval_loss = metrics.get("eval_loss", evaluate(actor, examples.eval, *eval_args))
    return runner.finish({
        "final_train_loss": metrics.get("loss"), "eval_loss_start": eval_loss_start, "eval_loss": eval_loss,
        "train_data": vars(examples.train_report), "eval_data": vars(examples.eval_report),
        "data_sources": data.sources, "started_from": start and start[1], "lora": lora_summary(roles),
    }, f"done: eval loss {eval_loss_start:.4f} -> {eval_loss:.4f}")
