"""A turn's environment steps at the same time (issue 53 item 7): the calculator task's episodes
through the rollout loop, with an environment that sleeps 50 ms per step.

    python benchmarks/env_steps.py [--quick] [--episodes 32] [--sleep-ms 50] [--repeats 5]
        [--hang-timeout-s 0.25] [--out benchmarks/results/env_steps.json]

--episodes of the calculator task's RL prompts (data.task=calculator), each an episode of
CalculatorEnv whose every step sleeps --sleep-ms first (a tool behind a network call), run by
rollout/episodes.py (EpisodeEngine -> generate_episodes -> EpisodeRunner) with a scripted policy:
the engine writes the task's demonstration, the tool call and then the answer read off the
observation, so every episode is two turns and generation costs next to nothing; what is timed
is the environment's part of a rollout. Two variants, interleaved --repeats times:

    one at a time   the runner with workers=1: each step waits for the one before, as every turn
                    ran before issue 53
    pool            the default: up to Environment.concurrency (32) steps at once

Reported per variant: the batch's wall and process-CPU seconds (every thread), min and median;
the speed-up (one at a time / pool, wall); whether both gave the same episodes. Then the hang
drill, once per variant: every step hangs, step_timeout_s = --hang-timeout-s, and the batch
takes that long per turn with the pool, episodes x that long one at a time (the issue's run: 132
episodes x 1 s). Prints a markdown table and writes JSON.
--quick: 8 episodes, 20 ms steps, 1 repeat, a 0.1 s hang timeout (tests/test_benchmarks.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # megatron_rlhf without installing
warnings.filterwarnings("ignore", message="The pynvml package is deprecated")  # torch.cuda's import, harmless
FULL = {"episodes": 32, "sleep_ms": 50.0, "repeats": 5, "hang_timeout_s": 0.25}
QUICK = {"episodes": 8, "sleep_ms": 20.0, "repeats": 1, "hang_timeout_s": 0.1}


def scripted_policy(tokenizer):
    """A rollout engine writing the calculator demonstration's turns: `<calc> expression </calc>`,
    then `answer <the observation's digits>` and EOS."""
    import torch

    from megatron_rlhf.data.tasks.calculator import expression_of
    from megatron_rlhf.rollout import Rollout

    obs, close = tokenizer.encode("<obs>")[0], tokenizer.encode("</obs>")[0]

    class ScriptedPolicy:
        pad_id, needs_refit = tokenizer.pad_id, False

        def generate(self, prompts, sampling, seed):
            new = []
            for row in prompts:
                if obs in row:
                    start = len(row) - row[::-1].index(obs)
                    new.append(tokenizer.encode("answer") + row[start:row.index(close, start)] + [tokenizer.eos_id])
                else:
                    new.append(tokenizer.encode(f"<calc> {expression_of(tokenizer.decode(row))} </calc>"))
            lengths = [len(p) + len(n) for p, n in zip(prompts, new)]
            tokens = torch.full((len(prompts), max(lengths)), self.pad_id)
            for i, (p, n) in enumerate(zip(prompts, new)):
                tokens[i, :lengths[i]] = torch.tensor(p + n)
            return Rollout(tokens, torch.tensor([len(p) for p in prompts]), torch.tensor(lengths),
                           torch.zeros(tokens.shape), torch.tensor([n[-1] == tokenizer.eos_id for n in new]))

    return ScriptedPolicy()


def environments(sleep_s: float):
    from megatron_rlhf.envs.calculator import CalculatorEnv

    class SlowCalculator(CalculatorEnv):
        def step(self, action_text, action_ids):
            time.sleep(sleep_s)
            return super().step(action_text, action_ids)

    class HangingCalculator(CalculatorEnv):
        def step(self, action_text, action_ids):
            time.sleep(60.0)  # past any step timeout here: the abandoned daemon threads end with the process

    return SlowCalculator, HangingCalculator


def one_batch(env_cls, workers: int, episodes: int, step_timeout_s: float, seed: int = 7) -> dict:
    """One rollout of `episodes` calculator prompts: its wall and CPU seconds and its episodes."""
    from megatron_rlhf.data.tasks import TaskSizes, get_task
    from megatron_rlhf.data.tokenizers import WordTokenizer
    from megatron_rlhf.envs.calculator import TURN_TEMPLATE
    from megatron_rlhf.envs.episode import EpisodeRunner
    from megatron_rlhf.rollout import SamplingParams
    from megatron_rlhf.rollout.episodes import EpisodeEngine

    task = get_task("calculator")
    tokenizer = WordTokenizer(task.words())
    prompts = task.splits(seed, TaskSizes(ppo_prompts=episodes)).ppo_prompts
    records = [{"prompt": p.prompt, **p.extra} for p in prompts]
    runner = EpisodeRunner(env_cls, tokenizer, TURN_TEMPLATE, max_turns=3, max_total_tokens=64,
                           step_timeout_s=step_timeout_s, turn_tokens=12, workers=workers)
    engine = EpisodeEngine(scripted_policy(tokenizer), runner, max_failed=1.0)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12)
    wall, cpu = time.perf_counter(), time.process_time()
    engine.generate([tokenizer.encode(r["prompt"]) for r in records], sampling, seed, records=records)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"wall_s": wall, "cpu_s": cpu, "steps": sum(len(e.turns) for e in engine.episodes),
            "failed": sum(e.failure is not None for e in engine.episodes),
            "episodes": [(e.tokens, e.policy_mask, e.failure) for e in engine.episodes]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--episodes", type=int)
    parser.add_argument("--sleep-ms", type=float)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--hang-timeout-s", type=float)
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/env_steps.json"))
    args = parser.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    from megatron_rlhf.envs.base import Environment

    slow, hanging = environments(args.sleep_ms / 1000)
    variants = {"one at a time": 1, "pool": Environment.concurrency}
    one_batch(slow, 1, 2, 30.0)  # imports and first-call costs out of the timings
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.repeats):  # interleaved: a slow moment of the machine hits both variants
        for name, workers in variants.items():
            runs[name].append(one_batch(slow, workers, args.episodes, 30.0))
    rows = []
    for name, workers in variants.items():
        walls, cpus = [r["wall_s"] for r in runs[name]], [r["cpu_s"] for r in runs[name]]
        rows.append({"variant": name, "workers": workers, "episodes": args.episodes, "steps": runs[name][0]["steps"],
                     "sleep_ms": args.sleep_ms, "repeats": args.repeats, "wall_s_min": min(walls),
                     "wall_s_median": statistics.median(walls), "cpu_s_min": min(cpus),
                     "cpu_s_median": statistics.median(cpus), "failed": runs[name][0]["failed"]})
    serial, pool = rows
    same = all(r["episodes"] == runs["pool"][0]["episodes"] for rs in runs.values() for r in rs)
    hang = []
    for name, workers in variants.items():
        run = one_batch(hanging, workers, args.episodes, args.hang_timeout_s)
        hang.append({"variant": name, "workers": workers, "episodes": args.episodes,
                     "step_timeout_s": args.hang_timeout_s, "wall_s": run["wall_s"], "failed": run["failed"]})
    result = {"quick": args.quick, "rows": rows, "same_episodes": same,
              "speedup_min": serial["wall_s_min"] / pool["wall_s_min"],
              "speedup_median": serial["wall_s_median"] / pool["wall_s_median"], "hang": hang}
    print(f"\n{args.episodes} calculator episodes, {serial['steps']} steps of {args.sleep_ms:g} ms, "
          f"{args.repeats} interleaved repeats (min / median)\n")
    print("| variant | workers | wall s | process CPU s |\n|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['variant']} | {row['workers']} | {row['wall_s_min']:.3f} / {row['wall_s_median']:.3f} | "
              f"{row['cpu_s_min']:.3f} / {row['cpu_s_median']:.3f} |")
    print(f"\nspeed-up (wall) min {result['speedup_min']:.1f}x, median {result['speedup_median']:.1f}x; "
          f"same episodes: {same}")
    for row in hang:
        print(f"every step hangs, step_timeout_s={row['step_timeout_s']:g}: {row['variant']}: {row['wall_s']:.2f} s, "
              f"{row['failed']} of {row['episodes']} episodes failed")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
