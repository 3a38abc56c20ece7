"""torchrun worker (one process) for tests/test_lora_sft_dpo.py: log-probs of the policy a LoRA
checkpoint trained, from a frozen Reference loaded from it (checkpoint.dist merges its chain of
bases on load), with the model config the checkpoint recorded.

    --ckpt ITER_DIR --out FILE.pt    ->  {"tokens": [4, 24], "logprobs": [4, 24]}
"""

import argparse
import dataclasses
from pathlib import Path

import torch

from megatron_rlhf import parallel
from megatron_rlhf.checkpoint.dist import load_role
from megatron_rlhf.checkpoint.validate import recorded_model_config
from megatron_rlhf.config import load_config
from megatron_rlhf.models.roles import Reference
from megatron_rlhf.trainers.runner import start_distributed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    cfg = load_config(None, [])
    cfg = dataclasses.replace(cfg, model=recorded_model_config(args.ckpt))
    start_distributed(cfg)
    reference = Reference(cfg.model)
    load_role(reference, args.ckpt / "actor", with_optimizer=False)
    tokens = torch.randint(0, cfg.model.token_vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))
    logprobs = reference.forward({"tokens": tokens}, micro_batch_size=4)["logprobs"]
    torch.save({"tokens": tokens, "logprobs": logprobs}, args.out)
    parallel.destroy()


if __name__ == "__main__":
    main()
