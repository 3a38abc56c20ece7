"""Asynchronous RL on CPU (issue 36): the RL stage at rl.max_staleness N = 0, 1, 2 with the vLLM engine.

    .venv-vllm/bin/python benchmarks/async_rl.py [--steps 20] [--repeats 3] [--staleness 0 1 2]
        [--eval-interval 5] [--seed 1234] [--cpus 0 1] [--root /tmp/async_rl] [--out benchmarks/results/async_rl.json]
    .venv-vllm/bin/python benchmarks/async_rl.py --quick   # tiny sizes, N = 0 and 1, 3 steps, 1 repeat

The default recipe with the vLLM engine (pipelines/tiny_cpu_vllm.yaml). SFT and RM are trained once
(`pipeline` with pipeline.stages=[sft,rm] in <root>/base; finished stages are skipped on a rerun);
then every RL run is its own `pipeline` (pipeline.stages=[rl], rl.sft_from/rl.rm_from pointing at
base) in <root>/n<N>_r<repeat>, one process, interleaved: one round of all N after another
(N=0, 1, 2, 0, 1, 2, ...), --repeats rounds, so a slow spell of the machine falls on every N alike.

Pinning: each RL run is started with the CPU affinity {trainer CPU, engine CPU} (--cpus, default
the first two this process may use) and rollout.engine_cpus=[engine CPU]: the engine process and
its threads run on that one, the trainer keeps the other (megatron_rlhf/rollout/vllm_process.py).
N = 0 runs pinned the same way, and every N with the same rl.tis_cap (--tis-cap, 2 as
pipelines/tiny_cpu_async.yaml), so the comparison is only the overlap.

Measured per run (rl.log_interval=1: a metrics.jsonl record per step):
  * wall samples/s: samples trained / wall seconds of the steady-state steps, where a step's wall
    seconds are its phases' (wait, sync, generate, score, train: the trainer does them one after
    another, so their sum is the step's wall time) without eval (the benchmark evaluates every
    --eval-interval steps for the gold curves; that costs every N alike and is not training).
    Steady state: the steps after the first --skip-steps (the first step at N >= 1 generates
    its N look-ahead batches in the foreground: the fill) and before the last N (they have no
    batch left to generate ahead: the drain).
  * CPU seconds per sample: user + system time of the whole stage process tree (the launcher,
    the trainer and the engine processes, all descendants reaped in turn: getrusage(RUSAGE_CHILDREN)
    around the run) over the samples trained; it includes start-up and the evals, the same for
    every N. Overlap shortens wall time; CPU time per sample can only rise: it is the cost.
  * trainer idle fraction: seconds the trainer waited for generation (N = 0: the generate
    phase; N >= 1: trainer_wait_seconds) over the steady steps' wall; engine busy fraction:
    generation seconds (N = 0: the generate phase; N >= 1: engine_generate_seconds) over the same.
  * gold curve: eval_gold_score against samples trained (step 0 = the SFT policy); gold final:
    after all --steps (the same number of samples for every N).
Per N: min and median over the repeats (of seconds per sample; samples/s is its inverse), the
speed-up against N = 0 (wall samples/s ratio from the medians, and from the minima beside; goal
N = 1 >= 1.3x), the median gold curve. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "pipelines/tiny_cpu_vllm.yaml"
STEP_PHASES = ("wait", "sync", "generate", "score", "train")  # a step's phases, one after another; eval apart
GOAL = 1.3  # issue 36: N = 1 at >= 1.3x the wall samples/s of N = 0 on 2 cores
QUICK_SIZES = [  # a few steps of everything at tiny sizes: does it run
    *(f"{stage}.{key}={value}" for stage in ("sft", "rm") for key, value in
      (("steps", 2), ("eval_interval", 2), ("save_interval", 0), ("optimizer.warmup_steps", 0))),
    "rl.rollout_batch_size=4", "rl.mini_batch_size=4", "rl.micro_batch_size=4", "sampling.max_new_tokens=8",
    "data.task_sizes.sft_train=64", "data.task_sizes.sft_eval=16", "data.task_sizes.preference_train=64",
    "data.task_sizes.preference_eval=16", "data.task_sizes.ppo_prompts=16", "data.task_sizes.eval_prompts=8"]


# ----------------------------------------------------------------------------- pure functions
def min_median(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "values": list(values)}


def step_wall_seconds(record: dict) -> float:
    """A step's wall seconds: its phases' (the trainer runs them in turn), eval left out."""
    return sum(record.get(f"{phase}_seconds", 0.0) for phase in STEP_PHASES)


def generation_seconds(record: dict, max_staleness: int) -> tuple[float, float]:
    """(seconds the trainer waited for generation, seconds the engine generated) in a step:
    on-policy the trainer waits through the whole generate phase, which is the engine's work;
    asynchronous, the stage measures both (rl_async.AsyncRollouts.metrics)."""
    if max_staleness == 0:
        return record.get("generate_seconds", 0.0), record.get("generate_seconds", 0.0)
    return record.get("trainer_wait_seconds", 0.0), record.get("engine_generate_seconds", 0.0)


def gold_curve(records: list[dict], samples_per_step: int) -> list[list[float]]:
    """[samples trained, eval gold score] at every evaluated step (step 0: the starting policy)."""
    return [[r["step"] * samples_per_step, r["eval_gold_score"]] for r in sorted(records, key=lambda r: r["step"])
            if r.get("eval_gold_score") is not None]


def run_result(records: list[dict], samples_per_step: int, max_staleness: int, skip_steps: int) -> dict:
    """One RL run's figures from its metrics.jsonl records (see the module docstring)."""
    steps = [r for r in records if r["step"] >= 1]
    last = max((r["step"] for r in steps), default=0)
    # the last N steps generate nothing ahead (no batch past rl.steps): the drain, left out like the fill
    steady = [r for r in steps if skip_steps < r["step"] <= last - max_staleness]
    if not steady:
        raise ValueError(f"no steps after the first {skip_steps} and before the last {max_staleness} in "
                         f"{len(steps)} logged steps: run more --steps")
    wall = sum(map(step_wall_seconds, steady))
    waited, generating = (sum(x) for x in zip(*(generation_seconds(r, max_staleness) for r in steady)))
    samples = samples_per_step * len(steady)
    curve = gold_curve(records, samples_per_step)
    return {"steps": len(steps), "steady_steps": len(steady), "steady_samples": samples,
            "steady_wall_seconds": wall, "wall_s_per_sample": wall / samples, "wall_samples_per_s": samples / wall,
            "trainer_idle_fraction": waited / wall, "engine_busy_fraction": generating / wall,
            "phase_seconds": {p: sum(r.get(f"{p}_seconds", 0.0) for r in steady) for p in (*STEP_PHASES, "eval")},
            "staleness_mean": statistics.fmean(r.get("staleness", 0.0) for r in steady),
            "gold_curve": curve, "gold_final": curve[-1][1] if curve else None}


def median_curve(curves: list[list[list[float]]]) -> list[list[float]]:
    """The median gold at each number of samples every curve has."""
    shared = set.intersection(*({x for x, _ in c} for c in curves)) if curves else set()
    return [[x, statistics.median(y for c in curves for cx, y in c if cx == x)] for x in sorted(shared)]


def summarise(runs: list[dict]) -> list[dict]:
    """One row per N: min and median over its repeats, in the order of the N first run."""
    rows = []
    for n in dict.fromkeys(r["max_staleness"] for r in runs):
        rs = [r for r in runs if r["max_staleness"] == n]
        wall = min_median([r["wall_s_per_sample"] for r in rs])
        golds = [r["gold_final"] for r in rs if r["gold_final"] is not None]
        rows.append({
            "max_staleness": n, "repeats": len(rs), "wall_s_per_sample": wall,
            "wall_samples_per_s": {"median": 1 / wall["median"], "best": 1 / wall["min"]},
            "wall_spread": wall["median"] / wall["min"] - 1,
            "cpu_s_per_sample": min_median([r["cpu_s_per_sample"] for r in rs]),
            "process_wall_seconds": min_median([r["process_wall_seconds"] for r in rs]),
            "trainer_idle_fraction": statistics.median(r["trainer_idle_fraction"] for r in rs),
            "engine_busy_fraction": statistics.median(r["engine_busy_fraction"] for r in rs),
            "staleness_mean": statistics.median(r["staleness_mean"] for r in rs),
            "gold_final": min_median(golds) if golds else None,
            "gold_curve_median": median_curve([r["gold_curve"] for r in rs])})
    return rows


def speedups(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Wall samples/s of each N over N = 0's: from the medians, and from the minima beside."""
    base = next((r for r in rows if r["max_staleness"] == 0), None)
    if base is None:
        return {}
    return {str(r["max_staleness"]): {stat: base["wall_s_per_sample"][stat] / r["wall_s_per_sample"][stat]
                                      for stat in ("median", "min")} for r in rows}


def table_lines(rows: list[dict], ratios: dict) -> list[str]:
    """The printed table (markdown) and one line per N with its median gold curve."""
    lines = ["| N | repeats | wall samples/s median (best) | spread | speed-up median (min) | CPU s/sample "
             "median (min) | trainer idle | engine busy | staleness | gold final median (min) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        n, sps, cpu = r["max_staleness"], r["wall_samples_per_s"], r["cpu_s_per_sample"]
        up = ratios.get(str(n))
        gold = r["gold_final"]
        lines.append(
            f"| {n} | {r['repeats']} | {sps['median']:.2f} ({sps['best']:.2f}) | {r['wall_spread']:.1%} | "
            + (f"{up['median']:.2f}x ({up['min']:.2f}x)" if up else "-")
            + f" | {cpu['median']:.3f} ({cpu['min']:.3f}) | {r['trainer_idle_fraction']:.2f} | "
            f"{r['engine_busy_fraction']:.2f} | {r['staleness_mean']:.2f} | "
            + (f"{gold['median']:.3f} ({gold['min']:.3f})" if gold else "-") + " |")
    lines.append("")
    for r in rows:
        lines.append(f"gold curve N={r['max_staleness']} (samples: median gold): "
                     + "  ".join(f"{int(x)}: {y:.3f}" for x, y in r["gold_curve_median"]))
    if "1" in ratios:
        met = ratios["1"]["median"] >= GOAL
        lines.append(f"goal N=1 >= {GOAL}x the wall samples/s of N=0: {'met' if met else 'not met'} "
                     f"({ratios['1']['median']:.2f}x, median)")
    return lines


# ----------------------------------------------------------------------------- running stages
def pipeline_cmd(root: Path, run: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
            "-m", "megatron_rlhf", "pipeline", "--config", str(RECIPE), f"checkpoint.root={root}",
            f"checkpoint.run_name={run}", *overrides]


def run_logged(cmd: list[str], log: Path, cpus: set[int] | None = None) -> tuple[float, float]:
    """Run `cmd` (output to `log`, its tail on failure); returns (wall seconds, CPU seconds of the
    whole process tree: user + system of every descendant reaped meanwhile)."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"},
                              preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        sys.stderr.write(log.read_text()[-6000:])
        raise SystemExit(f"{' '.join(cmd[-8:])} exited {proc.returncode} (log: {log})")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def stage_dir(root: Path, run: str, algorithm: str) -> Path:
    return root / run / algorithm


def build_base(root: Path, sizes: list[str]) -> tuple[Path, Path]:
    """SFT and RM once, in <root>/base (a finished stage is skipped by the pipeline)."""
    (root / "logs").mkdir(parents=True, exist_ok=True)
    base = root / "base"
    if not all((base / s / "summary.json").exists() for s in ("sft", "rm")):
        print(f"SFT and RM in {base} ...", flush=True)
        wall, _ = run_logged(pipeline_cmd(root, "base", [*sizes, "pipeline.stages=[sft,rm]"]), root / "logs/base.log")
        print(f"  {wall:.0f} s", flush=True)
    return base / "sft", base / "rm"


def rl_overrides(args, n: int, sft: Path, rm: Path, repeat: int = 0) -> list[str]:
    """Repeat r runs with seed --seed + r (the same seeds for every N: matched pairs; the spread of
    gold over the repeats is the seed noise that N's effect on learning is compared with)."""
    return [*args.sizes, "pipeline.stages=[rl]", f"rl.sft_from={sft}", f"rl.rm_from={rm}", f"rl.steps={args.steps}",
            f"seed={args.seed + repeat}",
            f"rl.max_staleness={n}", f"rollout.engine_cpus=[{args.cpus[1]}]", "rl.log_interval=1",
            f"rl.eval_interval={args.eval_interval}", "rl.save_interval=0", f"rl.tis_cap={args.tis_cap}"]


def run_rl(args, n: int, repeat: int, sft: Path, rm: Path) -> dict:
    """One RL run at rl.max_staleness=n (a fresh run directory: nothing resumes)."""
    from megatron_rlhf.config import load_config  # light: no torch

    run, overrides = f"n{n}_r{repeat}", rl_overrides(args, n, sft, rm, repeat)
    cfg = load_config(RECIPE, overrides)
    out = stage_dir(args.root, run, cfg.rl.algorithm)
    if (args.root / run).exists():
        subprocess.run(["rm", "-rf", str(args.root / run)], check=True)
    wall, cpu = run_logged(pipeline_cmd(args.root, run, overrides), args.root / "logs" / f"{run}.log", set(args.cpus))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((out / "summary.json").read_text())
    samples = cfg.rl.samples_per_iteration * summary["steps"]
    result = run_result(records, cfg.rl.samples_per_iteration, n, args.skip_steps)
    result.update(max_staleness=n, repeat=repeat, process_wall_seconds=wall, cpu_seconds=cpu,
                  samples_trained=samples, cpu_s_per_sample=cpu / samples,
                  summary_engine_generate_seconds=summary.get("engine_generate_seconds"),
                  summary_samples_per_second=summary.get("samples_per_second"))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="RL steps per run")
    ap.add_argument("--repeats", type=int, default=3, help="runs per N, interleaved with the other N")
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2], help="rl.max_staleness values")
    ap.add_argument("--eval-interval", type=int, default=5, help="RL steps between gold evaluations")
    ap.add_argument("--seed", type=int, default=1234, help="repeat r runs with seed + r (every N the same seeds)")
    ap.add_argument("--skip-steps", type=int, default=1, help="first steps left out of the steady state")
    ap.add_argument("--tis-cap", type=float, default=2.0,
                    help="rl.tis_cap for every N (as pipelines/tiny_cpu_async.yaml): the same objective throughout")
    ap.add_argument("--cpus", type=int, nargs=2, help="trainer CPU, engine CPU (default: the first two allowed)")
    ap.add_argument("--root", type=Path, help="run directory (default /tmp/async_rl; --quick: a temporary one)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/async_rl.json")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, N = 0 and 1, 3 steps, 1 repeat")
    args = ap.parse_args()
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("vLLM does not import: run with .venv-vllm/bin/python (make vllm-setup)")
    allowed = sorted(os.sched_getaffinity(0))
    args.cpus = args.cpus or allowed[:2]
    if len(set(args.cpus)) != 2 or not set(args.cpus) <= set(allowed):
        raise SystemExit(f"--cpus {args.cpus}: two distinct CPUs among this process's {allowed}")
    if args.quick:
        args.steps, args.repeats, args.staleness, args.eval_interval = 3, 1, [0, 1], 1
    if args.steps <= args.skip_steps + max(args.staleness):
        raise SystemExit(f"--steps {args.steps}: more than --skip-steps {args.skip_steps} + the largest --staleness "
                         f"{max(args.staleness)} needed for a steady state")
    args.sizes = QUICK_SIZES if args.quick else []
    with tempfile.TemporaryDirectory(prefix="async_rl_") as tmp:
        args.root = args.root or (Path(tmp) if args.quick else Path("/tmp/async_rl"))
        sft, rm = build_base(args.root, args.sizes)
        runs = []
        for repeat in range(args.repeats):
            for n in args.staleness:
                r = run_rl(args, n, repeat, sft, rm)
                runs.append(r)
                print(f"  repeat {repeat + 1}/{args.repeats} N={n}: {r['wall_samples_per_s']:.2f} samples/s wall, "
                      f"{r['cpu_s_per_sample']:.3f} CPU s/sample, gold {r['gold_final']}, "
                      f"process {r['process_wall_seconds']:.0f} s", flush=True)
    rows = summarise(runs)
    ratios = speedups(rows)
    print(f"\nRL stage, {RECIPE.name}, {args.steps} steps (the first {args.skip_steps} and the last N left out), trainer on CPU {args.cpus[0]}, "
          f"engine on CPU {args.cpus[1]}; {args.repeats} interleaved repeats")
    print("\n".join(table_lines(rows, ratios)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "asynchronous RL (rl.max_staleness) on CPU, vLLM engine, trainer and engine pinned one core each",
        "quick": args.quick, "recipe": str(RECIPE.relative_to(REPO)),
        "config": {"steps": args.steps, "repeats": args.repeats, "staleness": args.staleness,
                   "eval_interval": args.eval_interval, "tis_cap": args.tis_cap, "skip_steps": args.skip_steps, "cpus": args.cpus,
                   "overrides": args.sizes},
        "wall_definition": "samples trained / sum of the steady steps' wait+sync+generate+score+train seconds",
        "cpu_definition": "user+system seconds of the stage's whole process tree / samples trained",
        "goal": {"max_staleness": 1, "speedup_at_least": GOAL}, "speedups": ratios, "rows": rows, "runs": runs},
        indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
