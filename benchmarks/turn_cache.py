"""Multi-turn generation with the in-place engine: the KV cache kept from turn to turn (TurnCache)
against computing every turn's whole trajectory again, on CPU, fp32, one process, one thread.

    .venv/bin/python benchmarks/turn_cache.py [--quick] [--out benchmarks/results/turn_cache.json]

A randomly initialised actor generates B episodes of T turns: each turn N new tokens (sampled,
temperature 1; the same seeds in both variants), then an "observation" of O random tokens is
appended to every row, as an environment's answer is. Per variant, the process CPU time of the
T generate calls (repeats interleaved, the order alternating), min and median, the positions fed
to the model, and whether both variants sampled the same tokens. Prints a markdown table and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import megatron_rlhf  # noqa: F401  (first: it adapts megatron-core before its import)

FULL = dict(layers=4, hidden=256, heads=4, groups=2, ffn=512, vocab=1000, batch=8, prompt=32, turns=4, new=32,
            observation=96, repeats=5)
QUICK = dict(layers=2, hidden=64, heads=4, groups=2, ffn=128, vocab=100, batch=4, prompt=8, turns=2, new=8,
             observation=16, repeats=1)


def capacity_of(s: dict) -> int:
    """Tokens of a whole episode: the prompt, every turn, the observations between them."""
    return s["prompt"] + s["turns"] * s["new"] + (s["turns"] - 1) * s["observation"]


def episodes(engine, s: dict, cached: bool, seed: int) -> tuple[float, int, list[list[int]]]:
    """T turns of B rows: (process CPU seconds of the generate calls, positions fed, final rows)."""
    from megatron_rlhf.rollout import SamplingParams

    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(2, s["vocab"], (s["prompt"],), generator=g).tolist() for _ in range(s["batch"])]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=s["new"])
    cache = engine.turn_cache(capacity_of(s)) if cached else None
    keys = list(range(s["batch"]))
    seconds, fed = 0.0, 0
    for turn in range(s["turns"]):
        start = time.process_time()
        out = (engine.generate(rows, sampling, seed + turn, cache=cache, keys=keys) if cached
               else engine.generate(rows, sampling, seed + turn))
        seconds += time.process_time() - start
        fed += (int(out.lengths.max()) - 1) * s["batch"] if not cached else 0
        rows = [out.tokens[i, :n].tolist() for i, n in enumerate(out.lengths.tolist())]
        if turn + 1 < s["turns"]:
            rows = [r + torch.randint(2, s["vocab"], (s["observation"],), generator=g).tolist() for r in rows]
    return seconds, cache.fed_tokens if cached else fed, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny model, 2 turns, one repeat (the tests)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/turn_cache.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    from megatron_rlhf import parallel
    from megatron_rlhf.config import load_config
    from megatron_rlhf.models.roles import Actor
    from megatron_rlhf.rollout import MegatronRolloutEngine
    from megatron_rlhf.trainers.runner import start_distributed

    s = QUICK if args.quick else FULL
    capacity = capacity_of(s)
    cfg = load_config(None, [
        f"model.num_layers={s['layers']}", f"model.hidden_size={s['hidden']}", f"model.num_attention_heads={s['heads']}",
        f"model.num_query_groups={s['groups']}", f"model.ffn_hidden_size={s['ffn']}", f"model.vocab_size={s['vocab']}",
        f"model.max_seq_length={max(capacity, 64)}",  # 64: the stages' default seq_length
    ])
    start_distributed(cfg)
    actor = Actor(cfg.model, trainable=False)
    engine = MegatronRolloutEngine(cfg.model, actor, eos_id=1, pad_id=0)
    episodes(engine, {**QUICK, "vocab": s["vocab"]}, True, 0)  # warm-up: first-call costs out of the timings
    seconds = {"cache": [], "recompute": []}
    fed, final = {}, {}
    for repeat in range(s["repeats"]):
        order = ("cache", "recompute") if repeat % 2 == 0 else ("recompute", "cache")
        for variant in order:
            cpu, fed[variant], final[variant] = episodes(engine, s, variant == "cache", seed=100)
            seconds[variant].append(cpu)
    parallel.destroy()

    rows = [{"variant": v, "cpu_s_min": min(t), "cpu_s_median": statistics.median(t), "positions_fed": fed[v],
             "repeats_cpu_s": t} for v, t in seconds.items()]
    result = {"quick": args.quick, "shape": s, "capacity": capacity, "rows": rows,
              "same_tokens": final["cache"] == final["recompute"],
              "speedup_min": rows[1]["cpu_s_min"] / rows[0]["cpu_s_min"],
              "speedup_median": rows[1]["cpu_s_median"] / rows[0]["cpu_s_median"]}
    print(f"{s['batch']} episodes x {s['turns']} turns, {s['new']} new tokens a turn, {s['observation']}-token "
          f"observations (hidden {s['hidden']}, {s['layers']} layers), process CPU s of the generate calls, "
          f"{s['repeats']} interleaved repeats")
    print("| variant | CPU s min | CPU s median | positions fed |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['cpu_s_min']:.3f} | {r['cpu_s_median']:.3f} | {r['positions_fed']} |")
    print(f"recompute / cache: {result['speedup_min']:.2f}x (min), {result['speedup_median']:.2f}x (median); "
          f"same tokens: {result['same_tokens']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
