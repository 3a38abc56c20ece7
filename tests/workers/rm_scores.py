"""torchrun worker for tests/test_reward_http.py: the in-process reward model's scores.

Loads the reward model of an RM checkpoint the way the RL stage does (rl.py: RewardModel(cfg.model),
load_role(<ckpt>/reward)) and writes its scores for the token sequences in --sequences
(JSON list of lists) to --out: what `serve-reward` must answer for the same sequences.
"""

import argparse
import json
from pathlib import Path

import torch

from megatron_rlhf import parallel  # first: it adapts megatron-core before its import
from megatron_rlhf.checkpoint.dist import load_role
from megatron_rlhf.checkpoint.manager import resolve_checkpoint
from megatron_rlhf.config import load_config
from megatron_rlhf.models.batching import padded_forward
from megatron_rlhf.models.roles import RewardModel
from megatron_rlhf.trainers.runner import start_distributed
from megatron_rlhf.trainers.stage_data import resolve_vocab_size, tokenizer_for


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--sequences", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    tokenizer = tokenizer_for(cfg)
    cfg, _ = resolve_vocab_size(cfg, tokenizer)
    start_distributed(cfg)
    reward_model = RewardModel(cfg.model)
    load_role(reward_model, resolve_checkpoint(args.ckpt) / "reward", with_optimizer=False)
    sequences = json.loads(args.sequences.read_text())
    lengths = torch.tensor([len(s) for s in sequences])
    tokens = torch.full((len(sequences), int(lengths.max())), tokenizer.pad_id, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        tokens[row, : len(sequence)] = torch.tensor(sequence)
    scores = padded_forward(reward_model, {"tokens": tokens, "lengths": lengths}, cfg.rl.micro_batch_size)["rewards"]
    if torch.distributed.get_rank() == 0:
        args.out.write_text(json.dumps(scores.tolist()))
    parallel.destroy()


if __name__ == "__main__":
    main()
