"""Seconds per RL phase, samples/s, tokens/s and memory for PPO and a critic-free algorithm
(GRPO) on the tiny recipe on CPU.

    python benchmarks/rl_step.py [--quick] [--iterations 3] [--out benchmarks/results/rl_step.json]

Runs the RL stage's own phase functions (generate -> score -> advantages -> train) on
randomly initialised roles of the tiny_cpu model, so every response runs to the full 32 new
tokens; 4 epochs; 16 sequences per iteration (PPO: 16 prompts; GRPO: 4 prompts x 4 samples).
One process per algorithm (TP1 PP1), so each peak RSS is its own. Also the bytes of model
state each algorithm holds (weights of every role; gradient buffers and Adam states of the
trained ones, measured as the stage summary's memory_account counts them): what the missing
critic saves, independent of the allocator. Times are means over
--iterations after one warm-up iteration. Prints a table, writes JSON.
--quick: PPO only, 4 sequences of 8 new tokens, 2 epochs, 1 iteration (tests/test_benchmarks.py runs it).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RECIPES = {"ppo": "pipelines/tiny_cpu.yaml", "grpo": "pipelines/tiny_cpu_grpo.yaml"}  # grpo: n=4, k3 in the loss
# sequences per iteration, new tokens per response, epochs, mini and micro batch (sequences)
FULL = dict(sequences=16, new_tokens=32, epochs=4, mini=8, micro=4)
QUICK = dict(sequences=4, new_tokens=8, epochs=2, mini=4, micro=4, algorithms=["ppo"], iterations=1)


def run(algorithm: str, iterations: int, quick: bool = False) -> dict:
    from megatron_rlhf import parallel
    from megatron_rlhf.trainers.runner import start_distributed
    from megatron_rlhf.colocation import ColocationScheduler, phases_for
    from megatron_rlhf.config import load_config
    from megatron_rlhf.data.encode import EncodedPrompt
    from megatron_rlhf.data.jsonl import PromptExample
    from megatron_rlhf.logging.memory import memory_account
    from megatron_rlhf.rewards import RewardSources
    from megatron_rlhf.rollout import MegatronRolloutEngine, SamplingParams
    from megatron_rlhf.trainers import rl as stage
    from megatron_rlhf.trainers.stage_data import resolve_vocab_size, tokenizer_for

    size = QUICK if quick else FULL
    n = load_config(REPO / RECIPES[algorithm]).rl.n_samples_per_prompt
    cfg = load_config(REPO / RECIPES[algorithm], [
        f"rl.rollout_batch_size={size['sequences'] // n}", f"rl.mini_batch_size={size['mini']}",
        f"rl.micro_batch_size={size['micro']}", f"rl.epochs={size['epochs']}",
        f"sampling.max_new_tokens={size['new_tokens']}", "rl.steps=100"])
    cfg, _ = resolve_vocab_size(cfg, tokenizer_for(cfg))  # the built-in task's, as a stage would
    start_distributed(cfg)
    roles = stage.build_roles(cfg)
    trained = {k: roles[k] for k in ("actor", "critic") if k in roles}
    sched = ColocationScheduler(roles, phases_for(roles))
    engine = MegatronRolloutEngine(cfg.model, roles["actor"], eos_id=-1, pad_id=0)  # no EOS: full-length responses
    sampling = SamplingParams(max_new_tokens=size["new_tokens"])
    g = torch.Generator().manual_seed(0)
    prompts = [EncodedPrompt(torch.randint(3, cfg.model.vocab_size, (int(k),), generator=g).tolist(), PromptExample("-"))
               for k in torch.randint(3, 7, (size["sequences"] // n,), generator=g)]
    rewards = RewardSources(cfg.rl.rewards, roles.get("reward"), micro_batch_size=cfg.rl.micro_batch_size,
                            micro_batch_tokens=cfg.rl.micro_batch_tokens)
    score_fn = partial(stage.sequence_rewards, rewards, tokenizer=tokenizer_for(cfg), rl=cfg.rl)
    for it in range(iterations + 1):
        if it == 1:
            sched.stats.clear()  # drop the warm-up iteration
        with sched.phase("generate") as phase:
            generation = stage.generate(engine, score_fn, lambda: prompts, cfg.rl, sampling, seed=it)
            rollout = generation.rollout
            phase.tokens = int(rollout.response_lengths().sum())
        with sched.phase("score") as phase:
            batch = stage.score(rollout, generation.rewards or score_fn(rollout, generation.rows), roles, cfg.rl)
            phase.tokens = int(rollout.lengths.sum())
        with sched.phase("train") as phase:
            stage.add_advantages(batch, cfg.rl, 0.05, cfg.sampling.max_new_tokens)
            stage.train_on_rollout(trained, batch, cfg.rl, 0.05, seed=it)
            phase.tokens = int(rollout.lengths.sum()) * cfg.rl.epochs
    phases = {p: {"seconds": v["seconds"] / iterations, "tokens_per_s": v["tokens_per_s"]}
              for p, v in sched.summary().items()}
    total = sum(p["seconds"] for p in phases.values())
    state = memory_account(roles, 0, 0)["model_state_bytes"]  # as the stage summaries count it
    parallel.destroy()
    return {"algorithm": algorithm, "roles": sorted(roles), "sequences": len(rollout),
            "response_tokens": size["new_tokens"], "epochs": size["epochs"], "phases": phases,
            "seconds_per_iteration": total, "samples_per_s": len(rollout) / total,
            "tokens_per_s": float(rollout.lengths.sum()) / total,
            "model_state_mib": state / 2**20,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="PPO only, 4 short sequences, 1 iteration: does it run")
    ap.add_argument("--iterations", type=int, default=None, help="measured iterations (default 3; --quick: 1)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/rl_step.json")
    ap.add_argument("--one", choices=sorted(RECIPES), help=argparse.SUPPRESS)  # child process
    args = ap.parse_args()
    if args.iterations is None:
        args.iterations = QUICK["iterations"] if args.quick else 3
    if args.one:
        print(json.dumps(run(args.one, args.iterations, args.quick)))
        return
    rows = []
    for algorithm in QUICK["algorithms"] if args.quick else RECIPES:
        proc = subprocess.run([sys.executable, __file__, "--one", algorithm, "--iterations", str(args.iterations),
                               *(["--quick"] if args.quick else [])], capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{algorithm}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"{'algorithm':>9} {'roles':>5} {'generate s':>10} {'score s':>8} {'train s':>8} {'iter s':>7} "
          f"{'samples/s':>9} {'state MiB':>9} {'peak RSS MiB':>12}")
    for r in rows:
        p = r["phases"]
        print(f"{r['algorithm']:>9} {len(r['roles']):>5} {p['generate']['seconds']:>10.2f} {p['score']['seconds']:>8.2f} "
              f"{p['train']['seconds']:>8.2f} {r['seconds_per_iteration']:>7.2f} {r['samples_per_s']:>9.2f} "
              f"{r['model_state_mib']:>9.2f} {r['peak_rss_mib']:>12.0f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "RL iteration phases, tiny_cpu model, fp32, CPU, TP1 PP1",
                                    "quick": args.quick, "iterations": args.iterations, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
