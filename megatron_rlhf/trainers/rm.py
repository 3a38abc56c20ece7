"""Reward model: Bradley-Terry loss -log sigmoid(r_chosen - r_rejected) on preference pairs.

    python -m megatron_rlhf rm --config pipelines/tiny_cpu.yaml [key=value ...]

The network starts from the SFT checkpoint (its LM head replaced by a fresh scalar head,
N(0, 1/sqrt(d_model+1)), bias 0); the reward is read at the last response token. After
training, rewards are optionally normalised to mean 0, std 1 over SFT-data responses; the
normalisation is stored in the checkpoint. Writes <run>/rm/ like the SFT stage.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_rlhf import parallel
from megatron_rlhf.checkpoint.dist import load_model_weights
from megatron_rlhf.checkpoint.manager import resolve_checkpoint
from megatron_rlhf.config import Config
from megatron_rlhf.data.encode import collate_preferences, collate_sft, encode_preferences, encode_sft
from megatron_rlhf.models.batching import data_parallel, padded_forward
from megatron_rlhf.models.roles import RewardModel, summed
from megatron_rlhf.parallel.collectives import dp_sums, masked_moments
from megatron_rlhf.trainers.runner import StageRunner, start_distributed
from megatron_rlhf.trainers.stage_data import held_out, load_stage_data, stage_dir
from megatron_rlhf.trainers.supervised import SupervisedSteps, encode_splits, fit, log_lines, resume, run_steps


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


def evaluate(rm: RewardModel, pairs: list, pad_id: int, seq_len: int, micro_pairs: int, units: str) -> dict:
    """Held-out accuracy (r_chosen > r_rejected) and mean margin, over data-parallel shards;
    the margin's name says its `units`: raw (before the normalisation) or normalized."""
    sums = dp_sums(eval_sums(rm, pairs, pad_id, seq_len, micro_pairs), parallel.device())
    return {"eval_accuracy": sums["correct"] / sums["pairs"], f"eval_margin_{units}": sums["margin"] / sums["pairs"]}


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
    """The reward model (<run>/rm); with rm.holdout_fraction > 0, first an independent one on
    the held-out pairs (<run>/rm_holdout), so that <run>/rm/summary.json marks both done."""
    start_distributed(cfg, "rm")  # the data is read once for both: before the first stage runner
    data = load_stage_data(cfg, ("preference_train", "preference_eval"), optional=("sft_eval",), stage="rm")
    cfg = data.config  # the run's vocabulary and start architecture resolved (stage_data.RunContext)
    pairs, fraction = data.splits["preference_train"], cfg.rm.holdout_fraction
    if fraction == 0:
        return train_reward_model(cfg, "rm", data, pairs)
    seed = cfg.seed + 1  # not the seed of data.eval_fraction's split
    holdout = train_reward_model(cfg, "rm_holdout", data, held_out(pairs, fraction, seed, "eval", "rm.holdout_fraction"))
    summary = train_reward_model(cfg, "rm", data, held_out(pairs, fraction, seed, "train", "rm.holdout_fraction"))
    return {**summary, "holdout": holdout}


def normalization_samples(data) -> tuple[list, str]:
    """Sequences whose RM scores set the normalisation: SFT responses when the run has SFT
    data, else the chosen responses of the held-out preference pairs."""
    if "sft_eval" in data.splits:
        return data.splits["sft_eval"], "SFT eval responses"
    return [p.chosen_example() for p in data.splits["preference_eval"]], "chosen responses of the eval pairs"


def train_metrics(result: dict) -> dict:
    """The logged train metrics of a step's train_step result; margins in raw reward units (the
    normalisation is fitted after the last step)."""
    return {"loss": result["loss"], "accuracy": result["accuracy"], "margin_raw": result["margin"],
            "lr": result["lr"], "grad_norm": result["grad_norm"]}


def train_reward_model(cfg: Config, name: str, data, train_pairs: list) -> dict:
    st = cfg.rm
    runner = StageRunner(cfg, name, st.steps, st.log_interval, st.save_interval)
    pad, fitted = data.tokenizer.pad_id, fit(data, st.seq_length, "rm.seq_length")
    pairs = encode_splits(encode_preferences, train_pairs, data.splits["preference_eval"], fitted)
    norm_examples, norm_source = normalization_samples(data)
    norm_samples, _ = encode_sft(norm_examples, **fitted)

    rm = RewardModel(cfg.model, trainable=True, optimizer=st.optimizer, total_steps=st.steps,
                     max_consecutive_nonfinite=cfg.resilience.max_consecutive_nonfinite)
    roles = {"reward": rm}
    resume(runner, roles, len(pairs.train), cfg.seed)
    init_note = runner.resumed
    if init_note is None:
        sft_ckpt = resolve_checkpoint(st.init_from or stage_dir(cfg, "sft"), "rm.init_from")
        load_model_weights(rm, sft_ckpt / "actor", skip_prefixes=("output_layer.",))
        init_note = f"initialised from {sft_ckpt} (fresh value head)"
    log_lines(runner, init_note, f"train pairs: {pairs.train_report}; eval pairs: {pairs.eval_report}")
    eval_args = (pad, st.seq_length, st.micro_batch_size)

    def collate(indices: list[int]) -> dict:
        return collate_preferences([pairs.train[i] for i in indices], pad, st.seq_length)

    def eval_metrics() -> dict:
        return evaluate(rm, pairs.eval, *eval_args, units="raw")

    def normalize() -> None:
        rm.reward_mean, rm.reward_std = 0.0, 1.0
        rm.reward_mean, rm.reward_std = reward_statistics(rm, norm_samples, pad, st.seq_length, st.micro_batch_size)
        runner.log.info(f"reward normalisation over {len(norm_samples)} {norm_source}: "
                        f"mean {rm.reward_mean:.4f}, std {rm.reward_std:.4f}")

    metrics = run_steps(runner, SupervisedSteps(
        rm, collate, bradley_terry_loss, micro_rows=2 * st.micro_batch_size, global_batch_size=st.global_batch_size,
        eval_interval=st.eval_interval, step_metrics=train_metrics, evaluate=eval_metrics, inputs=("tokens", "lengths"),
        before_last_checkpoint=normalize if st.normalize else None))

    final = evaluate(rm, pairs.eval, *eval_args, units="normalized" if st.normalize else "raw")
    return runner.finish({
        "final_train_loss": metrics.get("loss"), **final,
        "reward_mean": rm.reward_mean, "reward_std": rm.reward_std, "normalized_over": norm_source,
        "train_data": vars(pairs.train_report), "eval_data": vars(pairs.eval_report), "data_sources": data.sources,
    }, f"done: eval accuracy {final['eval_accuracy']:.3f}, margin {next(v for k, v in final.items() if 'margin' in k):.3f} "
       f"({'normalised' if st.normalize else 'raw'} reward units)")
