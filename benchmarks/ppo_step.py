"""Seconds per PPO phase, samples/s and tokens/s for the tiny recipe on CPU.

    python benchmarks/ppo_step.py [--iterations 3] [--out benchmarks/results/ppo_step.json]

Runs the PPO stage's own phase functions (generate -> score -> advantages -> train) on
randomly initialised roles of the tiny_cpu model, so every response runs to the full 32
new tokens; 4 PPO epochs; rollout batches of 8 and 16 prompts. One process (TP1 PP1).
Times are means over --iterations after one warm-up iteration. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def run(batch: int, iterations: int) -> dict:
    from megatron_rlhf.colocation import ColocationScheduler
    from megatron_rlhf.config import load_config
    from megatron_rlhf.rollout import MegatronRolloutEngine, SamplingParams
    from megatron_rlhf.trainers import ppo as stage

    cfg = load_config(REPO / "pipelines/tiny_cpu.yaml", [
        f"ppo.rollout_batch_size={batch}", "ppo.mini_batch_size=8", "ppo.micro_batch_size=4",
        "ppo.ppo_epochs=4", "ppo.max_new_tokens=32", "ppo.steps=100",
    ])
    roles = stage.build_roles(cfg)
    sched = ColocationScheduler(roles)
    engine = MegatronRolloutEngine(roles["actor"], eos_id=-1, pad_id=0)  # no EOS: full-length responses
    sampling = SamplingParams(max_new_tokens=32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg.model.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 7, (batch,), generator=g)]
    for it in range(iterations + 1):
        if it == 1:
            sched.stats.clear()  # drop the warm-up iteration
        sched.enter("generate")
        rollout = engine.generate(prompts, sampling, seed=it)
        sched.exit(tokens=int((rollout.lengths - rollout.prompt_lengths).sum()))
        sched.enter("score")
        data = stage.score(rollout, roles, cfg.ppo, cfg.ppo.micro_batch_size)
        sched.exit(tokens=int(rollout.lengths.sum()))
        sched.enter("train")
        stage.add_advantages(data, cfg.ppo, 0.05)
        stage.train_on_rollout(roles["actor"], roles["critic"], data, cfg.ppo, 0.05, True, seed=it)
        sched.exit(tokens=int(rollout.lengths.sum()) * cfg.ppo.ppo_epochs)
    phases = {p: {"seconds": v["seconds"] / iterations, "tokens_per_s": v["tokens_per_s"]}
              for p, v in sched.summary().items()}
    total = sum(p["seconds"] for p in phases.values())
    return {"prompts": batch, "response_tokens": 32, "ppo_epochs": 4, "phases": phases,
            "seconds_per_iteration": total, "samples_per_s": batch / total,
            "tokens_per_s": float(rollout.lengths.sum()) / total,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/ppo_step.json")
    args = ap.parse_args()
    from megatron_rlhf import parallel
    from megatron_rlhf.config import load_config

    parallel.initialize(load_config(REPO / "pipelines/tiny_cpu.yaml"))
    rows = [run(batch, args.iterations) for batch in (8, 16)]
    parallel.destroy()
    print(f"{'prompts':>7} {'generate s':>10} {'score s':>8} {'train s':>8} {'iter s':>7} "
          f"{'samples/s':>9} {'tokens/s':>8} {'peak RSS MiB':>12}")
    for r in rows:
        p = r["phases"]
        print(f"{r['prompts']:>7} {p['generate']['seconds']:>10.2f} {p['score']['seconds']:>8.2f} "
              f"{p['train']['seconds']:>8.2f} {r['seconds_per_iteration']:>7.2f} {r['samples_per_s']:>9.2f} "
              f"{r['tokens_per_s']:>8.0f} {r['peak_rss_mib']:>12.0f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "PPO iteration phases, tiny_cpu model, fp32, CPU, TP1 PP1",
                                    "iterations": args.iterations, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
