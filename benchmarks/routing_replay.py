"""Routing drift and what routing replay (R3) does about it, on a tiny MoE actor (one process, CPU).

    python benchmarks/routing_replay.py [--quick] [--steps 4] [--out benchmarks/results/routing_replay.json]

The in-place engine samples a batch of responses and records each token's experts; then the
actor takes optimizer steps on that batch (as PPO's minibatches and epochs do on one rollout),
and before each step the script measures, against the rollout:
- routing_disagreement: the fraction of routed tokens whose top-k expert set the trainer's own
  routing changes (mean and max over MoE layers);
- mismatch: mean |log pi_trainer - log pi_rollout| per response token, routing freely and replaying
  the rollout's routes (after steps this is mostly the policy's own change, which replay keeps);
  `overridden`: the fraction replay overrode in the step that follows.
Last, a rollout sampled by a bfloat16 copy of the trained weights (another engine's numerics at
the same weights, as with a separate inference engine) against the float32 trainer: there the
mismatch is all numerics, and replay removes the part the routing flips cause. Prints a table,
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODEL = ["model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
         "model.ffn_hidden_size=128", "model.vocab_size=100", "model.max_seq_length=64", "model.family=mixtral",
         "model.num_experts=8", "model.moe_router_topk=2", "model.moe_dense_layers=[0]", "model.moe_ffn_hidden_size=64",
         "model.moe_aux_loss_coef=0.0", "optimizer.lr=1e-4", "optimizer.warmup_steps=0", "seed=3"]


def response_mean(x, rollout):
    import torch

    mask = rollout.response_mask()
    return float((x.abs() * mask).sum() / mask.sum().clamp(min=1)) if torch.is_tensor(x) else x


def negative_logprob(outputs, mb):
    """SFT on the rollout's responses: a loss that moves the weights as a policy step would."""
    from megatron_rlhf.models.microbatches import real_positions

    real = real_positions(mb["lengths"], mb["tokens"].size(1), offset=1)
    return -(outputs["logprobs"] * real).sum(), real.sum().to(__import__("torch").int32), {}


def build(dtype: str, trainable: bool):
    from megatron_rlhf.config import load_config
    from megatron_rlhf.models.roles import Actor

    cfg = load_config(None, [*MODEL, f"model.params_dtype={dtype}"])
    if not trainable:
        return Actor(cfg.model, trainable=False)
    return Actor(cfg.model, trainable=True, optimizer=cfg.optimizer, seed=cfg.seed, max_consecutive_nonfinite=3)


def sample(actor, prompts: int, new_tokens: int):
    import torch

    from megatron_rlhf.rollout import MegatronRolloutEngine, SamplingParams

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 11, (prompts,), generator=g).tolist()
    batch_prompts = [torch.randint(4, 100, (n,), generator=g).tolist() for n in lengths]
    engine = MegatronRolloutEngine(actor.model_config, actor, eos_id=3, pad_id=0)
    return engine.generate(batch_prompts, SamplingParams(temperature=1.0, max_new_tokens=new_tokens), seed=1)


def against_rollout(actor, rollout) -> dict:
    """The trainer's routing and log-probs against the rollout's: routing freely, then replaying."""
    from megatron_rlhf.models.routing import stage_summary

    batch = {"tokens": rollout.tokens, "lengths": rollout.lengths, "routes": rollout.routes}
    free = actor.forward(batch, 4, compare_routes=True)["logprobs"]
    counts = actor.routes.take_disagreement(sequence_parallel=False)
    mean, top = stage_summary(counts["differing"] / counts["compared"].clamp(min=1))
    replayed = actor.forward(batch, 4)["logprobs"]
    return {"routing_disagreement_mean": mean, "routing_disagreement_max": top,
            "mismatch_without_replay": response_mean(free - rollout.logprobs, rollout),
            "mismatch_with_replay": response_mean(replayed - rollout.logprobs, rollout)}


def measure(prompts: int, new_tokens: int, steps: int) -> list[dict]:
    """Two sources of routing drift against a rollout sampled by (a) the trainer's own float32
    weights, then after each of `steps` optimizer steps on it (the weights move: PPO's later
    minibatches and epochs), and (b) a bfloat16 copy of the same weights (another engine's
    numerics, at the same weights: what a separate inference engine does)."""
    import torch

    from megatron_rlhf.config import load_config  # megatron_rlhf before megatron.core (its import fix-ups)
    from megatron_rlhf.trainers.runner import start_distributed
    from megatron.core import parallel_state  # noqa: I001

    start_distributed(load_config(None, MODEL))
    actor = build("float32", trainable=True)
    rows = []
    rollout = sample(actor, prompts, new_tokens)
    batch = {"tokens": rollout.tokens, "lengths": rollout.lengths, "routes": rollout.routes}
    for step in range(steps + 1):
        row = {"rollout": "fp32 in-place", "optimizer_steps": step, **against_rollout(actor, rollout)}
        if step < steps:
            row["overridden_in_next_step"] = actor.train_step(batch, 4, negative_logprob)["routing_replay_overridden_mean"]
        rows.append(row)
    sampler = build("bfloat16", trainable=False)  # the trained weights, rounded: another engine's numerics
    with torch.no_grad():
        for mine, theirs in zip(sampler.module.parameters(), actor.module.parameters(), strict=True):
            mine.copy_(theirs)
    rows.append({"rollout": "bf16 copy", "optimizer_steps": steps, **against_rollout(actor, sample(sampler, prompts, new_tokens))})
    parallel_state.destroy_model_parallel()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 prompts, 8 new tokens, 2 steps (tests)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "routing_replay.json")
    args = ap.parse_args()
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    prompts, new_tokens, steps = (8, 8, 2) if args.quick else (32, 24, args.steps)
    rows = measure(prompts, new_tokens, steps)
    header = ("rollout", "optimizer_steps", "routing_disagreement_mean", "routing_disagreement_max",
              "mismatch_without_replay", "mismatch_with_replay", "overridden_in_next_step")
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(f"{row[k]:.4g}" if isinstance(row.get(k), float) else str(row.get(k, "-")) for k in header))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"quick": args.quick, "prompts": prompts, "new_tokens": new_tokens,
                                    "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
