"""Multi-turn generation with the in-place engine: the KV cache kept from turn to turn (TurnCache)
against computing every turn's whole trajectory again, on CPU, fp32, one process, one thread.

    .venv/bin/python benchmarks/turn_cache.py [--quick] [--out benchmarks/results/turn_cache.json]

A randomly initialised actor generates B episodes of T turns: each turn N new tokens (sampled,
temperature 1; the same seeds in both variants), then an "observation" of O random tokens is
appended to every row, as an environment's answer is. Per variant, the process CPU time of the
T generate calls (repeats interleaved, the order alternating), min and median, the positions fed
to the model, and whether both variants sampled the same tokens. Prints a markdown table and
writes JSON.

The EP2 row (also in --quick; `--ep2-only` runs just it): a mixture-of-experts actor with its
experts over 2 processes (torchrun, started by this script), each rank generating its own
episodes from the turn cache; rank 1's episodes end after their first turn while rank 0's go on.
megatron's expert all-to-all pairs the ranks' forwards, so both run as many; per rank, the
forwards run and the positions fed (counted at the model's input, idle forwards included) and
the process CPU time of the generate calls.
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


def model_shape(s: dict) -> list[str]:
    """The model section's overrides for a shape dict (FULL, QUICK, EP2)."""
    return [f"model.num_layers={s['layers']}", f"model.hidden_size={s['hidden']}",
            f"model.num_attention_heads={s['heads']}", f"model.num_query_groups={s['groups']}",
            f"model.ffn_hidden_size={s['ffn']}", f"model.vocab_size={s['vocab']}"]


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


EP2 = dict(layers=2, hidden=64, heads=4, groups=2, ffn=128, experts=4, vocab=100, batch=4, prompt=8, turns=4, new=8,
           observation=16)


def ep2_capacity(s: dict) -> int:
    """Tokens of the EP2 row's longest episode: prompts of up to 2 (batch - 1) more tokens,
    observations of up to twice `observation`."""
    return capacity_of(s) + 2 * (s["batch"] - 1) + (s["turns"] - 1) * s["observation"]


def ep2_worker(out: Path) -> None:
    """Under torchrun, 2 processes: the EP2 row (see the module docstring); rank 0 writes `out`."""
    from megatron.core import parallel_state as ps

    from megatron_rlhf import parallel
    from megatron_rlhf.config import load_config
    from megatron_rlhf.models.roles import Actor
    from megatron_rlhf.rollout import MegatronRolloutEngine, SamplingParams
    from megatron_rlhf.trainers.runner import start_distributed

    torch.set_num_threads(1)
    s = EP2
    cfg = load_config(None, [
        *model_shape(s), "model.family=mixtral", f"model.num_experts={s['experts']}", "model.moe_router_topk=2",
        f"model.max_seq_length={max(ep2_capacity(s), 64)}", "parallel.expert_parallel=2"])
    start_distributed(cfg)
    actor = Actor(cfg.model, trainable=False)
    engine = MegatronRolloutEngine(cfg.model, actor, eos_id=1, pad_id=0)
    rank = ps.get_data_parallel_rank()
    fed = {"forwards": 0, "positions": 0}

    def count(_module, args, kwargs):
        tokens = args[0] if args else kwargs["input_ids"]
        fed["forwards"] += 1
        fed["positions"] += tokens.numel()

    actor.module.register_forward_pre_hook(count, with_kwargs=True)
    g = torch.Generator().manual_seed(7 + rank)
    rows = [torch.randint(2, s["vocab"], (s["prompt"] + 2 * i,), generator=g).tolist() for i in range(s["batch"])]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=s["new"])
    cache, keys = engine.turn_cache(ep2_capacity(s)), list(range(s["batch"]))
    my_turns = s["turns"] if rank == 0 else 1  # rank 1's episodes end after their first turn
    seconds = 0.0
    for turn in range(s["turns"]):
        start = time.process_time()
        if turn < my_turns:
            turn_out = engine.generate(rows, sampling, 100 + turn, cache=cache, keys=keys)
            rows = [turn_out.tokens[i, :n].tolist() + torch.randint(2, s["vocab"], (s["observation"] * (1 + i % 2),),
                                                                 generator=g).tolist()
                    for i, n in enumerate(turn_out.lengths.tolist())]
        elif getattr(engine, "generates_without_rows", False):
            engine.generate([], sampling, 100 + turn, cache=cache, keys=[])
        else:  # an engine that needs a stand-in row (rollout/episodes.py)
            engine.generate([rows[0][:1]], sampling, 100 + turn, cache=cache, keys=[None])
        seconds += time.process_time() - start
    mine = {"rank": rank, "turns_with_episodes": my_turns, "forwards": fed["forwards"],
            "positions_fed": fed["positions"], "cpu_s": seconds}
    every = [None, None]
    torch.distributed.all_gather_object(every, mine)
    parallel.destroy()
    if rank == 0:
        out.write_text(json.dumps({"shape": s, "ranks": every}, indent=1) + "\n")


def ep2_rows(work: Path) -> list[dict]:
    """The EP2 row's per-rank numbers, from a 2-process torchrun of this script."""
    import subprocess
    import sys

    out = work / "turn_cache_ep2.json"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
                    "--ep2-worker", "--out", str(out)], check=True)
    return json.loads(out.read_text())["ranks"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny model, 2 turns, one repeat (the tests)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/turn_cache.json"))
    ap.add_argument("--ep2-only", action="store_true", help="only the EP2 row (2 processes)")
    ap.add_argument("--ep2-worker", action="store_true", help=argparse.SUPPRESS)  # under torchrun: ep2_worker
    args = ap.parse_args()
    if args.ep2_worker:
        return ep2_worker(args.out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.ep2_only:
        ranks = ep2_rows(args.out.parent)
        print_ep2(ranks)
        args.out.write_text(json.dumps({"quick": args.quick, "ep2": ranks}, indent=1) + "\n")
        return None
    torch.set_num_threads(1)
    from megatron_rlhf import parallel
    from megatron_rlhf.config import load_config
    from megatron_rlhf.models.roles import Actor
    from megatron_rlhf.rollout import MegatronRolloutEngine
    from megatron_rlhf.trainers.runner import start_distributed

    s = QUICK if args.quick else FULL
    capacity = capacity_of(s)
    # 64: the stages' default seq_length
    cfg = load_config(None, [*model_shape(s), f"model.max_seq_length={max(capacity, 64)}"])
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
    result["ep2"] = ep2_rows(args.out.parent)
    print_ep2(result["ep2"])
    args.out.write_text(json.dumps(result, indent=1) + "\n")


def print_ep2(ranks: list[dict]) -> None:
    s = EP2
    print(f"\nEP2 (experts over 2 processes): {s['batch']} episodes a rank from the turn cache, {s['new']} new "
          f"tokens a turn; rank 0 {s['turns']} turns, rank 1 one. Forwards and positions fed at the model's input")
    print("| rank | turns with episodes | forwards | positions fed | CPU s |\n|---|---|---|---|---|")
    for r in ranks:
        print(f"| {r['rank']} | {r['turns_with_episodes']} | {r['forwards']} | {r['positions_fed']} | {r['cpu_s']:.3f} |")


if __name__ == "__main__":
    main()
