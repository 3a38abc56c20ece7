"""Does the way a batch is split change what SFT learns? Weights after a few SFT steps at one
global batch, split into different micro batches and data-parallel ranks.

    python benchmarks/split_invariance.py [--quick] [--steps 3] [--only SPLIT ...]
        [--out benchmarks/results/split_invariance.json]

Runs `python -m megatron_rlhf sft` (the CLI users run) on the default recipe, global batch 32,
with micro batch 16, 4 and 1 on one process, micro batch 16 and 4 on two data-parallel
processes, TP2 and PP2; then compares every weight with a reference split (SPLITS). With a
true global token mean the splits agree to float rounding; with a per-microbatch mean they
do not (tokens in short microbatches weigh more). Prints a table, writes JSON. Each run
costs ~15-25 s on 2 cores. --quick: mbs4 against mbs16 only, 2 steps, a smaller generated
data set (tests/test_benchmarks.py runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

REPO = Path(__file__).resolve().parent.parent
# name -> (processes, overrides, the run it is compared with). SFT starts from a random
# initialisation, which is identical at TP1 and TP2 (megatron initialises the full matrix on
# the CPU, then splits it) but not at PP2 (each stage seeds its layers differently): PP2
# runs are compared with each other.
SPLITS = {
    "mbs16": (1, ["sft.micro_batch_size=16"], None),
    "mbs4": (1, ["sft.micro_batch_size=4"], "mbs16"),
    "mbs1": (1, ["sft.micro_batch_size=1"], "mbs16"),
    "dp2_mbs16": (2, ["sft.micro_batch_size=16"], "mbs16"),
    "dp2_mbs4": (2, ["sft.micro_batch_size=4"], "mbs16"),
    "tp2_mbs4": (2, ["sft.micro_batch_size=4", "parallel.tensor_parallel=2"], "mbs16"),
    "pp2_mbs16": (2, ["sft.micro_batch_size=16", "parallel.pipeline_parallel=2"], None),
    "pp2_mbs4": (2, ["sft.micro_batch_size=4", "parallel.pipeline_parallel=2"], "pp2_mbs16"),
}
THRESHOLD = 1e-4
QUICK = dict(only=["mbs4"], steps=2, overrides=["data.task_sizes.sft_train=256", "data.task_sizes.sft_eval=32"])


def run_sft(root: Path, name: str, nproc: int, overrides: list[str], steps: int, extra: list[str] = ()) -> Path:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "megatron_rlhf", "sft", "--config", "pipelines/tiny_cpu.yaml",
           f"checkpoint.root={root}", f"checkpoint.run_name={name}", f"sft.steps={steps}",
           "sft.global_batch_size=32", f"sft.eval_interval={steps}", "sft.save_interval=0",
           "sft.optimizer.warmup_steps=0", "logging.tensorboard=false", *extra, *overrides]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
    return root / name / "sft" / f"iter_{steps:07d}" / "actor"


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    out = checkpoint.with_suffix(".full.pt")
    dcp_to_torch_save(checkpoint, out)
    state = torch.load(out, weights_only=False)
    return {k: v.float() for k, v in state.items()
            if isinstance(v, torch.Tensor) and not k.startswith("optimizer") and "_extra_state" not in k}


def compare(want: dict, got: dict) -> dict[str, float]:
    diffs = torch.cat([(want[k] - got[k]).abs().flatten() for k in want])
    return {"max_abs_diff": diffs.max().item(), "fraction_over_threshold": (diffs > THRESHOLD).float().mean().item()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="mbs4 vs mbs16, 2 steps, less data: does it run")
    ap.add_argument("--steps", type=int, default=None, help="SFT steps (default 3; --quick: 2)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/split_invariance.json")
    ap.add_argument("--only", nargs="*", help="subset of splits to run")
    args = ap.parse_args()
    if args.steps is None:
        args.steps = QUICK["steps"] if args.quick else 3
    if args.quick and args.only is None:
        args.only = QUICK["only"]
    extra = QUICK["overrides"] if args.quick else []
    names = [n for n in SPLITS if not args.only or n in args.only or n in {SPLITS[m][2] for m in args.only}]
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = {n: run_sft(Path(tmp), n, *SPLITS[n][:2], args.steps, extra) for n in names}
        rows = {n: {"compared_with": SPLITS[n][2], **compare(weights(ckpts[SPLITS[n][2]]), weights(ckpts[n]))}
                for n in names if SPLITS[n][2]}
    print(f"SFT, {args.steps} steps, global batch 32: final weights of each split vs a reference split")
    print(f"{'split':<11} {'vs':<10} {'max |dw|':>10} {'share of weights |dw| > 1e-4':>30}")
    for name, row in rows.items():
        print(f"{name:<11} {row['compared_with']:<10} {row['max_abs_diff']:>10.2e} "
              f"{row['fraction_over_threshold']:>29.1%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"quick": args.quick, "steps": args.steps, "overrides": extra,
                                    "threshold": THRESHOLD, "splits": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
