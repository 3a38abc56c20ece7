"""Process CPU time of one PPO train step, by part, the step glue before commit 78be0af against today's.

    python benchmarks/train_step.py [--quick] [--repeats 5] [--steps 20] [--batch 8] [--out benchmarks/results/train_step.json]

The vs-TRL shape (benchmarks/vs_trl.py, issue 18): a 2-layer Llama (hidden 128, 4 heads, FFN 512),
the built-in task's vocabulary, fp32, one process (TP1 PP1 DP1, gloo), torch.set_num_threads(1).
One rollout of --batch prompts (3..6 ids) with exactly 32 new tokens is generated and scored once;
every variant then trains its own actor and critic (built from the same seed) on that minibatch
(micro batch = minibatch, as vs_trl.py runs it) with the RL stage's loss functions. Variants:

  before    the step glue before commit 78be0af (issue 32): megatron's torch AdamW as megatron builds it
            (fused and foreach unset: torch's single-tensor loop on CPU), a NaN guard running
            `torch.isfinite(t).all()` with one host read per gradient buffer and loss, and
            `model.train()` over every module on every step. Reached by undoing those
            three changes on the variant's roles (groups' flags back to None; the guard's and
            the train() walk's old code, copied below).
  after     today's: fused AdamW, the summed finiteness screen, no train() walk when every
            module is already training.
  after+plain  as after with optimizer.use_distributed_optimizer=false: megatron's
            non-distributed optimizer. NOT the default (its checkpoints do not load into a
            DistributedOptimizer at DP2, nor the other way); shown for what it would save
            on top of the fused kernel.

Each part is timed with time.process_time (all threads of the process) around the role's own
methods: forward+backward (`Role._forward_backward`: mode switch, zeroing, megatron's schedule,
DDP finalise), the guard (`guard.should_skip`), `optimizer.step` (grad norm, clip, Adam, param
sync) and the whole `train_step`. Repeats are interleaved (before, after, after+plain, before, ...);
each repeat runs --steps steps per role and variant after 2 warm-up steps and yields the mean per
step. The table shows min and median over repeats. Writes JSON. Every variant runs with today's
CPU adaptations (parallel/cpu.py, e.g. the one-rank reduce-scatter / all-gather skipped at DP=1),
so "before" isolates the three glue changes, not all of main's history.
--quick: B=4, 8 new tokens, 2 repeats of 2 steps (tests/test_benchmarks.py runs it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "pipelines/tiny_cpu.yaml"
LAYERS, HIDDEN, HEADS, FFN = 2, 128, 4, 512
FULL = dict(batch=8, repeats=5, steps=20, new_tokens=32)
QUICK = dict(batch=4, repeats=2, steps=2, new_tokens=8)
VARIANTS = ("before", "after", "after+plain")
PARTS = ("fwd_bwd", "guard", "optimizer", "train_step")


def config(batch: int, distributed_optimizer: bool, new_tokens: int):
    from megatron_rlhf.config import load_config

    return load_config(RECIPE, [
        f"model.num_layers={LAYERS}", f"model.hidden_size={HIDDEN}", f"model.num_attention_heads={HEADS}",
        f"model.num_query_groups={HEADS}", f"model.ffn_hidden_size={FFN}",
        "model.make_vocab_size_divisible_by=1", "model.max_seq_length=64",
        f"rl.rollout_batch_size={batch}", f"rl.mini_batch_size={batch}", f"rl.micro_batch_size={batch}",
        f"sampling.max_new_tokens={new_tokens}", "rl.steps=100",
        f"optimizer.use_distributed_optimizer={str(distributed_optimizer).lower()}"])


# ---------------------------------------------------------------- the code before 78be0af, for the baseline
def old_should_skip(guard, losses, grads) -> bool:
    """NonFiniteGuard.should_skip's check before 78be0af (counting left out: every step is finite)."""
    from megatron_rlhf.parallel import any_rank

    def all_finite(tensors):
        return all(bool(torch.isfinite(t).all()) for t in tensors)

    return any_rank(not (all_finite(losses) and all_finite(grads)))


def as_before(role) -> None:
    """Undo today's step glue on `role` (see the module docstring)."""
    from megatron_rlhf.models import roles
    from megatron_rlhf.models.optimizer import _inner_optimizers, _torch_adam

    for opt in _inner_optimizers(role.optimizer):
        for group in _torch_adam(opt).param_groups:
            group["fused"] = group["foreach"] = None  # as megatron builds it
    forward_backward, set_training = role._forward_backward, roles.set_training

    def with_train_walk(*args, **kwargs):
        roles.set_training = lambda model, training: model.train(training)  # before: every call
        try:
            return forward_backward(*args, **kwargs)
        finally:
            roles.set_training = set_training

    role._forward_backward = with_train_walk
    role.guard.should_skip = partial(old_should_skip, role.guard)


# ---------------------------------------------------------------- timing
def timed(obj, name: str, totals: dict, part: str) -> None:
    """Wrap obj.<name> so that each call adds its process CPU seconds to totals[part]."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[part] += time.process_time() - start

    setattr(obj, name, wrapper)


def instrument(role) -> dict:
    totals = dict.fromkeys(PARTS, 0.0)
    timed(role, "_forward_backward", totals, "fwd_bwd")
    timed(role.guard, "should_skip", totals, "guard")
    timed(role.optimizer, "step", totals, "optimizer")
    timed(role, "train_step", totals, "train_step")
    return totals


def ppo_minibatch(roles, cfg, batch: int, new_tokens: int):
    """One generated and scored rollout as the train step's minibatch (as train_on_rollout builds it)."""
    from megatron_rlhf.data.encode import EncodedPrompt
    from megatron_rlhf.data.jsonl import PromptExample
    from megatron_rlhf.rewards import RewardSources
    from megatron_rlhf.rollout import MegatronRolloutEngine, SamplingParams
    from megatron_rlhf.trainers import rl as stage
    from megatron_rlhf.models.batching import by_length
    from megatron_rlhf.trainers.stage_data import tokenizer_for

    g = torch.Generator().manual_seed(0)
    prompts = [EncodedPrompt(torch.randint(3, cfg.model.vocab_size, (int(k),), generator=g).tolist(), PromptExample("-"))
               for k in torch.randint(3, 7, (batch,), generator=g)]
    engine = MegatronRolloutEngine(cfg.model, roles["actor"], eos_id=-1, pad_id=0)  # no EOS: full-length responses
    rewards = RewardSources(cfg.rl.rewards, roles.get("reward"), micro_batch_size=cfg.rl.micro_batch_size,
                            micro_batch_tokens=cfg.rl.micro_batch_tokens)
    score_fn = partial(stage.sequence_rewards, rewards, tokenizer=tokenizer_for(cfg), rl=cfg.rl)
    generation = stage.generate(engine, score_fn, lambda: prompts, cfg.rl, SamplingParams(max_new_tokens=new_tokens), seed=0)
    ppo_batch = stage.score(generation.rollout, generation.rewards or score_fn(generation.rollout, generation.rows), roles,
                            cfg.rl)
    stage.add_advantages(ppo_batch, cfg.rl, 0.05, cfg.sampling.max_new_tokens)
    return ppo_batch.select(by_length(ppo_batch.lengths)).tensors()


def run(batch: int, repeats: int, steps: int, new_tokens: int) -> dict:
    from megatron_rlhf import parallel
    from megatron_rlhf.trainers.runner import start_distributed
    from megatron_rlhf.trainers import rl as stage
    from megatron_rlhf.trainers.stage_data import resolve_vocab_size, tokenizer_for

    torch.set_num_threads(1)
    cfgs = {v: config(batch, distributed_optimizer=v != "after+plain", new_tokens=new_tokens) for v in VARIANTS}
    cfgs = {v: resolve_vocab_size(cfg, tokenizer_for(cfg))[0] for v, cfg in cfgs.items()}
    start_distributed(cfgs["before"])
    trained, totals = {}, {}
    for variant, cfg in cfgs.items():
        parallel.seed_everything(cfg.seed)  # the same initial weights for every variant
        roles = stage.build_roles(cfg)
        if variant == "before":
            minibatch = ppo_minibatch(roles, cfg, batch, new_tokens)
        for name in ("actor", "critic"):
            if variant == "before":
                as_before(roles[name])
            trained[variant, name] = roles[name]
            totals[variant, name] = instrument(roles[name])
    cfg = cfgs["before"]
    losses = {"actor": partial(stage.actor_loss, rl=cfg.rl, kl_coef=0.05), "critic": partial(stage.critic_loss, rl=cfg.rl)}
    torch.set_num_threads(1)  # again, in case an import or initialize changed it

    def steps_ms(variant: str, name: str, n: int) -> dict[str, float]:
        sums = totals[variant, name]
        for p in PARTS:
            sums[p] = 0.0
        for _ in range(n):
            if trained[variant, name].train_step(minibatch, cfg.rl.micro_batch_size, losses[name])["skipped"]:
                raise RuntimeError(f"{variant} {name}: a step was skipped as non-finite")
        return {p: 1000 * sums[p] / n for p in PARTS}

    for key in trained:
        steps_ms(*key, 2)  # warm-up
    per_step = {key: {p: [] for p in PARTS} for key in trained}
    for _ in range(repeats):
        for key in trained:  # interleaved: before, after, after+plain, before, ...
            for p, ms in steps_ms(*key, steps).items():
                per_step[key][p].append(ms)
    parallel.destroy()
    rows = []
    for (variant, name), parts in per_step.items():
        row = {"variant": variant, "role": name}
        for p, ms in parts.items():
            row[f"{p}_ms_min"], row[f"{p}_ms_median"] = min(ms), statistics.median(ms)
        row["other_ms_median"] = row["train_step_ms_median"] - sum(row[f"{p}_ms_median"] for p in PARTS[:3])
        row["repeats_ms"] = parts
        rows.append(row)
    return {"batch": batch, "sequence": int(minibatch["tokens"].size(1)), "repeats": repeats, "steps": steps,
            "threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows}


def print_table(result: dict) -> None:
    print(f"train step, process CPU ms per step (min / median over {result['repeats']} interleaved repeats of "
          f"{result['steps']} steps), B={result['batch']}, S={result['sequence']}, {result['threads']} thread")
    print(f"{'role':<7} {'variant':<13} {'fwd+bwd':>13} {'guard':>11} {'optimizer':>11} {'train_step':>13} {'other':>6}")
    for r in result["rows"]:
        cells = [f"{r[f'{p}_ms_min']:.2f}/{r[f'{p}_ms_median']:.2f}" for p in PARTS]
        print(f"{r['role']:<7} {r['variant']:<13} {cells[0]:>13} {cells[1]:>11} {cells[2]:>11} {cells[3]:>13} "
              f"{r['other_ms_median']:>6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="B=4, 8 new tokens, 2 repeats of 2 steps: does it run")
    ap.add_argument("--batch", type=int, default=None, help="rollout = minibatch = micro batch (default 8; --quick: 4)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 5; --quick: 2)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per repeat (default 20; --quick: 2)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/train_step.json")
    args = ap.parse_args()
    defaults = QUICK if args.quick else FULL
    batch, repeats, steps = (getattr(args, k) if getattr(args, k) is not None else defaults[k]
                             for k in ("batch", "repeats", "steps"))
    import megatron_rlhf  # noqa: F401  (before megatron.core: it adapts megatron-core to CPU)

    result = run(batch, repeats, steps, defaults["new_tokens"])
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "PPO train step parts, vs-TRL shape, fp32, CPU, TP1 PP1, 1 thread",
                                    "quick": args.quick, **result}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
