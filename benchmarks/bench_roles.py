"""Actor forward+backward+optimizer step time and peak RSS at TP1, TP2, PP2 on CPU.

    python benchmarks/bench_roles.py [--quick] [--steps 10] [--out benchmarks/results/bench_roles.json]

Each (size, layout) runs in its own torchrun launch (gloo); times are the median over
--steps steps after 2 warm-up steps, measured on global rank 0. Peak RSS is the largest
resident set of any rank (ru_maxrss). Prints a table and writes JSON.
--quick: the tiny size at TP2 only, 2 steps (tests/test_benchmarks.py runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SIZES = {
    "tiny": dict(layers=4, hidden=64, heads=4, ffn=256, seq=32, batch=8, micro=2),
    "small": dict(layers=4, hidden=256, heads=8, ffn=1024, seq=128, batch=8, micro=2),
}
LAYOUTS = {"TP1": (1, 1), "TP2": (2, 1), "PP2": (1, 2)}
QUICK = {"sizes": ["tiny"], "layouts": ["TP2"], "steps": 2}


def worker(size: str, steps: int, out: Path) -> None:
    import torch

    from megatron_rlhf import parallel
    from megatron_rlhf.trainers.runner import start_distributed
    from megatron_rlhf.config import load_config
    from megatron_rlhf.models.roles import Actor, summed

    s = SIZES[size]
    tp, pp = int(os.environ["BENCH_TP"]), int(os.environ["BENCH_PP"])
    cfg = load_config(None, [
        f"model.num_layers={s['layers']}", f"model.hidden_size={s['hidden']}",
        f"model.num_attention_heads={s['heads']}", f"model.ffn_hidden_size={s['ffn']}",
        f"model.max_seq_length={s['seq']}", "model.vocab_size=128",
        # the stages' sequence lengths may not exceed the model's (config validation)
        *(f"{stage}.seq_length={s['seq']}" for stage in ("sft", "rm", "dpo")),
        f"parallel.tensor_parallel={tp}", f"parallel.pipeline_parallel={pp}",
    ])
    start_distributed(cfg)
    actor = Actor(cfg.model, optimizer=cfg.optimizer, max_consecutive_nonfinite=cfg.resilience.max_consecutive_nonfinite)
    batch = {"tokens": torch.randint(0, 128, (s["batch"], s["seq"]))}
    loss_fn = lambda o, mb: (*summed(-o["logprobs"] - 0.01 * o["entropy"]), {})  # noqa: E731
    times = []
    for i in range(steps + 2):
        torch.distributed.barrier()
        start = time.perf_counter()
        actor.train_step(batch, s["micro"], loss_fn)
        if i >= 2:
            times.append(time.perf_counter() - start)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    torch.distributed.all_reduce(rss, op=torch.distributed.ReduceOp.MAX)
    if torch.distributed.get_rank() == 0:
        params = sum(p.numel() for p in actor.module.parameters())
        out.write_text(json.dumps({
            "step_ms": 1000 * statistics.median(times), "step_ms_min": 1000 * min(times),
            "peak_rss_mib": rss.item(), "params_rank0": params,
        }))
    parallel.destroy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny size, one layout, 2 steps: does it run")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --quick: 2)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/bench_roles.json")
    ap.add_argument("--worker", choices=sorted(SIZES))
    ap.add_argument("--worker-out", type=Path)
    args = ap.parse_args()
    if args.steps is None:
        args.steps = QUICK["steps"] if args.quick else 10
    if args.worker:
        return worker(args.worker, args.steps, args.worker_out)

    rows = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for size in QUICK["sizes"] if args.quick else SIZES:
        shape = SIZES[size]
        for layout in QUICK["layouts"] if args.quick else LAYOUTS:
            tp, pp = LAYOUTS[layout]
            tmp = args.out.with_suffix(f".{size}.{layout}.tmp")
            env = {**os.environ, "BENCH_TP": str(tp), "BENCH_PP": str(pp), "PYTHONWARNINGS": "ignore"}
            proc = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp * pp}",
                 __file__, f"--worker={size}", f"--steps={args.steps}", f"--worker-out={tmp}"],
                env=env, capture_output=True, text=True,
            )
            if proc.returncode:
                raise SystemExit(f"{size} {layout}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
            rows.append({"size": size, "layout": layout, **shape, **json.loads(tmp.read_text())})
            tmp.unlink()
    print(f"{'size':<6} {'layout':<6} {'hidden':>6} {'seq':>4} {'batch':>5} {'step ms':>8} {'min ms':>7} {'peak RSS MiB':>12}")
    for r in rows:
        print(f"{r['size']:<6} {r['layout']:<6} {r['hidden']:>6} {r['seq']:>4} {r['batch']:>5} "
              f"{r['step_ms']:>8.1f} {r['step_ms_min']:>7.1f} {r['peak_rss_mib']:>12.0f}")
    args.out.write_text(json.dumps({"benchmark": "actor train_step (fwd+bwd+Adam), fp32, CPU gloo",
                                    "quick": args.quick, "steps": args.steps, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
