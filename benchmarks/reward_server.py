"""Throughput of `serve-reward` (the reward model over HTTP) against client batch size.

    python benchmarks/reward_server.py [--quick] [--ckpt checkpoints/tiny_cpu/rm] [--config pipelines/tiny_cpu.yaml]
        [--batches 1,8,32] [--clients 4] [--seconds 4] [--max-batch 64] [--max-wait-ms 5]
        [--out benchmarks/results/reward_server.json]

Starts `python -m megatron_rlhf serve-reward --port 0` on an RM checkpoint (default: the one
`make pipeline` writes) in its own process, then for each client batch size B runs --clients
threads, each with its own HttpRewardClient (one request of B samples at a time, like one
data-parallel replica), for --seconds after one warm-up call. Samples are random token ids
within the server's vocabulary, prompts and responses of 8-16 tokens each. Reports requests/s,
responses/s (samples scored) and the client-side latency of a call (median, p95). Prints a
markdown table and writes JSON. The server and the clients share this machine's cores.
--quick: client batches 1 and 4, 2 clients, 1 s each; without --ckpt, on an RM of a 2-step SFT ->
RM pipeline it trains first in a temporary directory (QUICK; tests/test_benchmarks.py runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # megatron_rlhf without installing
warnings.filterwarnings("ignore", message="The pynvml package is deprecated")  # torch.cuda's import, harmless
FULL = dict(batches="1,8,32", clients=4, seconds=4.0)
QUICK = dict(batches="1,4", clients=2, seconds=1.0, rm_overrides=[
    "pipeline.stages=[sft,rm]", "checkpoint.run_name=quick", "data.task_sizes.sft_train=64",
    "data.task_sizes.sft_eval=16", "data.task_sizes.preference_train=64", "data.task_sizes.preference_eval=16",
    *(f"{stage}.{key}={value}" for stage in ("sft", "rm") for key, value in
      (("steps", 2), ("eval_interval", 2), ("save_interval", 0), ("optimizer.warmup_steps", 0)))])


def train_quick_rm(config: str, root: Path) -> Path:
    """A 2-step SFT -> RM pipeline under root: its RM stage directory."""
    cmd = [sys.executable, "-m", "megatron_rlhf", "pipeline", "--config", config, f"checkpoint.root={root}",
           *QUICK["rm_overrides"]]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode:
        raise SystemExit(f"training the quick RM failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                         f"{proc.stderr[-4000:]}")
    return root / "quick" / "rm"


def start_server(args) -> tuple[subprocess.Popen, str]:
    """serve-reward on a free port: (its process, its /score URL), once it listens."""
    cmd = [sys.executable, "-m", "megatron_rlhf", "serve-reward", "--config", args.config, "--ckpt", str(args.ckpt),
           "--port", "0", "--max-batch", str(args.max_batch), "--max-wait-ms", str(args.max_wait_ms)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:
        print(line, end="", flush=True)
        if "[serve-reward] listening on " in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
            return proc, line.split("listening on ")[1].split()[0]
    raise SystemExit(f"serve-reward exited {proc.wait()} before listening (its error is above): {' '.join(cmd)}")


def make_inputs(batch: int, vocab: int, rng: random.Random):
    from megatron_rlhf.rewards.base import RewardInputs

    prompt_ids = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 16))] for _ in range(batch)]
    response_ids = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 16))] for _ in range(batch)]
    return RewardInputs([""] * batch, [""] * batch, prompt_ids, response_ids, [True] * batch)


def measure(url: str, batch: int, clients: int, seconds: float, vocab: int) -> dict:
    """`clients` threads scoring `batch` samples per call for `seconds`: the totals and latencies."""
    from megatron_rlhf.rewards.http import HttpRewardClient

    latencies: list[float] = []
    counts = {"requests": 0, "samples": 0, "retries": 0}
    window: dict[str, float] = {}

    def open_window() -> None:  # run once, when every client has warmed up, before any is released
        window["began"] = time.monotonic()
        window["deadline"] = window["began"] + seconds

    lock, start_line = threading.Lock(), threading.Barrier(clients + 1, action=open_window)

    def client_thread(seed: int) -> None:
        rng = random.Random(seed)
        with HttpRewardClient(url, timeout_s=60, batch_size=batch, max_concurrency=1) as client:
            client.score(make_inputs(batch, vocab, rng))  # warm-up: connection, first forward at this size
            client.pop_stats()
            start_line.wait()
            mine = []
            while time.monotonic() < window["deadline"]:
                t0 = time.monotonic()
                client.score(make_inputs(batch, vocab, rng))
                mine.append(time.monotonic() - t0)
            stats = client.pop_stats()
        with lock:
            latencies.extend(mine)
            counts["requests"] += int(stats["requests"])
            counts["retries"] += int(stats["retries"])
            counts["samples"] += len(mine) * batch

    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    start_line.wait()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - window["began"]
    latencies.sort()
    return {"client_batch": batch, "clients": clients, "seconds": elapsed, **counts,
            "requests_per_s": counts["requests"] / elapsed, "responses_per_s": counts["samples"] / elapsed,
            "latency_p50_s": statistics.median(latencies),
            "latency_p95_s": latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{QUICK['batches']}, {QUICK['clients']} clients, "
                    f"{QUICK['seconds']:g} s each, on a 2-step RM unless --ckpt: does it run")
    ap.add_argument("--ckpt", type=Path,
                    help="RM stage directory (default checkpoints/tiny_cpu/rm; --quick: trains one)")
    ap.add_argument("--config", default="pipelines/tiny_cpu.yaml")
    ap.add_argument("--batches", help=f"client batch sizes, comma-separated (default {FULL['batches']})")
    ap.add_argument("--clients", type=int, help=f"concurrent client threads (default {FULL['clients']})")
    ap.add_argument("--seconds", type=float, help=f"measured seconds per batch size (default {FULL['seconds']:g})")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-wait-ms", type=float, default=5.0)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/reward_server.json")
    args = ap.parse_args()
    for key, value in FULL.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else value)
    with tempfile.TemporaryDirectory() as tmp:
        if args.ckpt is None:
            args.ckpt = train_quick_rm(args.config, Path(tmp)) if args.quick else REPO / "checkpoints/tiny_cpu/rm"
        if not args.ckpt.is_dir():
            raise SystemExit(f"no RM checkpoint at {args.ckpt}: run `make pipeline` (it writes "
                             "checkpoints/tiny_cpu/rm) or pass --ckpt <an RM stage directory>, or --quick to train "
                             "a tiny one")
        import httpx

        proc, url = start_server(args)
        try:
            health = httpx.get(url.replace("/score", "/health")).json()
            rows = [measure(url, int(b), args.clients, args.seconds, health["vocab_size"])
                    for b in args.batches.split(",")]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    print(f"\nserve-reward --max-batch {args.max_batch} --max-wait-ms {args.max_wait_ms:g}, {args.clients} client "
          f"threads, {os.cpu_count()} CPUs (server and clients share them)\n")
    print("| client batch | requests/s | responses/s | latency p50 ms | latency p95 ms | retries |\n"
          "|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['client_batch']} | {r['requests_per_s']:.1f} | {r['responses_per_s']:.1f} | "
              f"{1000 * r['latency_p50_s']:.1f} | {1000 * r['latency_p95_s']:.1f} | {r['retries']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "serve-reward throughput vs client batch size (HTTP, loopback, one server process, TP1 PP1)",
        "checkpoint": health["checkpoint"], "max_seq_length": health["max_seq_length"], "max_batch": args.max_batch,
        "max_wait_ms": args.max_wait_ms, "clients": args.clients, "cpu_count": os.cpu_count(), "quick": args.quick,
        "rows": rows},
        indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
