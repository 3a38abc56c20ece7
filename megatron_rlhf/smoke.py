"""A tiny distributed smoke run: the four roles at the configured TP x PP layout.

Builds actor, reference, critic and reward model, runs each forward over a random batch
and one optimizer step of each trainable role, and prints what it measured. It proves the
megatron-core stack works on this machine before any stage is run.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from megatron_rlhf import parallel
from megatron_rlhf.config import Config
from megatron_rlhf.models.roles import Actor, Critic, Reference, RewardModel, summed
from megatron_rlhf.trainers.runner import start_distributed


def run(cfg: Config, batch_size: int = 8, micro_batch_size: int = 2, seq_len: int = 32) -> dict:
    env = start_distributed(cfg)
    if cfg.model.vocab_size is None:  # the tokenizer's size, as in the stages
        from megatron_rlhf.trainers.stage_data import resolve_vocab_size, tokenizer_for

        cfg, _ = resolve_vocab_size(cfg, tokenizer_for(cfg))
    g = torch.Generator().manual_seed(cfg.seed)
    seq_len = min(seq_len, cfg.model.max_seq_length)
    batch = {
        "tokens": torch.randint(0, cfg.model.vocab_size, (batch_size, seq_len), generator=g),
        "lengths": torch.full((batch_size,), seq_len),
    }
    losses = {  # LossFn: (sum, units, stats); the step takes the global-batch mean
        Actor: lambda o, mb: (*summed(-o["logprobs"] - 0.01 * o["entropy"]), {}),
        Critic: lambda o, mb: (*summed(o["values"] ** 2), {}),
        RewardModel: lambda o, mb: (*summed(-F.logsigmoid(o["rewards"][0::2] - o["rewards"][1::2])), {}),
    }
    report = {}
    for cls in (Actor, Reference, Critic, RewardModel):
        role = (cls(cfg.model) if cls is Reference else
                cls(cfg.model, trainable=True, optimizer=cfg.optimizer, seed=cfg.seed,
                    max_consecutive_nonfinite=cfg.resilience.max_consecutive_nonfinite))
        start = time.perf_counter()
        outputs = role.forward(batch, micro_batch_size)
        row = {"forward_s": time.perf_counter() - start}
        row.update({k: float(v.float().mean()) for k, v in outputs.items()})
        if cls in losses:
            start = time.perf_counter()
            metrics = role.train_step(batch, micro_batch_size, losses[cls])
            row.update(train_step_s=time.perf_counter() - start, loss=metrics["loss"], grad_norm=metrics["grad_norm"])
        report[cls.__name__] = row
    if env.rank == 0:
        layout = f"TP{cfg.parallel.tensor_parallel} PP{cfg.parallel.pipeline_parallel} world {env.world_size}"
        print(f"megatron_rlhf smoke run: {layout}, batch {batch_size}x{seq_len}, microbatch {micro_batch_size}")
        for name, row in report.items():
            print(f"  {name:<12} " + "  ".join(f"{k}={v:.4g}" for k, v in row.items()))
    parallel.destroy()
    return report
