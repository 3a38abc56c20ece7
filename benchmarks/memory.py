"""Peak memory of an actor train step against its memory account, with and without megatron's
activation recomputation, and of a checkpoint save after it.

    python benchmarks/memory.py [--quick] [--size 135m] [--recompute none] [--out benchmarks/results/memory.json]

Each row is its own process (one thread, TP1 PP1): an Actor (fp32, DistributedOptimizer) takes
2 steps of a loss over log-probs and entropy (what SFT and PPO's actor compute) on random
tokens. Reported: the account as every stage summary has it (logging/memory.py: weights +
gradient buffers + Adam state, plus the activations the microbatch kept for backward), peak RSS
above the RSS after imports, the ratios, and what one [micro x seq x vocab] fp32 copy of the
logits weighs. Then the actor is saved through CheckpointManager (as a stage saves it, to a
temporary directory): the save's peak RSS (its RSS at the start plus what MemoryGrowth saw it
add) against the train phase's peak (the process's peak RSS before the save), and whether the
save raised the process's peak (its peak after the save over before). Prints a table and
writes JSON.

Then the sequence-length table (issue 38): the same actor at micro batch 1 and sequence
lengths --lengths, with model.logits_chunk_tokens 0 (the whole [s x vocab] logits, kept for
backward) and each of --chunks (models/vocab_parallel.py: a chunk's logits at a time), each
row its own process, repeats interleaved (every length and chunk once, then again): peak RSS
above the RSS after imports (min and median over repeats), process CPU time per step, and the
peak's change against chunk 0 at the same length.
--quick: a tiny model, 1 step, one short length (tests/test_benchmarks.py runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# "135m": SmolLM-135M's shape (the size the issue measured); "tiny": the quick check.
SIZES = {
    "tiny": dict(layers=2, hidden=64, heads=4, groups=4, ffn=128, vocab=1024, seq=64, micro=4),
    "135m": dict(layers=30, hidden=576, heads=9, groups=3, ffn=1536, vocab=49152, seq=512, micro=4),
}
RECOMPUTE = {
    "none": [],
    "selective": ["model.recompute_granularity=selective"],
    "full": ["model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"],
}


def worker(size: str, recompute: str, steps: int, out: Path) -> None:
    import torch

    torch.set_num_threads(1)
    from megatron_rlhf import parallel
    from megatron_rlhf.trainers.runner import start_distributed
    from megatron_rlhf.colocation import current_memory_bytes, peak_memory_bytes
    from megatron_rlhf.config import load_config
    from megatron_rlhf.logging.memory import memory_account
    from megatron_rlhf.models.roles import Actor, summed

    s = SIZES[size]
    cfg = load_config(None, [
        f"model.num_layers={s['layers']}", f"model.hidden_size={s['hidden']}", f"model.num_attention_heads={s['heads']}",
        f"model.num_query_groups={s['groups']}", f"model.ffn_hidden_size={s['ffn']}", f"model.vocab_size={s['vocab']}",
        f"model.max_seq_length={s['seq']}", *RECOMPUTE[recompute],
    ])
    start_distributed(cfg)
    baseline = current_memory_bytes()
    actor = Actor(cfg.model, optimizer=cfg.optimizer, max_consecutive_nonfinite=cfg.resilience.max_consecutive_nonfinite)
    batch = {"tokens": torch.randint(0, s["vocab"], (s["micro"], s["seq"]))}
    loss_fn = lambda o, mb: (*summed(-o["logprobs"] - 0.01 * o["entropy"]), {})  # noqa: E731
    start = time.perf_counter()
    for _ in range(steps):
        actor.train_step(batch, s["micro"], loss_fn)
    seconds = (time.perf_counter() - start) / steps
    train_peak = peak_memory_bytes()
    save = measure_save(actor, steps)
    account = memory_account({"actor": actor}, train_peak, baseline)
    # the train phase's account; the save's bytes come from measure_save
    train_account = {k: v for k, v in account.items() if k not in ("roles", "checkpoint_save_bytes")}
    out.write_text(json.dumps({"step_s": seconds, **train_account,
                               "logits_copy_bytes": s["micro"] * s["seq"] * s["vocab"] * 4,
                               "params": sum(p.numel() for p in actor.module.parameters()),
                               "train_peak_bytes": train_peak, **save,
                               "save_over_train": save["save_peak_bytes"] / train_peak,
                               "peak_raised_by_save": save["process_peak_after_save_bytes"] / train_peak}))
    parallel.destroy()


def chunk_worker(size: str, length: int, chunk: int, recompute: str, steps: int, out: Path) -> None:
    """One row of the sequence-length table: an actor at micro batch 1, `length` tokens, chunk
    `chunk` (0: unchunked), activation recomputation `recompute`, `steps` train steps; its peak
    RSS and CPU time."""
    import torch

    torch.set_num_threads(1)
    from megatron_rlhf import parallel
    from megatron_rlhf.colocation import current_memory_bytes, peak_memory_bytes
    from megatron_rlhf.config import load_config
    from megatron_rlhf.models.roles import Actor, summed
    from megatron_rlhf.trainers.runner import start_distributed

    s = SIZES[size]
    cfg = load_config(None, [
        f"model.num_layers={s['layers']}", f"model.hidden_size={s['hidden']}", f"model.num_attention_heads={s['heads']}",
        f"model.num_query_groups={s['groups']}", f"model.ffn_hidden_size={s['ffn']}", f"model.vocab_size={s['vocab']}",
        f"model.max_seq_length={length}", f"model.logits_chunk_tokens={chunk}", *RECOMPUTE[recompute],
    ])
    start_distributed(cfg)
    baseline = current_memory_bytes()
    actor = Actor(cfg.model, optimizer=cfg.optimizer, max_consecutive_nonfinite=cfg.resilience.max_consecutive_nonfinite)
    batch = {"tokens": torch.randint(0, s["vocab"], (1, length))}
    loss_fn = lambda o, mb: (*summed(-o["logprobs"] - 0.01 * o["entropy"]), {})  # noqa: E731
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(steps):
        actor.train_step(batch, 1, loss_fn)
    cpu, wall = (time.process_time() - cpu) / steps, (time.perf_counter() - wall) / steps
    peak = peak_memory_bytes()
    out.write_text(json.dumps({"length": length, "chunk": chunk, "step_cpu_s": cpu, "step_s": wall,
                               "peak_above_baseline_bytes": peak - baseline, "train_peak_bytes": peak,
                               "activation_bytes": actor.activation_bytes,
                               "logits_copy_bytes": length * s["vocab"] * 4}))
    parallel.destroy()


def run_worker(*worker_args: str, out: Path) -> dict:
    """This script's --worker in its own process (one rank, one thread); its JSON."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                           __file__, *worker_args, f"--worker-out={out}"], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(worker_args)}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
    row = json.loads(out.read_text())
    out.unlink()
    return row


def length_table(size: str, lengths: list[int], chunks: list[int], recompute: str, repeats: int, steps: int,
                 tmp: Path) -> list[dict]:
    """The sequence-length table's rows: per (length, chunk), min and median over interleaved repeats."""
    runs: dict[tuple[int, int], list[dict]] = {}
    for _ in range(repeats):
        for length in lengths:
            for chunk in [0, *chunks]:
                row = run_worker("--chunk-worker", size, str(length), str(chunk), recompute, f"--steps={steps}", out=tmp)
                runs.setdefault((length, chunk), []).append(row)
    rows = []
    for (length, chunk), got in runs.items():
        peaks = [r["peak_above_baseline_bytes"] for r in got]
        cpu = [r["step_cpu_s"] for r in got]
        rows.append({"length": length, "chunk": chunk, "recompute": recompute, "repeats": len(got),
                     "peak_above_baseline_min_bytes": min(peaks), "peak_above_baseline_median_bytes": statistics.median(peaks),
                     "step_cpu_min_s": min(cpu), "step_cpu_median_s": statistics.median(cpu),
                     "activation_bytes": got[0]["activation_bytes"], "logits_copy_bytes": got[0]["logits_copy_bytes"]})
    for row in rows:
        unchunked = next(r for r in rows if r["length"] == row["length"] and r["chunk"] == 0)
        row["peak_vs_unchunked"] = row["peak_above_baseline_min_bytes"] / unchunked["peak_above_baseline_min_bytes"]
    return rows


def print_length_table(rows: list[dict]) -> None:
    mib = 2**20
    print(f"{'length':>6} {'chunk':>6} {'peak above MiB min':>18} {'median':>7} {'vs chunk 0':>10} "
          f"{'activations MiB':>15} {'logits copy MiB':>15} {'step CPU s min':>14} {'median':>7}")
    for r in rows:
        print(f"{r['length']:>6} {r['chunk']:>6} {r['peak_above_baseline_min_bytes'] / mib:>18.0f} "
              f"{r['peak_above_baseline_median_bytes'] / mib:>7.0f} {r['peak_vs_unchunked']:>10.2f} "
              f"{r['activation_bytes'] / mib:>15.0f} {r['logits_copy_bytes'] / mib:>15.0f} "
              f"{r['step_cpu_min_s']:>14.1f} {r['step_cpu_median_s']:>7.1f}")


def measure_save(actor, step: int) -> dict:
    """Save the actor as a stage does (CheckpointManager, sync, to a temporary directory)."""
    import tempfile

    import torch.distributed as dist

    from megatron_rlhf.checkpoint.manager import CheckpointManager
    from megatron_rlhf.colocation import current_memory_bytes, peak_memory_bytes

    with tempfile.TemporaryDirectory(prefix="memory_bench_save_") as tmp:
        manager = CheckpointManager(tmp)
        at_start = current_memory_bytes()
        start = time.perf_counter()
        manager.save(step, {"actor": actor}, {"step": step})
        seconds = time.perf_counter() - start
        dist.barrier()
    return {"save_s": seconds, "save_peak_bytes": at_start + manager.last_save_bytes,
            "checkpoint_save_bytes": manager.last_save_bytes, "process_peak_after_save_bytes": peak_memory_bytes()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny size, 1 step: does it run")
    ap.add_argument("--size", choices=sorted(SIZES), default="135m")
    ap.add_argument("--steps", type=int, default=None, help="train steps per row (default 2; --quick: 1)")
    ap.add_argument("--recompute", choices=sorted(RECOMPUTE), action="append",
                    help="only these rows (repeatable; default: all)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/memory.json")
    ap.add_argument("--tables", choices=("recompute", "lengths", "both"), default="both")
    ap.add_argument("--lengths", type=int, nargs="+", help="sequence lengths (default 1024 2048 4096; --quick: 128)")
    ap.add_argument("--chunks", type=int, nargs="+", help="logits_chunk_tokens against 0 (default 256; --quick: 32)")
    ap.add_argument("--length-recompute", choices=sorted(RECOMPUTE), default="none",
                    help="activation recomputation of the length table's rows")
    ap.add_argument("--repeats", type=int, help="interleaved repeats of the length table (default 2; --quick: 1)")
    ap.add_argument("--worker", nargs=2, metavar=("SIZE", "RECOMPUTE"))
    ap.add_argument("--chunk-worker", nargs=4, metavar=("SIZE", "LENGTH", "CHUNK", "RECOMPUTE"))
    ap.add_argument("--worker-out", type=Path)
    args = ap.parse_args()
    steps = args.steps or (1 if args.quick else 2)
    if args.worker:
        return worker(*args.worker, steps, args.worker_out)
    if args.chunk_worker:
        size, length, chunk, recompute = args.chunk_worker
        return chunk_worker(size, int(length), int(chunk), recompute, steps, args.worker_out)

    size = "tiny" if args.quick else args.size
    rows, length_rows = [], []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.tables != "recompute":
        lengths = args.lengths or ([128] if args.quick else [1024, 2048, 4096])
        chunks = args.chunks or ([32] if args.quick else [256])
        repeats = args.repeats or (1 if args.quick else 2)
        length_rows = length_table(size, lengths, chunks, args.length_recompute, repeats, steps,
                                   args.out.with_suffix(".length.tmp"))
    for recompute in (args.recompute or RECOMPUTE) if args.tables != "lengths" else ():
        tmp = args.out.with_suffix(f".{recompute}.tmp")
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                               __file__, "--worker", size, recompute, f"--steps={steps}", f"--worker-out={tmp}"],
                              env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{size} {recompute}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
        rows.append({"size": size, "recompute": recompute, **json.loads(tmp.read_text())})
        tmp.unlink()
    mib = 2**20
    print(f"{'size':<5} {'recompute':<10} {'params':>10} {'step s':>7} {'state MiB':>9} {'activations MiB':>15} "
          f"{'peak above MiB':>14} {'peak/state':>10} {'peak/account':>12} {'other MiB':>9} {'logits copy MiB':>15} "
          f"{'train peak MiB':>14} {'save peak MiB':>13} {'save/train':>10} {'peak raised':>11} {'save s':>6}")
    for r in rows:
        print(f"{r['size']:<5} {r['recompute']:<10} {r['params']:>10} {r['step_s']:>7.2f} {r['model_state_bytes'] / mib:>9.0f} "
              f"{r['activation_bytes'] / mib:>15.0f} {r['peak_above_baseline_bytes'] / mib:>14.0f} "
              f"{r['peak_above_baseline_bytes'] / r['model_state_bytes']:>10.2f} {r['peak_over_account']:>12.2f} "
              f"{r['other_bytes'] / mib:>9.0f} {r['logits_copy_bytes'] / mib:>15.0f} "
              f"{r['train_peak_bytes'] / mib:>14.0f} {r['save_peak_bytes'] / mib:>13.0f} {r['save_over_train']:>10.2f} "
              f"{r['peak_raised_by_save']:>11.2f} {r['save_s']:>6.1f}")
    if length_rows:
        print_length_table(length_rows)
    title = "actor train step peak RSS vs memory account, then a checkpoint save's peak vs it, fp32, CPU, TP1 PP1"
    args.out.write_text(json.dumps({"benchmark": title,
                                    "quick": args.quick, "steps": steps, "shape": SIZES[size], "rows": rows,
                                    "length_table": {"micro_batch": 1, "recompute": args.length_recompute, "rows": length_rows}}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
