"""torchrun worker for tests/test_hf_moe.py: mixture-of-experts HF models (Qwen3-MoE, Mixtral) into
our roles at TP x PP x EP layouts.

The test writes tiny random HF models under --root/hf/<variant> (policies qwen3_moe, mixtral;
reward models qwen3_moe_rm, mixtral_rm; broken copies of qwen3_moe) and a token batch to
--root/batch.pt; the launch's model.* overrides are qwen3_moe's (they only size the layout's
config). At each layout of the launch (`--layout NAME=TPxPP[:key=value...]`, workers.run_layouts)
the worker
  1. loads both policies with load_hf_weights and records our full logits and log-probs;
  2. at the --import-at layout: loads the reward models (rewards, per-token values), imports
     every variant with import_hf into --root/import/<variant>, and records the refusals of
     the broken directories;
  3. at each --reload layout (after --import-at's launch): loads the imported policies with
     load_role (written at another EP / TP) and records their outputs.
Results go to --root/results_<layout>.pt (global rank 0).
"""

import dataclasses
import sys

import torch

from megatron_rlhf.checkpoint.dist import load_role
from megatron_rlhf.config import load_config
from megatron_rlhf.convert import ConvertError, hf_overrides, import_hf, load_hf_weights
from workers import run_layouts
from workers.hf_convert import LogitsActor, ValuesRewardModel

POLICIES = ("qwen3_moe", "mixtral")
REWARD_MODELS = ("qwen3_moe_rm", "mixtral_rm")
BROKEN = ("missing_expert", "wrong_shape", "fused")  # copies of qwen3_moe
MBS = 2


def variant_cfg(args, variant: str, parallel):
    cfg = load_config(None, hf_overrides(args.root / "hf" / variant) + ["model.max_seq_length=64"])
    return dataclasses.replace(cfg, parallel=parallel)  # the layout's (megatron's groups are started)


def outputs(role, batch):
    return {k: v.detach().cpu() for k, v in role.forward(batch, MBS).items()}


def check_layout(args, cfg, layout: str) -> None:
    batch = torch.load(args.root / "batch.pt")
    hf = args.root / "hf"
    cfgs = {v: variant_cfg(args, v, cfg.parallel) for v in (*POLICIES, *REWARD_MODELS)}
    results = {"loaded": {}, "reloaded": {}, "refused": {}}
    for variant in POLICIES:
        actor = LogitsActor(cfgs[variant].model, trainable=False)
        load_hf_weights(actor, hf / variant)
        results["loaded"][variant] = outputs(actor, {"tokens": batch["tokens"]})

    if layout == args.import_at:
        for variant in REWARD_MODELS:
            rm = ValuesRewardModel(cfgs[variant].model)
            load_hf_weights(rm, hf / variant)
            results["loaded"][variant] = outputs(rm, batch)
        for variant in (*POLICIES, *REWARD_MODELS):
            import_hf(cfgs[variant], hf / variant, args.root / "import" / variant)
        for broken in BROKEN:  # refused on every rank
            try:
                load_hf_weights(LogitsActor(cfgs["qwen3_moe"].model, trainable=False), hf / broken)
            except ConvertError as e:
                results["refused"][broken] = str(e)

    if layout in (args.reload or ()):
        for variant in POLICIES:
            actor = LogitsActor(cfgs[variant].model, trainable=False)
            load_role(actor, args.root / "import" / variant / "iter_0000000" / "actor", with_optimizer=False)
            results["reloaded"][variant] = outputs(actor, {"tokens": batch["tokens"]})

    if torch.distributed.get_rank() == 0:
        torch.save(results, args.root / f"results_{layout}.pt")


if __name__ == "__main__":
    sys.exit(run_layouts(check_layout, extra_args=[
        ("--import-at", {"metavar": "LAYOUT", "help": "the layout that imports every variant"}),
        ("--reload", {"metavar": "LAYOUT", "action": "append", "help": "a layout that loads the imports (repeatable)"})]))
