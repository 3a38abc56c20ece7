"""PPO against the critic-free algorithms on the default task: gold score before/after, KL,
wall time and peak memory, each from its own recipe (pipelines/tiny_cpu*.yaml).

    python benchmarks/rl_algorithms.py [--quick] [--root /tmp/rl_algorithms]
        [--out benchmarks/results/rl_algorithms.json] [--algorithms ppo grpo rloo reinforce_pp] [key=value ...]

Runs `python -m megatron_rlhf pipeline` per recipe under one run directory, so SFT and RM
are trained once and every algorithm starts from the same checkpoints (<root>/tiny_cpu/<algorithm>).
One process each (the recipes' CPU layout); a finished algorithm is not rerun. Peak memory is
the RL stage process's peak RSS (CPU: includes the Python/torch/megatron footprint, which all
algorithms share). Prints a table, writes JSON.
--quick: PPO only, 2 SFT and 2 RM steps, 1 RL iteration on a small generated data set (QUICK), in a
fresh temporary root unless --root is given (tests/test_benchmarks.py runs it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECIPES = {"ppo": "tiny_cpu.yaml", "grpo": "tiny_cpu_grpo.yaml", "rloo": "tiny_cpu_rloo.yaml",
           "reinforce_pp": "tiny_cpu_reinforce_pp.yaml"}
QUICK = dict(algorithms=["ppo"], overrides=[
    *(f"{stage}.{key}={value}" for stage in ("sft", "rm") for key, value in
      (("steps", 2), ("eval_interval", 2), ("save_interval", 0), ("optimizer.warmup_steps", 0))),
    "rl.steps=1", "rl.eval_interval=1", "rl.rollout_batch_size=4", "rl.mini_batch_size=4", "rl.micro_batch_size=4",
    "sampling.max_new_tokens=8", "data.task_sizes.sft_train=64", "data.task_sizes.sft_eval=16",
    "data.task_sizes.preference_train=64", "data.task_sizes.preference_eval=16", "data.task_sizes.ppo_prompts=16",
    "data.task_sizes.eval_prompts=8"])


def run_all(args) -> list[dict]:
    """One pipeline per algorithm under args.root: a row of each one's summary."""
    rows = []
    for algorithm in args.algorithms:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               "-m", "megatron_rlhf", "pipeline", "--config", str(REPO / "pipelines" / RECIPES[algorithm]),
               f"checkpoint.root={args.root}", *args.overrides]
        subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        s = json.loads((args.root / "tiny_cpu" / algorithm / "summary.json").read_text())
        rows.append({
            "algorithm": algorithm, "roles": s["roles"],
            "gold_before": s["gold_score_eval_before"], "gold_after": s["gold_score_eval_after"],
            "gold_gain": s["gold_score_eval_after"] - s["gold_score_eval_before"],
            "reward_before": s["reward_eval_before"], "reward_after": s["reward_eval_after"],
            "kl_final": s["kl_mean_final"], "wall_seconds": s["wall_seconds"],
            "peak_rss_mib": s["peak_memory_bytes"] / 2**20,
            "train_phase_peak_mib": s["phase_peak_memory_bytes"]["train"] / 2**20,
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="PPO only, a few steps of each stage: does it run")
    ap.add_argument("--root", type=Path, help="run directory (default /tmp/rl_algorithms; --quick: a temporary one)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/rl_algorithms.json")
    ap.add_argument("--algorithms", nargs="+", choices=sorted(RECIPES),
                    help="default: all (--quick: ppo)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    args.algorithms = args.algorithms or (QUICK["algorithms"] if args.quick else list(RECIPES))
    if args.quick:
        args.overrides = [*QUICK["overrides"], *args.overrides]
    with tempfile.TemporaryDirectory() as tmp:
        if args.root is None:
            args.root = Path(tmp) if args.quick else Path("/tmp/rl_algorithms")
        rows = run_all(args)
    print(f"{'algorithm':>12} {'roles':>5} {'gold before':>11} {'gold after':>10} {'gain':>6} {'KL final':>8} "
          f"{'wall s':>7} {'peak RSS MiB':>12}")
    for r in rows:
        print(f"{r['algorithm']:>12} {len(r['roles']):>5} {r['gold_before']:>11.3f} {r['gold_after']:>10.3f} "
              f"{r['gold_gain']:>6.3f} {r['kl_final']:>8.3f} {r['wall_seconds']:>7.1f} {r['peak_rss_mib']:>12.0f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "RL algorithms on the default task (tiny_cpu recipes, CPU, 1 process)",
                                    "quick": args.quick, "overrides": args.overrides, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
