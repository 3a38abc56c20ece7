"""Peak memory of PPO's four roles with and without LoRA.

    python benchmarks/lora_memory.py [--quick] [--size 135m] [--out benchmarks/results/lora_memory.json]

Each row is its own process (one thread, TP1 PP1, fp32, DistributedOptimizer): the RL stage's
roles as `trainers/rl.py: build_roles` makes them (actor, reference, reward model, critic; with
LoRA the reference is the actor without adapters and both trained roles train adapters only),
then what one PPO iteration does with them on random tokens: the score phase's four forwards
and one actor and one critic optimizer step. Reported: trainable parameters, weights, gradient
buffers and optimizer state as every stage summary's memory account has them, and peak RSS
above the RSS after imports. Prints a table and writes JSON.
--quick: a tiny model (tests/test_benchmarks.py runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SIZES = {
    "tiny": dict(layers=2, hidden=64, heads=4, groups=4, ffn=128, vocab=1024, seq=64, micro=4),
    "135m": dict(layers=30, hidden=576, heads=9, groups=3, ffn=1536, vocab=49152, seq=256, micro=4),
}
ROWS = {"full": 0, "lora r8": 8, "lora r64": 64}


def worker(size: str, rank: int, out: Path) -> None:
    import torch

    torch.set_num_threads(1)
    from megatron_rlhf import parallel
    from megatron_rlhf.trainers.runner import start_distributed
    from megatron_rlhf.colocation import current_memory_bytes, peak_memory_bytes
    from megatron_rlhf.config import load_config
    from megatron_rlhf.logging.memory import memory_account
    from megatron_rlhf.models.roles import summed
    from megatron_rlhf.trainers.rl import build_roles

    s = SIZES[size]
    cfg = load_config(None, [
        f"model.num_layers={s['layers']}", f"model.hidden_size={s['hidden']}", f"model.num_attention_heads={s['heads']}",
        f"model.num_query_groups={s['groups']}", f"model.ffn_hidden_size={s['ffn']}", f"model.vocab_size={s['vocab']}",
        f"model.max_seq_length={s['seq']}", f"lora.rank={rank}", f"lora.alpha={2 * max(rank, 1)}",
    ])
    start_distributed(cfg)
    baseline = current_memory_bytes()
    roles = build_roles(cfg)
    tokens = torch.randint(0, s["vocab"], (s["micro"], s["seq"]))
    batch = {"tokens": tokens, "lengths": torch.full((s["micro"],), s["seq"])}
    start = time.perf_counter()
    for name in ("actor", "reference", "reward", "critic"):  # the score phase
        roles[name].forward(batch, s["micro"])
    roles["actor"].train_step(batch, s["micro"], lambda o, mb: (*summed(-o["logprobs"] - 0.01 * o["entropy"]), {}))
    roles["critic"].train_step(batch, s["micro"], lambda o, mb: (*summed(o["values"] ** 2), {}))
    seconds = time.perf_counter() - start
    account = memory_account(roles, peak_memory_bytes(), baseline)
    per_role = account.pop("roles")
    totals = {k: sum(r[k] for r in per_role.values())
              for k in ("weights", "gradient_buffers", "optimizer_state", "trainable_parameters")}
    out.write_text(json.dumps({"seconds": seconds, **account, **totals,
                               "params_per_model": sum(p.numel() for p in roles["actor"].module.parameters()),
                               "roles": per_role}))
    parallel.destroy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny size: does it run")
    ap.add_argument("--size", choices=sorted(SIZES), default="135m")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/lora_memory.json")
    ap.add_argument("--worker", nargs=2, metavar=("SIZE", "RANK"))
    ap.add_argument("--worker-out", type=Path)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker[0], int(args.worker[1]), args.worker_out)

    size = "tiny" if args.quick else args.size
    rows = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for label, rank in ROWS.items():
        tmp = args.out.with_suffix(f".{rank}.tmp")
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                               __file__, "--worker", size, str(rank), f"--worker-out={tmp}"],
                              env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{size} {label}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
        rows.append({"size": size, "row": label, "lora_rank": rank, **json.loads(tmp.read_text())})
        tmp.unlink()
    mib = 2**20
    print(f"{'size':<5} {'row':<9} {'trainable':>10} {'weights MiB':>11} {'grads MiB':>9} {'optimizer MiB':>13} "
          f"{'state MiB':>9} {'peak above MiB':>14} {'seconds':>7}")
    for r in rows:
        print(f"{r['size']:<5} {r['row']:<9} {r['trainable_parameters']:>10} {r['weights'] / mib:>11.0f} "
              f"{r['gradient_buffers'] / mib:>9.1f} {r['optimizer_state'] / mib:>13.1f} {r['model_state_bytes'] / mib:>9.0f} "
              f"{r['peak_above_baseline_bytes'] / mib:>14.0f} {r['seconds']:>7.1f}")
    args.out.write_text(json.dumps({"benchmark": "PPO roles (score forwards + actor and critic steps) peak RSS, "
                                                 "full fine-tuning vs LoRA, fp32, CPU, TP1 PP1",
                                    "quick": args.quick, "shape": SIZES[size], "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
