"""Reward model: Bradley-Terry loss -log sigmoid(r_chosen - r_rejected) on preference pairs.

    python -m megatron_rlhf rm --config pipelines/tiny_cpu.yaml [key=value ...]

The network starts from the SFT checkpoint (its LM head replaced by a fresh scalar head,
N(0, 1/sqrt(d_model+1)), bias 0); the reward is read at the last response token. After
training, rewards are optionally normalised to mean 0, std 1 over SFT-data responses; the
normalisation is stored in the checkpoint. Writes <run>/rm/ like the SFT stage.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from megatron_rlhf import parallel
from megatron_rlhf.checkpoint.dist import load_model_weights
from megatron_rlhf.checkpoint.manager import resolve_checkpoint
from megatron_rlhf.config import Config
from megatron_rlhf.data.encode import collate_preferences, collate_sft, encode_preferences, encode_sft
from megatron_rlhf.data.sampler import EpochSampler
from megatron_rlhf.models.roles import RewardModel, summed
from megatron_rlhf.parallel.collectives import dp_sums, masked_moments
from megatron_rlhf.trainers.batching import data_parallel, dp_slice, padded_forward
from megatron_rlhf.trainers.runner import StageRunner, skipped_steps
from megatron_rlhf.trainers.stage_data import load_stage_data, stage_dir


def bradley_terry_loss(outputs: dict, microbatch: dict):
    """-log sigmoid(r_chosen - r_rejected) summed over the microbatch's pairs (rows alternate
    chosen, rejected: collate_preferences); the step divides by the global batch's pairs.
    Accuracy and margin are reported as global means too."""
    margin = outputs["rewards"][0::2] - outputs["rewards"][1::2]
    stats = {"accuracy": (margin > 0).sum(), "margin": margin.sum()}
    return (*summed(-F.logsigmoid(margin)), stats)


def eval_sums(rm: RewardModel, pairs: list, pad_id: int, seq_len: int, micro_pairs: int) -> dict:
    """This rank's share of the held-out pairs: correct pairs, pairs, summed margin (device)."""
    rank, size = data_parallel()
    batch = collate_preferences(pairs[rank::size], pad_id, seq_len)
    rewards = padded_forward(rm, {"tokens": batch["tokens"], "lengths": batch["lengths"]}, 2 * micro_pairs)["rewards"]
    _, pair_count, stats = bradley_terry_loss({"rewards": rewards}, {})
    return {"correct": stats["accuracy"], "pairs": pair_count, "margin": stats["margin"]}


def evaluate(rm: RewardModel, pairs: list, pad_id: int, seq_len: int, micro_pairs: int) -> dict:
    """Held-out accuracy (r_chosen > r_rejected) and mean margin, over data-parallel shards."""
    sums = dp_sums(eval_sums(rm, pairs, pad_id, seq_len, micro_pairs), parallel.device())
    return {"eval_accuracy": sums["correct"] / sums["pairs"], "eval_margin": sums["margin"] / sums["pairs"]}


def reward_statistics(rm: RewardModel, examples: list, pad_id: int, seq_len: int, micro: int) -> tuple[float, float]:
    """Mean and std of the RM's scores on prompt+response sequences (SFT data), over all
    data-parallel ranks; two passes (mean, then deviations) in float64."""
    rank, size = data_parallel()
    batch = collate_sft(examples[rank::size], pad_id, seq_len)
    r = padded_forward(rm, {"tokens": batch["tokens"], "lengths": batch["lengths"]}, micro)["rewards"]
    count, mean, var = masked_moments(r, torch.ones_like(r))
    # Population std (as before): the normalisation maps these scores to mean 0, std 1.
    std = (var * (count - 1).clamp(min=0) / count.clamp(min=1)).sqrt()
    return float(mean), max(float(std), 1e-6)


def train(cfg: Config) -> dict:
    st = cfg.rm
    runner = StageRunner(cfg, "rm", st.steps, st.log_interval, st.save_interval)
    data = load_stage_data(cfg, ("preference_train", "preference_eval", "sft_eval"))
    pad, ovf = data.tokenizer.pad_id, cfg.data.overflow
    fit = {"tokenizer": data.tokenizer, "max_len": st.seq_length, "overflow": ovf, "max_len_field": "rm.seq_length"}
    train_set, train_report = encode_preferences(data.splits["preference_train"], **fit)
    eval_set, eval_report = encode_preferences(data.splits["preference_eval"], **fit)
    sft_samples, _ = encode_sft(data.splits["sft_eval"], **fit)

    rm = RewardModel(cfg, trainable=True, optimizer=st.optimizer, total_steps=st.steps)
    roles = {"reward": rm}
    sampler = EpochSampler(len(train_set), seed=cfg.seed)
    runner.resume(roles, sampler)
    init_note = runner.resumed
    if init_note is None:
        sft_ckpt = resolve_checkpoint(st.init_from or stage_dir(cfg, "sft"))
        load_model_weights(rm, sft_ckpt / "actor", skip_prefixes=("output_layer.",))
        init_note = f"initialised from {sft_ckpt} (fresh value head)"
    runner.log.info(init_note)
    runner.log.info(f"train pairs: {train_report}; eval pairs: {eval_report}")
    eval_args = (pad, st.seq_length, st.micro_batch_size)
    dp_rank, dp_size = data_parallel()

    metrics = {}
    for step in runner.steps():
        t0 = time.perf_counter()
        indices = dp_slice(sampler.next_indices(st.global_batch_size), dp_rank, dp_size)
        batch = collate_preferences([train_set[i] for i in indices], pad, st.seq_length)
        result = rm.train_step({k: batch[k] for k in ("tokens", "lengths")}, 2 * st.micro_batch_size,
                               bradley_terry_loss)
        tokens = dp_sums({"tokens": int(batch["lengths"].sum())}, parallel.device())["tokens"]
        metrics = {"loss": result["loss"], "accuracy": result["accuracy"], "margin": result["margin"],
                   "lr": result["lr"], "grad_norm": result["grad_norm"],
                   **skipped_steps(roles), "tokens_per_s": tokens / (time.perf_counter() - t0)}
        evaluated = runner.due(st.eval_interval)
        if evaluated:
            metrics.update(evaluate(rm, eval_set, *eval_args))
        if step == st.steps and st.normalize:
            rm.reward_mean, rm.reward_std = 0.0, 1.0
            rm.reward_mean, rm.reward_std = reward_statistics(rm, sft_samples, pad, st.seq_length, st.micro_batch_size)
            runner.log.info(f"reward normalisation: mean {rm.reward_mean:.4f}, std {rm.reward_std:.4f}")
        runner.end_step(metrics, step * st.global_batch_size, evaluated)

    final = evaluate(rm, eval_set, *eval_args)
    return runner.finish({
        "final_train_loss": metrics.get("loss"), **final,
        "reward_mean": rm.reward_mean, "reward_std": rm.reward_std,
        "train_data": vars(train_report), "eval_data": vars(eval_report),
    }, f"done: eval accuracy {final['eval_accuracy']:.3f}, margin {final['eval_margin']:.3f}")
