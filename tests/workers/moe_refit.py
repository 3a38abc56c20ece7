"""torchrun worker for tests/test_refit_moe.py: the vLLM refit stream (rollout/refit.py) of
mixture-of-experts actors at EP x TP x PP layouts, without an engine.

The test writes tiny random HF models under --root/hf/<variant> (Qwen3-MoE with a dense layer,
Mixtral: tests/test_hf_moe.py's). At each layout of the launch (`--layout NAME=TPxPP[:key=value...]`,
workers.run_layouts) the worker loads each variant into an actor with load_hf_weights, streams
its weights with stream_hf_weights in buckets of at most --bucket-bytes, and every engine rank
(one per data-parallel replica) writes the buckets it received, in order, to
--root/refit_<layout>_<variant>_rank<r>.pt. At the --measure-at layout, it streams Qwen3-MoE
once more, one tensor per bucket, and rank 0 measures the tensor memory the refit holds beyond
the model and the bucket at each bucket (workers/lora_refit_memory.py's measure), into
--root/held_bytes.pt ({the bucket's tensor name: bytes}).
"""

import sys

import torch

from megatron_rlhf.convert import load_hf_weights
from megatron_rlhf.models.roles import Actor
from megatron_rlhf.rollout.refit import RefitPlan, stream_hf_weights
from workers import run_layouts
from workers.hf_moe import POLICIES, variant_cfg
from workers.lora_refit_memory import refit


def check_layout(args, cfg, layout: str) -> None:
    for variant in POLICIES:
        model_cfg = variant_cfg(args, variant, cfg.parallel).model
        actor = Actor(model_cfg, trainable=False)
        load_hf_weights(actor, args.root / "hf" / variant)
        plan = RefitPlan.build(actor.module, model_cfg)
        buckets = [{name: t.detach().cpu().clone() for name, t in bucket.items()}
                   for bucket in stream_hf_weights(actor.module, model_cfg, plan, int(args.bucket_bytes))]
        rank = torch.distributed.get_rank()
        if rank == plan.engine_rank:
            torch.save(buckets, args.root / f"refit_{layout}_{variant}_rank{rank}.pt")
        else:
            assert not buckets, "only the engine rank receives buckets"
        if layout == args.measure_at and variant == "qwen3_moe":
            held: dict[str, int] = {}
            refit(actor.module, variant_cfg(args, variant, cfg.parallel), plan, measure=rank == 0, held_at=held)
            if rank == 0:
                torch.save(held, args.root / "held_bytes.pt")


if __name__ == "__main__":
    sys.exit(run_layouts(check_layout, extra_args=[("--bucket-bytes", {"required": True}),
                                                       ("--measure-at", {"metavar": "LAYOUT"})]))
